"""Unit top-k: the k best units per row (ascending ids, ties to the lower id), fixed shape, no host sync.

``top_units`` / ``group_top_units`` (launchers: Triton on CUDA, else the torch reference), their tuning
``TopConfig``, and the torch references.
"""

from .ops import DEFAULT_TOP, TopConfig, group_top_units, top_units
from .reference import group_mass_ref, group_top_units_ref, top_units_ref

__all__ = ["DEFAULT_TOP", "TopConfig", "group_mass_ref", "group_top_units", "group_top_units_ref", "top_units",
           "top_units_ref"]
