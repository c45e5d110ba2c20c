"""Pinned host buffers (``workers.offload.memory.HostBuffer``): a registration that cannot be undone now (its buffer
closed, e.g. garbage collected, while a CUDA graph capture runs on this thread) keeps its mapping until it is undone,
so the address is never mapped again while CUDA still holds it registered.

The CUDA runtime calls are replaced by stand-ins: the bookkeeping is what is tested here (the machine has no GPU).
"""

from __future__ import annotations

import gc

import pytest

from workers.offload import memory


@pytest.fixture()
def runtime(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    state: dict[str, object] = {"registered": set(), "refuse_unregister": False}
    registered: set[int] = state["registered"]  # type: ignore[assignment]

    def register(t) -> bool:  # noqa: ANN001
        memory._retry_deferred()
        assert t.data_ptr() not in registered, "a mapping CUDA still holds was handed out again"
        registered.add(t.data_ptr())
        return True

    def unregister(ptr: int) -> bool:
        if state["refuse_unregister"]:
            return False
        registered.discard(ptr)
        return True

    monkeypatch.setattr(memory, "_register", register)
    monkeypatch.setattr(memory, "_unregister", unregister)
    monkeypatch.setattr(memory, "_DEFERRED", [])
    return state


def test_an_unregistering_that_must_wait_keeps_the_mapping_until_it_is_done(runtime: dict[str, object]) -> None:
    buf = memory.HostBuffer(10_000, pin=True)
    ptr = buf.tensor.data_ptr()
    buf.tensor[:] = 7
    runtime["refuse_unregister"] = True  # as under a graph capture on this thread
    buf.close()
    del buf
    gc.collect()
    assert [p for p, _ in memory._DEFERRED] == [ptr]
    deferred_map = memory._DEFERRED[0][1]
    assert not deferred_map.closed and deferred_map[0] == 7  # still mapped: the address cannot be reused
    runtime["refuse_unregister"] = False
    memory.HostBuffer(10_000, pin=True).close()  # the next registration retries the deferred one first
    assert memory._DEFERRED == [] and runtime["registered"] == set()


def test_a_closed_buffer_unregisters_at_once_when_it_can(runtime: dict[str, object]) -> None:
    buf = memory.HostBuffer(5000, pin=True)
    assert buf.pinned and runtime["registered"] == {buf.tensor.data_ptr()}
    buf.close()
    buf.close()  # twice is harmless
    assert runtime["registered"] == set() and memory._DEFERRED == []
