"""A step's token ids -> host-view pool rows and the distinct pages read, in a C++ kernel (integer work only).

``token_rows`` is the launcher, ``page_rows`` its page-id form (built once per machine by
``native/build.py``; they raise when the kernel is unavailable: callers check ``cpu_kernel_available`` and
keep numpy otherwise); ``token_rows_ref`` the plain torch reference.
"""

from .ops import cpu_kernel_available, page_rows, token_rows
from .reference import token_rows_ref

__all__ = ["cpu_kernel_available", "page_rows", "token_rows", "token_rows_ref"]
