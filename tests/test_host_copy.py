"""Device-to-host copies on a side stream (``store.host_copy``): the bytes that arrive are the tensor's as its
kernels left it, even when the caller drops the tensor and the device reuses its memory at once; the store's page
and artifact writes through them give the same files as from the CPU.

The CUDA cases are skipped without a GPU (run them with ``TRITON_INTERPRET=0 pytest tests/test_host_copy.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_store import _key

from store.artifacts import bytes_to_tensors
from store.config import StoreConfig
from store.host_copy import copy_to_host
from store.kvstore import KVStore
from store.layer_artifact import LayerArtifact

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cpu_tensors_are_copied_now_or_used_as_they_are() -> None:
    src = torch.arange(12, dtype=torch.float32).view(3, 4)
    same = copy_to_host(src)
    assert same.done is None and same.wait() is not None and torch.equal(same.wait(), src)
    out = torch.zeros(3, 4)
    into = copy_to_host(src, out)
    assert into.done is None and into.out is out and torch.equal(out, src)


@cuda
def test_a_dropped_source_arrives_intact_while_the_device_reuses_its_memory() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(2048, 2048, device="cuda", generator=g)
    src = a @ a @ a  # queued work the copy must come after
    want = src.cpu()
    src = a @ a @ a  # the same values again, queued anew
    copy = copy_to_host(src)
    assert copy.done is not None and copy.out.is_pinned()
    del src
    for _ in range(8):  # allocations that would take the dropped tensor's memory if it were released early
        torch.full((2048, 2048), -1.0, device="cuda")
    assert torch.equal(copy.wait(), want)


@cuda
def test_a_pageable_target_is_filled_before_the_call_returns() -> None:
    src = torch.arange(1000, device="cuda", dtype=torch.float32)
    out = torch.empty(1000)
    copy = copy_to_host(src, out)
    assert copy.done is None and torch.equal(out, src.cpu())


@cuda
def test_layer_artifacts_from_the_device_are_the_bytes_from_the_cpu(tmp_path: Path) -> None:
    layers = [{"a": torch.randn(4, 300, 16), "b": torch.randint(0, 255, (4, 77), dtype=torch.uint8)} for _ in range(5)]
    files = []
    for device in ("cpu", "cuda"):
        store = KVStore(StoreConfig(home=tmp_path / device, page_size=16))
        with store.write_prefix(_key(8), model_name="m", n_tokens=8, tenant="t") as w:
            with LayerArtifact(w.open_artifact("summary"), len(layers), max_pending=1) as out:
                for i, tensors in enumerate(layers):
                    # fresh device tensors, dropped right after add: their memory is reused by the next layer's
                    out.add(i, {n: (t.to(device) * 1).to(t.dtype) for n, t in tensors.items()})
            staged, _ = w._artifacts["summary"]
            files.append((w.tmp_dir / staged).read_bytes())
        store.close()
    assert files[0] == files[1]
    back = bytes_to_tensors(files[1])
    assert torch.equal(back["4.a"], layers[4]["a"]) and torch.equal(back["2.b"], layers[2]["b"])
