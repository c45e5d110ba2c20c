"""``graph_capture`` leaves the calling thread on its own CUDA stream when a capture fails.

``torch.cuda.graph``'s exit raises from ``capture_end`` before it switches back from its capture stream; the
engine then runs the step eagerly on the same thread, which must not stay on the capture stream. The CUDA graph
API is replaced by a recording stand-in here, so the test runs on the CPU; the CUDA tests capture for real
(``tests/test_step_graphs.py::test_a_step_that_cannot_be_captured_runs_eagerly``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from workers import capture


class _Streams:
    """Stands in for the current-stream state of one thread."""

    def __init__(self) -> None:
        self.current = "caller"

    def current_stream(self, device: Any = None) -> str:
        return self.current

    def set_stream(self, stream: str) -> None:
        self.current = stream


def _graph_that_fails_at_exit(streams: _Streams) -> type:
    class Graph:
        """Like ``torch.cuda.graph``: enters its capture stream; exit raises before switching back."""

        def __init__(self, graph: Any, pool: Any = None, capture_error_mode: str = "global") -> None:
            pass

        def __enter__(self) -> None:
            streams.current = "capture"

        def __exit__(self, *exc: object) -> None:
            raise RuntimeError("operation not permitted when stream is capturing")

    return Graph


@pytest.fixture()
def streams(monkeypatch: pytest.MonkeyPatch) -> _Streams:
    """The thread's stream state, with ``torch.cuda``'s stream and graph calls replaced by stand-ins over it."""
    state = _Streams()
    monkeypatch.setattr(capture, "_init_blas", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_stream", state.current_stream)
    monkeypatch.setattr(torch.cuda, "set_stream", state.set_stream)
    monkeypatch.setattr(torch.cuda, "graph", _graph_that_fails_at_exit(state))
    return state


def test_a_failed_capture_returns_the_thread_to_its_stream(streams: _Streams) -> None:
    with pytest.raises(RuntimeError, match="capturing"), capture.graph_capture(object(), torch.device("cuda")):
        assert streams.current == "capture"
    assert streams.current == "caller"


def test_an_error_inside_the_block_returns_the_thread_to_its_stream_too(streams: _Streams) -> None:
    with pytest.raises(RuntimeError), capture.graph_capture(object(), torch.device("cuda")):
        raise ValueError("a host sync in the step")
    assert streams.current == "caller"
