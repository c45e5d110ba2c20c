"""Own-row writes: each member of a decode step's new K/V row into its own buffer, at its position, in one launch.

``write_own_rows`` (launcher: Triton on CUDA, else the torch reference), the member table it reads
(``own_rows_table``), and the torch reference ``write_own_rows_ref``.
"""

from .ops import OwnRowsTable, own_rows_table, write_own_rows
from .reference import write_own_rows_ref

__all__ = ["OwnRowsTable", "own_rows_table", "write_own_rows", "write_own_rows_ref"]
