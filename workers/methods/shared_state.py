"""Read-only state the generations over one stored prefix share: read from its artifact once, held while used.

Generations over one prefix on one device score against the same summaries (Quest's stacked page bounds,
Top-K's key index and its decoded keys). Each would otherwise read the artifact and hold its own copy: with
many questions over one document, as many copies. ``shared_by_prefix`` hands out the one a live generation
holds (nothing is read then), else makes it from the artifact; the registry keeps only weak references, so the
state goes with the last generation holding it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from workers.methods.source import PrefixSource


class SharedState(Protocol):
    """What ``shared_by_prefix`` hands out: weak-referenceable, and says whether it is shared."""

    shared_across_generations: bool
    """True when handed out by ``shared_by_prefix`` (its bytes are then no one generation's own)."""


S = TypeVar("S", bound=SharedState)

_HELD: weakref.WeakValueDictionary[tuple[str, str, str], SharedState] = weakref.WeakValueDictionary()
"""The shared state in use, by ``PrefixSource.shared_key`` (artifact name, digest, device)."""
_LOCK = threading.Lock()


def shared_by_prefix(source: PrefixSource, artifact: str, make: Callable[[Any], S], *, streamed: bool = False
                     ) -> S:
    """``make(artifact's tensors)`` for ``source``'s prefix: the one another generation over it holds, else made
    now (one read per prefix when generations over it open at once); unshared when the prefix lacks a digest.
    ``streamed``: ``make`` takes ``source.artifact_streamed``'s mapping (verified later by its user)."""
    load = source.artifact_streamed if streamed else source.artifact
    key = source.shared_key(artifact)
    if key is None:
        return make(load(artifact))
    with _LOCK:
        held = _HELD.get(key)
        if held is None:
            made = make(load(artifact))
            made.shared_across_generations = True
            _HELD[key] = made
            return made
    source.count_hit(artifact)  # charged as if read: a query's reads do not depend on what else runs
    return held  # type: ignore[return-value]  # the key names the artifact, and one maker serves each


def is_held(key: tuple[str, str, str] | None) -> bool:
    """Whether a live generation holds the shared state under ``key``."""
    return key is not None and key in _HELD
