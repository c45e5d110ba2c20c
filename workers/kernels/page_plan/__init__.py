"""Page plan: a fetch's lookup, windowed-LRU victims and map updates computed on the device, fixed shape.

``plan_pages`` (launcher: the Triton kernel or the torch reference), the tables it updates
(``PlanState``) and the torch reference ``plan_pages_ref``.
"""

from .ops import plan_pages
from .reference import plan_pages_ref
from .state import WINDOW_MIN, PlanState

__all__ = ["WINDOW_MIN", "PlanState", "plan_pages", "plan_pages_ref"]
