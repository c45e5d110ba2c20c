"""The CPU page-mass kernel (``workers/kernels/index_page_mass``) against its torch reference.

The reference is the torch path Top-K takes without the kernel: logits from the codes (``index_logits``, scaled),
then ``page_mass_ref`` (group-mean softmax, summed per page). Tolerance: the kernel computes the same float32
math in another order (per block ``q . lo + (q * step) . codes``, base-2 exponentials, per-page partial sums), so
masses agree to rtol 1e-4 / atol 1e-6 (observed: about 1e-7 absolute on masses up to 0.3). The pages Top-K
picks are the same as the reference's on these tests: each case checks that its k-th and (k+1)-th page masses
are further apart than the tolerance, so no near-tie can flip (exact ties go to the lower page id on both paths,
``top_units``); where a real prefix has a near-tie, the two paths may pick either page of it.
"""

from __future__ import annotations

import logging

import pytest
import torch

from native import build as native_build
from workers.kernels.index_page_mass import (
    CodeTiles,
    IndexPageMassConfig,
    cpu_kernel_available,
    cpu_kernel_preferred,
    index_page_mass,
    page_mass_ref,
)
from workers.kernels.index_page_mass import build as kernel_build
from workers.kernels.index_page_mass import ops as kernel_ops
from workers.kernels.unit_topk import top_units
from workers.methods.key_index import KeyIndexConfig, index_logits, quantize_keys
from workers.methods.layer_kv import ResidentKV
from workers.methods.memory import MemorySource
from workers.methods.registry import get_method
from workers.methods.selector import LayerContext
from workers.methods.topk import IndexedTopKSelector
from workers.requests import DecodeConfig

RTOL, ATOL = 1e-4, 1e-6

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="no C++ compiler: the torch path runs")


def _keys(hkv: int, n: int, d: int, seed: int) -> torch.Tensor:
    """Keys with a few large channels (as post-RoPE keys have) and some tokens aligned with a direction."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(hkv, n, d, generator=g)
    k[..., :2] *= 6
    planted = torch.randperm(n, generator=g)[: max(1, n // 50)]
    k[:, planted] += 3 * torch.randn(hkv, 1, d, generator=g)
    return k


def _reference(q: torch.Tensor, art: dict[str, torch.Tensor], bits: int, block: int, scale: float, start: int,
               end: int, page: int) -> torch.Tensor:
    logits = index_logits(q, art["codes"], art["lo"], art["step"], bits, block, start, end) * scale
    return page_mass_ref(logits, start, end, page)


@pytest.mark.parametrize(("bits", "block"), [(4, 64), (8, 64), (4, 16), (4, 7), (8, 24)])
@pytest.mark.parametrize(("t", "g"), [(1, 4), (1, 1), (3, 2), (2, 8), (1, 5)])
@pytest.mark.parametrize(("n", "start", "end", "page", "d"), [
    (4055, 4, 4000, 16, 64),  # the shipped model's shape, mid region cut at both ends
    (1000, 0, 1000, 16, 32),  # token count not a multiple of the page or of the 16-token tile
    (300, 65, 130, 5, 64),  # pages smaller than a tile and not dividing it
    (777, 100, 101, 32, 128),  # one mid token
    (64, 3, 13, 16, 16),  # the whole mid region inside one tile
])
def test_kernel_page_mass_equals_the_torch_reference(bits: int, block: int, t: int, g: int, n: int, start: int,
                                                     end: int, page: int, d: int) -> None:
    """Any GQA group and row count (not only the kernel's 4-row groups), block sizes that split a tile, partial
    first and last pages and tiles; masses within rtol 1e-4 / atol 1e-6 and summing to 1 per row group."""
    hkv = 2
    art = quantize_keys(_keys(hkv, n, d, seed=n + d), KeyIndexConfig(bits=bits, block=block))
    q = torch.randn(t, hkv, g, d, generator=torch.Generator().manual_seed(t * 10 + g))
    tiles = CodeTiles.from_index(art["codes"], art["lo"], art["step"], bits, block)
    got = index_page_mass(q, tiles, d ** -0.5, start, end, page)
    want = _reference(q, art, bits, block, d ** -0.5, start, end, page)
    assert got.shape == want.shape == (t, hkv, -(-end // page) - start // page) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got.sum(-1), torch.ones(t, hkv), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_queries_score_as_their_float32_values(dtype: torch.dtype) -> None:
    """The kernel reads float32 rows: a bf16 query scores as its exact float32 value, as the reference does."""
    art = quantize_keys(_keys(2, 2048, 64, seed=1))
    q = (torch.randn(1, 2, 4, 64, generator=torch.Generator().manual_seed(2)) * 2).to(dtype)
    tiles = CodeTiles.from_index(art["codes"], art["lo"], art["step"], 4, 64)
    got = index_page_mass(q, tiles, 0.125, 10, 2040, 16)
    torch.testing.assert_close(got, _reference(q, art, 4, 64, 0.125, 10, 2040, 16), rtol=RTOL, atol=ATOL)


def _selector_pair(n: int, d: int, seed: int) -> tuple[IndexedTopKSelector, IndexedTopKSelector, LayerContext]:
    k = _keys(2, n, d, seed)
    src = MemorySource.build([(k, k)], get_method("topk").summarizers)
    kernel, torch_path = (get_method("topk").selector(src, DecodeConfig()) for _ in range(2))
    assert isinstance(kernel, IndexedTopKSelector) and isinstance(torch_path, IndexedTopKSelector)
    # the kernel is the path taken where it builds with AVX-512; elsewhere forced here, to test it all the same
    assert (kernel.tiles is not None) == cpu_kernel_preferred()
    kernel.tiles = kernel.shared.tiles
    torch_path.tiles = None
    return kernel, torch_path, LayerContext(ResidentKV(k, k, page_size=16), 4, n - 37)


def _assert_margin(pages: torch.Tensor, n: int) -> None:
    """The k-th and (k+1)-th page masses of each row differ by more than the tolerance (no near-tie to flip)."""
    top = pages.sort(dim=-1, descending=True).values
    gap = top[..., n - 1] - top[..., n]
    assert (gap > ATOL + RTOL * top[..., n - 1]).all(), gap.min()


@pytest.mark.parametrize(("n", "t", "n_pages"), [(4096, 1, 12), (1500, 3, 5), (16384, 1, 40)])
def test_topk_picks_the_same_pages_with_and_without_the_kernel(n: int, t: int, n_pages: int) -> None:
    """``select_pages`` and ``select_pages_shared`` choose the same pages on the kernel as on the torch path; the
    kernel path builds no decoded keys (it reads the codes)."""
    kernel, torch_path, ctx = _selector_pair(n, 64, seed=n)
    q = torch.randn(t, 2, 4, 64, generator=torch.Generator().manual_seed(n + 1)) * 1.5
    scale = 64 ** -0.5
    want_mass, _ = torch_path._page_mass(0, ctx, q, scale)
    got_mass, _ = kernel._page_mass(0, ctx, q, scale)
    torch.testing.assert_close(got_mass, want_mass, rtol=RTOL, atol=ATOL)
    _assert_margin(want_mass, n_pages)
    _assert_margin(want_mass.amax(0), n_pages)
    assert torch.equal(kernel.select_pages(0, ctx, q, scale, n_pages), torch_path.select_pages(0, ctx, q, scale,
                                                                                               n_pages))
    assert torch.equal(kernel.select_pages_shared(0, ctx, q, scale, n_pages),
                       torch_path.select_pages_shared(0, ctx, q, scale, n_pages))
    assert kernel.decoded is not None and not kernel.decoded.keys  # scored on the codes
    assert kernel.tiles is not None and 0 in kernel.tiles.tiles


def test_exact_ties_go_to_the_lower_page_on_both_paths() -> None:
    """Two identical pages (the same codes and block scales): the kernel gives them the same mass, and both
    paths keep the lower page id when only one fits."""
    k = _keys(1, 256, 64, seed=9)
    k[:, 64:128] = k[:, 128:192]  # blocks 1 and 2 (pages 4-7 and 8-11) identical
    src = MemorySource.build([(k, k)], get_method("topk").summarizers)
    sel = get_method("topk").selector(src, DecodeConfig())
    assert isinstance(sel, IndexedTopKSelector)
    sel.tiles = sel.shared.tiles  # the kernel path (taken by default with AVX-512)
    ctx = LayerContext(ResidentKV(k, k, page_size=16), 0, 256)
    q = k[:, 70].reshape(1, 1, 1, 64).expand(1, 1, 4, 64) * 0.5  # aligned with page 4 (and its twin, page 8)
    mass, _ = sel._page_mass(0, ctx, q, 0.125)
    assert mass[0, 0, 4] == mass[0, 0, 8] and mass[0, 0].argmax() == 4
    assert 4 in top_units(mass[0], 1).tolist()[0]
    assert sel.select_pages(0, ctx, q, 0.125, 1).tolist() == [[[4]]]


def test_without_a_compiler_topk_takes_the_torch_reference(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A missing compiler: one warning, no kernel, and the selector's page mass is the reference's bit for bit."""
    monkeypatch.setenv("CXX", "kvstash-no-such-compiler")
    kernel_build.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native_build.__name__):
            assert not cpu_kernel_available() and not cpu_kernel_available()
            n = 1000
            k = _keys(2, n, 64, seed=3)
            src = MemorySource.build([(k, k)], get_method("topk").summarizers)
            sel = get_method("topk").selector(src, DecodeConfig())
        assert isinstance(sel, IndexedTopKSelector) and sel.tiles is None
        assert len(caplog.records) == 1 and "unavailable" in caplog.records[0].getMessage()
        ctx = LayerContext(ResidentKV(k, k, page_size=16), 4, n - 5)
        q = torch.randn(2, 2, 4, 64, generator=torch.Generator().manual_seed(4))
        got, p0 = sel._page_mass(0, ctx, q, 0.125)
        want = page_mass_ref(sel.approx_logits(0, ctx, q, 0.125), 4, n - 5, 16)
        assert p0 == 0 and torch.equal(got, want)
        with pytest.raises(RuntimeError, match="unavailable"):
            index_page_mass(q, CodeTiles.from_index(sel.index["0.codes"], sel.index["0.lo"], sel.index["0.step"], 4,
                                                    64), 0.125, 4, n - 5, 16)
    finally:
        monkeypatch.undo()
        kernel_build.load.cache_clear()
    assert cpu_kernel_available()


def test_a_build_without_avx512_leaves_topk_on_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the AVX-512 build is faster than torch: without it Top-K keeps the torch path (the kernel still
    computes the same masses, tested above)."""
    loaded = kernel_build.load()
    assert loaded is not None
    monkeypatch.setattr(kernel_ops, "load", lambda: kernel_build.Loaded(loaded.fn, avx512=False))
    k = _keys(2, 500, 64, seed=5)
    sel = get_method("topk").selector(MemorySource.build([(k, k)], get_method("topk").summarizers), DecodeConfig())
    assert isinstance(sel, IndexedTopKSelector) and sel.tiles is None and cpu_kernel_available()


def test_the_build_is_cached_per_source_and_cpu() -> None:
    """A second build with the same source, flags and CPU reuses the library: one build per machine (about 1 s
    with g++ 12; the suite's first use of the kernel pays it)."""
    cfg = native_build.CpuKernelBuild()
    lib = native_build.build(cfg, source=kernel_build.SOURCE, name="index_page_mass")
    mtime = lib.stat().st_mtime_ns
    again = native_build.build(cfg, source=kernel_build.SOURCE, name="index_page_mass")
    assert again == lib and lib.stat().st_mtime_ns == mtime
    assert lib.parent == cfg.cache_dir and not list(cfg.cache_dir.glob("tmp*"))  # no temporary left behind


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_heads_split_over_threads_give_the_same_bits(threads: int) -> None:
    """A call split over threads (by KV heads, here forced on a small call) equals the one-thread call exactly."""
    art = quantize_keys(_keys(5, 1500, 64, seed=11))
    q = torch.randn(2, 5, 4, 64, generator=torch.Generator().manual_seed(12))
    tiles = CodeTiles.from_index(art["codes"], art["lo"], art["step"], 4, 64)
    one = index_page_mass(q, tiles, 0.125, 7, 1490, 16, config=IndexPageMassConfig(parallel_macs=1 << 62))
    split = index_page_mass(q, tiles, 0.125, 7, 1490, 16, config=IndexPageMassConfig(parallel_macs=0,
                                                                                        threads=threads))
    assert torch.equal(one, split)
    torch.testing.assert_close(one, _reference(q, art, 4, 64, 0.125, 7, 1490, 16), rtol=RTOL, atol=ATOL)


def test_layers_past_the_cap_take_the_torch_path() -> None:
    """The laid-out codes are bounded (``IndexTiles.max_bytes``): a layer that does not fit is not laid out (nor
    copied each step) and scores on the torch path, with the same pages."""
    kernel, torch_path, ctx = _selector_pair(2000, 64, seed=21)
    assert kernel.tiles is not None
    idx = kernel.index
    need = CodeTiles.bytes_for(idx["0.codes"], idx["0.lo"])
    assert need == CodeTiles.from_index(idx["0.codes"], idx["0.lo"], idx["0.step"], 4, 64).nbytes
    kernel.tiles.max_bytes = need - 1
    q = torch.randn(1, 2, 4, 64, generator=torch.Generator().manual_seed(22))
    got, _ = kernel._page_mass(0, ctx, q, 0.125)
    assert not kernel.tiles.tiles and kernel.tiles.nbytes == 0
    assert torch.equal(got, torch_path._page_mass(0, ctx, q, 0.125)[0])
