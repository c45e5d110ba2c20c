"""A decode row's attended K/V entries gathered from a CPU pool in one C++ call (copies only: the same bits).

``gather_entries`` is the launcher (built once per machine by ``native/build.py``; it raises when the
kernel is unavailable: callers check ``gather_entries_usable`` and keep the torch path otherwise);
``gather_entries_ref`` the plain torch reference; ``attend_entries`` the torch form's attention over the entries.
"""

from .ops import attend_entries, cpu_kernel_available, gather_entries, gather_entries_usable
from .reference import gather_entries_ref

__all__ = ["attend_entries", "cpu_kernel_available", "gather_entries", "gather_entries_ref", "gather_entries_usable"]
