"""What a prefill shows on a terminal: each phase (forward pass, summaries and pages, durable write) and waits."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")
PHASES = ("forward", "summaries + pages", "durable write")
TICK_S = 1.0
"""How often a phase without counts redraws its elapsed time (so a long one shows it is alive)."""


def _desc(phase: int) -> str:
    return f"prefill {phase + 1}/{len(PHASES)} {PHASES[phase]}"


def scoring_desc(method: str) -> str:
    """The label of a compression method's scoring pass (after a prefill that asks for it, or on first use)."""
    return f"scoring for {method}"


class PrefillProgress:
    """Progress bars (stderr) over one prefill's phases, one after the other; nothing when not enabled."""

    forward_desc = _desc(0)
    """The label of the forward pass's bar (``prefill_kv`` draws it)."""

    def __init__(self, *, enabled: bool, n_layers: int = 0):
        self.enabled, self.n_layers = enabled, n_layers
        self._layers: tqdm | None = None

    def layers(self, items: Iterator[T]) -> Iterator[T]:
        """``items`` (one per layer), counted as each is done with; the bar opens when the first arrives (the
        forward pass, which comes before it, has its own)."""
        for item in items:
            if self._layers is None:
                self._layers = tqdm(total=self.n_layers, unit="layer", desc=_desc(1), disable=not self.enabled,
                                    leave=False)
            yield item
            self._layers.update(1)

    def committing(self) -> contextlib.AbstractContextManager[None]:
        """The last phase, which has no counts: its elapsed time redraws every ``TICK_S`` until the block ends."""
        if self._layers is not None:
            self._layers.close()
        return self._ticking(_desc(2))

    def scoring(self, method: str) -> contextlib.AbstractContextManager[None]:
        """A compression method's scoring pass (no counts either: elapsed time, like ``committing``)."""
        return self._ticking(scoring_desc(method))

    def summarizing(self, name: str) -> contextlib.AbstractContextManager[None]:
        """A late summary built after the prefill (``workers.late_summaries``; elapsed time)."""
        return self._ticking(f"building the {name} summary")

    @contextlib.contextmanager
    def _ticking(self, desc: str) -> Iterator[None]:
        bar = tqdm(total=None, desc=desc, bar_format="{desc}: {elapsed}", disable=not self.enabled, leave=False)
        done = threading.Event()

        def tick() -> None:
            while not done.wait(TICK_S):
                bar.refresh()

        ticker = threading.Thread(target=tick, daemon=True, name="kvstash-progress")
        if self.enabled:
            ticker.start()
        try:
            yield
        finally:
            done.set()
            if ticker.is_alive():
                ticker.join()
            bar.close()

    def note(self, text: str) -> None:
        """One line for the user (e.g. that this prefill waits for another one)."""
        if self.enabled:
            tqdm.write(f"kvstash: {text}", file=sys.stderr)
