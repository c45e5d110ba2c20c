"""φ completion's per-step term on the CPU in a C++ kernel (built once per machine, as ``index_page_mass``).

``phi_mlp`` runs a distilled map's head-wise MLP, ``phi_pack`` packs a step's keys whose features are not cached,
``phi_term`` sums, subtracts and evaluates; ``reference.py`` has the torch ops each matches to float32 rounding.
Without a compiler (``cpu_kernel_available`` False, logged once) φ completion keeps those torch ops.
"""

from .ops import MlpLayer, cpu_kernel_available, phi_mlp, phi_pack, phi_step, phi_term
from .reference import phi_mlp_ref, phi_term_ref

__all__ = ["MlpLayer", "cpu_kernel_available", "phi_mlp", "phi_mlp_ref", "phi_pack", "phi_step", "phi_term",
           "phi_term_ref"]
