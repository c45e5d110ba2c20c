"""Top-K's page mass on the CPU, scored on the key index's low-bit codes by a fused C++ kernel.

``index_page_mass`` is the launcher (the kernel, built once per machine by ``build.py``; it raises when the
kernel is unavailable, so callers check ``cpu_kernel_preferred``, built with AVX-512, and keep the torch path
otherwise); ``CodeTiles`` the
layout of a layer's codes it reads; ``IndexPageMassConfig`` its threading; ``page_mass_ref`` the torch reference.
"""

from .ops import (
    DEFAULT_PAGE_MASS,
    CodeTiles,
    IndexPageMassConfig,
    cpu_kernel_available,
    cpu_kernel_preferred,
    index_page_mass,
)
from .reference import page_mass_ref

__all__ = ["DEFAULT_PAGE_MASS", "CodeTiles", "IndexPageMassConfig", "cpu_kernel_available", "cpu_kernel_preferred",
           "index_page_mass", "page_mass_ref"]
