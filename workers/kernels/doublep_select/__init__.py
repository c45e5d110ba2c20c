"""Double-P's per-step bookkeeping on the CPU after the stage-1 masses, in a C++ kernel.

``doublep_select`` is the launcher (the kernel built once per machine by ``native/build.py``; it raises
when the kernel is unavailable, so callers check ``cpu_kernel_available`` and keep their numpy/torch path);
``doublep_select_ref`` the plain torch reference; both return a ``DoublePPick``.
"""

from .ops import DoublePKernel, cpu_kernel_available, doublep_select
from .reference import doublep_select_ref
from .types import DoublePPick

__all__ = ["DoublePKernel", "DoublePPick", "cpu_kernel_available", "doublep_select", "doublep_select_ref"]
