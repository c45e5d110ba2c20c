"""Quest page scores: upper-bound logits of query rows over stacked page bounds, one launch.

``quest_upper_bounds`` (launcher: Triton on CUDA, else the torch reference), its
tuning ``QuestScoresConfig``, and the torch reference ``quest_upper_bounds_ref``.
"""

from .ops import DEFAULT_QUEST_SCORES, QuestScoresConfig, quest_upper_bounds
from .reference import quest_upper_bounds_ref

__all__ = ["DEFAULT_QUEST_SCORES", "QuestScoresConfig", "quest_upper_bounds", "quest_upper_bounds_ref"]
