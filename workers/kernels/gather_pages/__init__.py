"""Page gather: scattered raw pages (pinned host or device memory) -> K/V page-cache slots in one launch.

``gather_pages`` (launcher: Triton on CUDA, else the torch reference), its tuning ``GatherConfig``, and
the torch reference ``gather_pages_ref``.
"""

from .ops import DEFAULT_GATHER, GatherConfig, gather_pages, triton_available
from .reference import gather_pages_ref

__all__ = ["DEFAULT_GATHER", "GatherConfig", "gather_pages", "gather_pages_ref", "triton_available"]
