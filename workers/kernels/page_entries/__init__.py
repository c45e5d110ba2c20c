"""Page entries: a single-row page step's picked pages -> its attention entries (rows, bias, mid count), one launch.

``page_entries`` (launcher: Triton on CUDA, else the torch reference), its result ``PageEntries``, tuning
``PageEntriesConfig``, and the torch reference ``page_entries_ref``.
"""

from .entries import PageEntries
from .ops import DEFAULT_PAGE_ENTRIES, PageEntriesConfig, page_entries
from .reference import page_entries_ref

__all__ = ["DEFAULT_PAGE_ENTRIES", "PageEntries", "PageEntriesConfig", "page_entries", "page_entries_ref"]
