"""Loading by hub id without a reachable hub: the local cache, or one clean error at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from store.errors import InvalidInput
from workers import model_source


@pytest.fixture()
def hub(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """Control whether the hub answers and what the local cache holds."""
    import huggingface_hub

    state = {"reachable": False, "cached": False}
    monkeypatch.setattr(model_source, "_reachable", lambda url, timeout_s: state["reachable"])
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache",
                        lambda repo, name: "/cache/config.json" if state["cached"] else None)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return state


def test_unreachable_hub_and_no_cache_is_one_clean_error(hub) -> None:  # noqa: ANN001
    with pytest.raises(InvalidInput, match="cannot be reached and the model is not in the local cache"):
        model_source.hub_offline("someorg/somemodel")


def test_unreachable_hub_with_a_cached_model_loads_from_the_cache(hub) -> None:  # noqa: ANN001
    hub["cached"] = True
    assert model_source.hub_offline("someorg/somemodel") is True


def test_reachable_hub_loads_normally(hub) -> None:  # noqa: ANN001
    hub["reachable"] = True
    assert model_source.hub_offline("someorg/somemodel") is False


def test_a_local_directory_never_asks_the_hub(hub, tiny_model_dir: Path) -> None:  # noqa: ANN001
    assert model_source.hub_offline(str(tiny_model_dir)) is False


def test_unreachable_endpoint_is_detected_fast() -> None:
    import time

    t0 = time.perf_counter()
    assert not model_source._reachable("https://127.0.0.1:9", timeout_s=2.0)  # discard port: refused at once
    assert time.perf_counter() - t0 < 2.5
