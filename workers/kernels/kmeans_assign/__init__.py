"""K-means assignment: each point's nearest centroid, without materialising the distances, one launch.

``kmeans_assign`` (launcher: Triton on CUDA, else the torch reference), its tuning ``KmeansAssignConfig``,
and the torch reference ``kmeans_assign_ref``.
"""

from .ops import DEFAULT_KMEANS_ASSIGN, MAX_HEAD_DIM, KmeansAssignConfig, kmeans_assign
from .reference import kmeans_assign_ref

__all__ = ["DEFAULT_KMEANS_ASSIGN", "MAX_HEAD_DIM", "KmeansAssignConfig", "kmeans_assign", "kmeans_assign_ref"]
