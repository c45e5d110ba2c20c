"""Bounds on what one caller may ask the store to hold: checked before anything is allocated or created."""

from __future__ import annotations

from store.errors import InvalidInput
from store.layout import KVLayout
from store.prefix_key import PrefixKey

MAX_TOKENS = 1 << 24
"""Tokens of one prefix (far beyond any model's context)."""
MAX_LAYERS = 1024
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_PAGE_SIZE = 4096
MAX_NAME_CHARS = 256
"""Model names, fingerprints, token hashes, summarizer and artifact names."""
MAX_SUMMARIZERS = 32
MAX_ARTIFACTS = 64
MIN_ARTIFACT_BUDGET = 64 << 20
"""Bytes the artifacts of any prefix may take together, however small its page files (``max_artifact_bytes``)."""
MAX_HOLDER_BYTES = 256
"""A lease holder's name (it is stored with the lease)."""


def max_artifact_bytes(page_bytes: int) -> int:
    """The most bytes the artifacts of a prefix whose page files take ``page_bytes`` may take together.

    A summary is never bigger than the K/V it summarizes: Quest bounds, φ caches, k-means clusters and page
    CRCs hold a few vectors (or one number) per page or cluster, each smaller than the page(s) it stands for.
    So the page files bound the artifacts, at any context length (a 128k-token prefix of Llama-3.1-8B's shape
    has over 1 GiB of summaries beside 16 GiB of pages). The floor leaves room for the fixed-size parts of a
    tiny prefix's summaries (headers, centroids, learned weights). Artifacts are files in the prefix
    directory, written as they arrive: this bounds the disk a write may take, not memory.
    """
    return max(MIN_ARTIFACT_BUDGET, page_bytes)


DERIVED_ARTIFACT_FACTOR = 2
"""Times its page bytes a committed prefix's added artifacts may take beyond ``max_artifact_bytes`` (``max_added_
artifact_bytes``)."""


def max_added_artifact_bytes(page_bytes: int) -> int:
    """The most bytes a committed prefix's artifacts may take together once caches derived from it are added
    (``KVStore.add_artifact``: compressed caches, each at most its ratio of the K/V).

    Beyond the summaries' budget, ``DERIVED_ARTIFACT_FACTOR`` times the page bytes: room for one compressed
    cache at several ratios (0.1, 0.2, 0.3 and 0.5 together take 1.1 times the K/V). The tenant's byte quota
    still bounds what a tenant stores in all."""
    return max_artifact_bytes(page_bytes) + DERIVED_ARTIFACT_FACTOR * page_bytes


def check_text(what: str, value: str, max_chars: int = MAX_NAME_CHARS) -> str:
    """``value`` when it is at most ``max_chars`` long; InvalidInput (not echoing it) otherwise."""
    if len(value) > max_chars:
        raise InvalidInput(f"{what} is longer than {max_chars} characters")
    return value


def check_layout(layout: KVLayout) -> KVLayout:
    """``layout`` when every dimension is within the store's bounds; InvalidInput otherwise."""
    for name, top in (("n_layers", MAX_LAYERS), ("n_kv_heads", MAX_KV_HEADS), ("head_dim", MAX_HEAD_DIM),
                      ("page_size", MAX_PAGE_SIZE)):
        if not 0 < getattr(layout, name) <= top:
            raise InvalidInput(f"layout {name} must be in [1, {top}], got {getattr(layout, name)}")
    return layout


def check_write(key: PrefixKey, n_tokens: int, model_name: str) -> int:
    """Validate a write's key and size; returns the bytes its page files will take."""
    if not 0 < n_tokens <= MAX_TOKENS:
        raise InvalidInput(f"n_tokens must be in [1, {MAX_TOKENS}], got {n_tokens}")
    check_layout(key.layout)
    check_text("model_name", model_name)
    check_text("model_fingerprint", key.model_fingerprint)
    check_text("token_hash", key.token_hash)
    if len(key.summarizers) > MAX_SUMMARIZERS:
        raise InvalidInput(f"at most {MAX_SUMMARIZERS} summarizers")
    for name, _ in key.summarizers:
        check_text("summarizer name", name)
    return key.layout.n_layers * key.layout.layer_file_bytes(n_tokens)


def check_holder(holder: str) -> str:
    """A lease holder's name when it is at most ``MAX_HOLDER_BYTES`` (UTF-8); InvalidInput otherwise."""
    if len(holder.encode("utf-8", "surrogatepass")) > MAX_HOLDER_BYTES:
        raise InvalidInput(f"lease holder is longer than {MAX_HOLDER_BYTES} bytes")
    return holder
