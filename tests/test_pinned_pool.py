"""The staging pool of pinned host buffers (``store/pinned_pool.py``) and the prefix writer's use of it.

Without a GPU, layers are staged through ``PrefixWriter._write_staged`` with CPU page bytes (``write_layer``
takes that path for CUDA tensors only) and the pool makes ordinary host buffers: the pool's bookkeeping
and the writer's lease / release order are the same as on a GPU."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import store.pinned_pool as pinned_pool
import store.writer as writer_mod
from store.config import StoreConfig
from store.kvstore import KVStore
from store.layout import KVLayout
from store.pages import layer_file_name, pack_layer
from store.pinned_pool import PinnedPool, StagingLease, size_class
from store.prefix_key import PrefixKey, tenant_salt, token_hash
from store.writer import MAX_PENDING_LAYERS, PrefixWriter

N_TOKENS = 100
LAYOUT = KVLayout(n_layers=6, n_kv_heads=2, head_dim=16, dtype="float32", page_size=16)
LAYER_BYTES = LAYOUT.layer_file_bytes(N_TOKENS)


def _key(seed: int) -> PrefixKey:
    return PrefixKey(model_fingerprint="fp", tenant_salt=tenant_salt("default"),
                     token_hash=token_hash([seed, 1, 2]), layout=LAYOUT)


def _kv(seed: int, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, N_TOKENS, 16, generator=g).to(device), torch.randn(2, N_TOKENS, 16, generator=g).to(device))
            for _ in range(LAYOUT.n_layers)]


def _store(tmp_path: Path, **config: object) -> KVStore:
    return KVStore(StoreConfig(home=tmp_path / "home", page_size=16, fsync=False, **config))  # type: ignore[arg-type]


def _stage(w: PrefixWriter, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """What ``write_layer`` does with device K/V: packed where they are, staged in a leased buffer."""
    w._write_staged(layer, pack_layer(LAYOUT, k, v))


def _prefill(store: KVStore, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    kv = _kv(seed)
    with store.write_prefix(_key(seed), model_name="m", n_tokens=N_TOKENS) as w:
        for layer, (k, v) in enumerate(kv):
            _stage(w, layer, k, v)
        w.commit()
    return kv


def _assert_intact(store: KVStore, seed: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for layer, (k, v) in enumerate(kv):
        k2, v2 = store.read_layer(_key(seed).prefix_id, layer, verify=True)
        assert torch.equal(k2, k.cpu()) and torch.equal(v2, v.cpu()), layer


@pytest.fixture()
def leased(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[StagingLease]]:
    """Every lease any pool hands out (pooled or outside), in order."""
    seen: list[StagingLease] = []
    try_lease, outside = PinnedPool.try_lease, PinnedPool.outside

    def spy_try(self: PinnedPool, nbytes: int) -> StagingLease | None:
        if (lease := try_lease(self, nbytes)) is not None:
            seen.append(lease)
        return lease

    def spy_outside(self: PinnedPool, nbytes: int) -> StagingLease:
        seen.append(lease := outside(self, nbytes))
        return lease

    monkeypatch.setattr(PinnedPool, "try_lease", spy_try)
    monkeypatch.setattr(PinnedPool, "outside", spy_outside)
    yield seen


# -- the pool on its own ----------------------------------------------------------------------------------


def test_a_released_buffer_is_leased_again_and_smaller_sizes_reuse_it() -> None:
    made: list[int] = []
    pool = PinnedPool(1 << 20, allocate=lambda n: made.append(n) or torch.empty(n, dtype=torch.uint8))
    first = pool.lease(5000)
    buf = first.buffer
    assert first.pooled and buf.numel() == size_class(5000) == 8192 and made == [8192]
    first.release()
    first.release()  # a second release does nothing
    again = pool.lease(5000)
    assert again.buffer is buf and again.buffer.data_ptr() == buf.data_ptr()
    again.release()
    small = pool.lease(100)
    assert small.buffer is buf and tuple(small.view((2, 50)).shape) == (2, 50)
    with pytest.raises(ValueError, match="does not fit"):
        small.view((101,))
    small.release()
    assert made == [8192]
    s = pool.stats()
    assert (s.allocations, s.reuses, s.fallbacks, s.in_use_bytes, s.free_bytes) == (1, 2, 0, 0, 8192)


def test_the_smallest_kept_buffer_that_fits_is_leased() -> None:
    pool = PinnedPool(1 << 20, allocate=lambda n: torch.empty(n, dtype=torch.uint8))
    big, small = pool.lease(60_000), pool.lease(3000)
    big_buf, small_buf = big.buffer, small.buffer
    big.release()
    small.release()
    a = pool.lease(2000)
    b = pool.lease(2000)
    assert a.buffer is small_buf and b.buffer is big_buf


def test_past_the_bound_a_lease_falls_back_at_once_and_kept_buffers_make_room() -> None:
    fallbacks: list[int] = []

    def fallback(n: int) -> torch.Tensor:
        fallbacks.append(n)
        return torch.empty(n, dtype=torch.uint8)

    pool = PinnedPool(8192, allocate=lambda n: torch.empty(n, dtype=torch.uint8), fallback=fallback)
    held = pool.lease(8192)
    extra = pool.lease(8192)  # the bound is in use: no waiting, a buffer outside the pool
    assert held.pooled and not extra.pooled and fallbacks == [8192]
    assert extra.buffer.data_ptr() != held.buffer.data_ptr()
    extra.release()
    assert pool.stats().free_bytes == 0  # not kept: outside the pool
    too_big = pool.lease(8193)
    assert not too_big.pooled and fallbacks == [8192, 8193]
    held.release()
    # A larger buffer than the kept one: the kept one is freed to make room within the bound.
    wide = PinnedPool(12_000, allocate=lambda n: torch.empty(n, dtype=torch.uint8))
    first = wide.lease(4096)
    first.release()
    second = wide.lease(8192)
    assert second.pooled and second.buffer is not first.buffer
    stats = wide.stats()
    assert stats.in_use_bytes == 8192 and stats.free_bytes == 0 and stats.allocations == 2
    # Under the bound but past it once rounded up: the bound itself is the buffer.
    odd = PinnedPool(10_000, allocate=lambda n: torch.empty(n, dtype=torch.uint8)).lease(9000)
    assert odd.pooled and odd.buffer.numel() == 10_000


def test_a_failed_pinned_allocation_falls_back_to_pageable_memory() -> None:
    def fail(n: int) -> torch.Tensor:
        raise RuntimeError("CUDA error: out of memory")

    pool = PinnedPool(1 << 20, allocate=fail)
    lease = pool.lease(4096)
    assert not lease.pooled and lease.buffer.numel() == 4096
    assert pool.stats().in_use_bytes == 0 and pool.stats().fallbacks == 1


def test_the_bound_holds_under_concurrent_leases() -> None:
    bound, threads, rounds = 16_384, 8, 300
    pool = PinnedPool(bound, allocate=lambda n: torch.empty(n, dtype=torch.uint8))
    lock = threading.Lock()
    out: dict[int, int] = {}  # data_ptr -> bytes of every pooled buffer leased out now
    worst = [0]
    errors: list[str] = []

    def work(tid: int) -> None:
        rng = random.Random(tid)
        for i in range(rounds):
            lease = pool.lease(rng.randint(1, 6000))
            ptr = lease.buffer.data_ptr()
            if lease.pooled:
                with lock:
                    if ptr in out:
                        errors.append(f"buffer {ptr} leased twice")
                    out[ptr] = lease.buffer.numel()
                    worst[0] = max(worst[0], sum(out.values()))
            stats = pool.stats()
            if stats.in_use_bytes + stats.free_bytes > bound:
                errors.append(f"pool holds {stats.in_use_bytes + stats.free_bytes} > {bound}")
            mark = (tid * 31 + i) % 251
            lease.buffer[: lease.nbytes].fill_(mark)
            if i % 7 == 0:
                threading.Event().wait(0.0005)
            if not bool((lease.buffer[: lease.nbytes] == mark).all()):
                errors.append("a leased buffer was written by another holder")
            if lease.pooled:
                with lock:
                    del out[ptr]
            lease.release()

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    stats = pool.stats()
    assert not errors, errors[:3]
    assert 0 < worst[0] <= bound
    assert stats.in_use_bytes == 0 and 0 < stats.free_bytes <= bound
    assert stats.fallbacks > 0 and stats.reuses > 0  # the bound was reached, and buffers came back


# -- the writer's leases ----------------------------------------------------------------------------------


def test_a_second_prefill_of_the_same_shape_reuses_the_staging_buffers(tmp_path: Path,
                                                                        leased: list[StagingLease]) -> None:
    store = _store(tmp_path)
    kv0 = _prefill(store, 0)
    pool = store.staging_pool()
    assert pool is not None and store.staging_pool() is pool
    first = {id(lease.buffer): lease.buffer.data_ptr() for lease in leased}
    made = pool.stats().allocations
    assert 1 <= made <= MAX_PENDING_LAYERS and len(leased) == LAYOUT.n_layers
    leased.clear()
    kv1 = _prefill(store, 1)
    assert len(leased) == LAYOUT.n_layers
    assert all(lease.pooled and first.get(id(lease.buffer)) == lease.buffer.data_ptr() for lease in leased)
    stats = pool.stats()
    assert stats.allocations == made and stats.in_use_bytes == 0 and stats.fallbacks == 0
    _assert_intact(store, 0, kv0)
    _assert_intact(store, 1, kv1)
    store.close()


def test_a_staging_buffer_is_not_leased_again_before_its_write_finished(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """One buffer in the pool; layer 0's durable write is held back. The buffer stays leased until that write
    is done, also while the writer drains it: a lease meanwhile gets other memory (were it handed the buffer,
    the bytes scribbled into it would land in layer 0's file)."""
    store = _store(tmp_path, pinned_staging_bytes=size_class(LAYER_BYTES))
    gate, started, draining = threading.Event(), threading.Event(), threading.Event()
    real_write, real_wait = writer_mod.write_bytes_durably, writer_mod.wait

    def slow_write(path: Path, arr: object, fsync: bool) -> None:
        if path.name == layer_file_name(0):
            started.set()
            assert gate.wait(10)
        real_write(path, arr, fsync)  # type: ignore[arg-type]

    def watched_wait(jobs: list) -> object:
        if not gate.is_set():
            draining.set()
        return real_wait(jobs)

    monkeypatch.setattr(writer_mod, "write_bytes_durably", slow_write)
    monkeypatch.setattr(writer_mod, "wait", watched_wait)
    kv = _kv(0)
    pool = store.staging_pool()
    assert pool is not None

    def scribble_past_layer_0(staged: StagingLease) -> None:
        meanwhile = pool.lease(LAYER_BYTES)
        assert not meanwhile.pooled and meanwhile.buffer.data_ptr() != staged.buffer.data_ptr()
        meanwhile.buffer.fill_(0xAB)
        meanwhile.release()

    with store.write_prefix(_key(0), model_name="m", n_tokens=N_TOKENS) as w:
        _stage(w, 0, *kv[0])
        assert started.wait(10)
        staged = w._pending[0].lease
        assert staged is not None and staged.pooled and pool.stats().in_use_bytes == size_class(LAYER_BYTES)
        scribble_past_layer_0(staged)
        for layer in range(1, MAX_PENDING_LAYERS):  # outside the pool (its one buffer is leased)
            _stage(w, layer, *kv[layer])
        # The next layer drains layer 0 first: its buffer goes back only after the held-back write.
        nxt = threading.Thread(target=_stage, args=(w, MAX_PENDING_LAYERS, *kv[MAX_PENDING_LAYERS]))
        nxt.start()
        assert draining.wait(10)
        scribble_past_layer_0(staged)
        gate.set()
        nxt.join()
        for layer in range(MAX_PENDING_LAYERS + 1, LAYOUT.n_layers):
            _stage(w, layer, *kv[layer])
        w.commit()
    _assert_intact(store, 0, kv)
    after = pool.lease(LAYER_BYTES)
    assert after.pooled and after.buffer is staged.buffer  # handed back once its write was done
    after.release()
    store.close()


def test_with_the_pool_in_use_a_prefill_stages_in_its_own_reused_buffers(tmp_path: Path,
                                                                           leased: list[StagingLease]) -> None:
    """Another holds the whole bound: the prefill neither waits nor fails; it makes at most as many pageable
    buffers as it has layers in flight, reuses them for its later layers, and frees them at the end."""
    store = _store(tmp_path, pinned_staging_bytes=size_class(LAYER_BYTES))
    pool = store.staging_pool()
    assert pool is not None
    other = pool.lease(LAYER_BYTES)
    assert other.pooled
    leased.clear()
    kv = _prefill(store, 0)
    assert LAYOUT.n_layers > MAX_PENDING_LAYERS and pool.stats().fallbacks == MAX_PENDING_LAYERS
    assert len({id(lease) for lease in leased}) == MAX_PENDING_LAYERS
    assert all(not lease.pooled and lease.released for lease in leased)
    other.release()
    _assert_intact(store, 0, kv)
    store.close()


def test_leases_go_back_when_the_writer_is_discarded(tmp_path: Path) -> None:
    store = _store(tmp_path)
    kv = _kv(0)
    with store.write_prefix(_key(0), model_name="m", n_tokens=N_TOKENS) as w:
        for layer in range(3):
            _stage(w, layer, *kv[layer])
        pool = store.staging_pool()
        assert pool is not None and pool.stats().in_use_bytes > 0
    assert pool.stats().in_use_bytes == 0 and pool.stats().free_bytes > 0
    with pytest.raises(KeyError), store.write_prefix(_key(1), model_name="m", n_tokens=N_TOKENS) as w:
        _stage(w, 0, *kv[0])
        raise KeyError("the prefill failed")
    assert pool.stats().in_use_bytes == 0
    assert not list(store.prefixes_dir.iterdir())
    store.close()


@pytest.mark.parametrize("threads", [0, 4])
def test_leases_go_back_when_a_write_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    store = _store(tmp_path, write_threads=threads)
    real_write = writer_mod.write_bytes_durably

    def failing_write(path: Path, arr: object, fsync: bool) -> None:
        if path.name == layer_file_name(2):
            raise OSError(28, "No space left on device")
        real_write(path, arr, fsync)  # type: ignore[arg-type]

    monkeypatch.setattr(writer_mod, "write_bytes_durably", failing_write)
    kv = _kv(0)
    with pytest.raises(OSError, match="No space"), store.write_prefix(_key(0), model_name="m",
                                                                         n_tokens=N_TOKENS) as w:
        for layer, (k, v) in enumerate(kv):
            _stage(w, layer, k, v)
        w.commit()
    pool = store.staging_pool()
    assert pool is not None and pool.stats().in_use_bytes == 0 and pool.stats().allocations > 0
    monkeypatch.setattr(writer_mod, "write_bytes_durably", real_write)
    _assert_intact(store, 1, _prefill(store, 1))  # the pool serves the next prefill as usual
    store.close()


def test_zero_staging_bytes_gives_each_writer_its_own_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              leased: list[StagingLease]) -> None:
    made: list[int] = []
    monkeypatch.setattr(pinned_pool, "pinned_buffer", lambda n: made.append(n) or torch.empty(n, dtype=torch.uint8))
    store = _store(tmp_path, pinned_staging_bytes=0)
    assert store.staging_pool() is None
    kv0 = _prefill(store, 0)
    per_prefill = len(made)
    assert 1 <= per_prefill <= MAX_PENDING_LAYERS
    kv1 = _prefill(store, 1)
    assert len(made) == 2 * per_prefill  # nothing kept between prefills
    assert len(leased) == 2 * LAYOUT.n_layers and all(lease.pooled for lease in leased)  # within one: a ring
    _assert_intact(store, 0, kv0)
    _assert_intact(store, 1, kv1)
    with pytest.raises(ValueError, match="pinned_staging_bytes"):
        StoreConfig(home=tmp_path / "x", pinned_staging_bytes=-1)
    store.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_prefills_reuse_the_pinned_staging_buffers(tmp_path: Path, leased: list[StagingLease]) -> None:
    """Device K/V through ``write_layer``: staged in pinned buffers, the same ones for a second prefill."""
    store = _store(tmp_path)
    kvs = []
    for seed in (0, 1):
        kv = _kv(seed, "cuda")
        with store.write_prefix(_key(seed), model_name="m", n_tokens=N_TOKENS) as w:
            for layer, (k, v) in enumerate(kv):
                w.write_layer(layer, k, v)
            w.commit()
        kvs.append(kv)
    assert len(leased) == 2 * LAYOUT.n_layers
    assert all(lease.pooled and lease.buffer.is_pinned() for lease in leased)
    first = {lease.buffer.data_ptr() for lease in leased[: LAYOUT.n_layers]}
    assert {lease.buffer.data_ptr() for lease in leased[LAYOUT.n_layers:]} <= first
    pool = store.staging_pool()
    assert pool is not None and pool.stats().allocations == len(first) and pool.stats().in_use_bytes == 0
    for seed, kv in enumerate(kvs):
        _assert_intact(store, seed, kv)
    store.close()
