"""Quest page scores: upper-bound logits of query rows over stacked page bounds, one launch.

``quest_upper_bounds`` and ``quest_upper_bounds_members`` (several members' rows, each over its own bounds, in
one launch; ``member_offsets`` makes its table) are the launchers (Triton on CUDA, else the torch reference);
``QuestScoresConfig`` their tuning; ``quest_upper_bounds_ref`` the torch reference.
"""

from .ops import DEFAULT_QUEST_SCORES, QuestScoresConfig, member_offsets, quest_upper_bounds, quest_upper_bounds_members
from .reference import quest_upper_bounds_ref

__all__ = ["DEFAULT_QUEST_SCORES", "QuestScoresConfig", "member_offsets", "quest_upper_bounds",
           "quest_upper_bounds_members", "quest_upper_bounds_ref"]
