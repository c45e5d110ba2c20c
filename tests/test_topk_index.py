"""The indexed Top-K: its key index finds the exact top-k, and its reads are what it fetched.

Recall is measured against exhaustive Top-K on keys shaped like post-RoPE keys (a few large
channels, a handful of tokens aligned with the query); read bytes are checked against a count
made here from the method's definition (index once, shortlist keys and the final tokens' K/V per
step); a 16k-token prefix at a 2% budget stays within 2.5x the budget, everything counted.
"""

from __future__ import annotations

import math

import pytest
import torch

from workers.budget import plan_budget
from workers.methods.base import ReportsReads
from workers.methods.key_index import (
    PACKED_BITS,
    KeyIndexConfig,
    KeyIndexSummarizer,
    decoded_logits,
    dequantize_keys,
    group_channels,
    index_logits,
    pack_codes,
    quantize_keys,
    unpack_codes,
)
from workers.methods.memory import MemorySource
from workers.methods.registry import get_method
from workers.methods.selector import LayerContext, group_mass, top_tokens
from workers.methods.topk import SHORTLIST, IndexedTopKSelector, TopK
from workers.requests import DecodeConfig


def structured_keys(hkv: int, n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys with four large channels and 64 tokens planted along per-head directions; the directions
    ``[Hkv, D]`` (queries near them find the planted tokens, at graded strengths)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(hkv, n, d, generator=g)
    k[..., :4] *= 8  # outlier channels, as RoPE'd keys have
    dirs = torch.nn.functional.normalize(torch.randn(hkv, d, generator=g), dim=-1)
    planted = torch.randperm(n, generator=g)[:64]
    k[:, planted] += dirs[:, None] * torch.linspace(2, 6, 64)[None, :, None] * math.sqrt(d)
    return k, dirs


def _queries(dirs: torch.Tensor, n_q: int, g_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    hkv, d = dirs.shape
    return dirs[None, :, None] * 0.5 + 0.5 * torch.randn(n_q, hkv, g_size, d, generator=g) / math.sqrt(d)


def _resident_ctx(k: torch.Tensor, lo: int, hi: int) -> LayerContext:
    from workers.methods.layer_kv import ResidentKV

    return LayerContext(ResidentKV(k, k, page_size=16), lo, hi)


def _recall(sel: IndexedTopKSelector, k: torch.Tensor, q: torch.Tensor, lo: int, hi: int, k_tok: int) -> float:
    ctx = _resident_ctx(k, lo, hi)
    s = sel.select(0, ctx, q, q.shape[-1] ** -0.5, k_tok)
    exact = torch.einsum("thgd,hnd->thgn", q, k[:, lo:hi]) * q.shape[-1] ** -0.5
    want = top_tokens(group_mass(exact).flatten(0, 1), k_tok) + lo
    got = s.tokens.flatten(0, 1)
    hits = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(got, want, strict=True))
    return hits / want.numel()


def test_quantized_keys_are_within_half_a_step() -> None:
    k, _ = structured_keys(2, 1000, 32, seed=0)
    for cfg in (KeyIndexConfig(bits=4), KeyIndexConfig(bits=8, block=16), KeyIndexConfig(bits=2),
                KeyIndexConfig(bits=3, block=128)):
        art = quantize_keys(k, cfg)
        back = dequantize_keys(art["codes"], art["lo"], art["step"], cfg.bits, cfg.block)
        step = art["step"].float().repeat_interleave(cfg.block, dim=1)[:, :1000]
        assert ((back - k).abs() <= step / 2 + 1e-2 * step + 1e-3).all()
        n_bytes = sum(t.numel() * t.element_size() for n, t in art.items() if n != "meta")
        assert n_bytes == pytest.approx(2 * 1000 * cfg.bytes_per_token(32), rel=0.02)


@pytest.mark.parametrize("bits", PACKED_BITS)
def test_codes_pack_little_endian_along_the_channels(bits: int) -> None:
    """``pack_codes``: channel c's code at bits ``[c * bits, (c + 1) * bits)`` of the row (the 4-bit key index's
    layout at 4 bits), ``bits / 8`` bytes a channel, and ``unpack_codes`` its inverse."""
    d = 48
    codes = torch.randint(0, 1 << bits, (2, 5, d), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (2, 5, d * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, bits), codes)
    row = sum(int(c) << (bits * i) for i, c in enumerate(codes[1, 3].tolist()))
    assert packed[1, 3].tolist() == [(row >> (8 * j)) & 0xFF for j in range(d * bits // 8)]
    if group_channels(bits) > 1:  # a head_dim the codes cannot fill whole bytes with
        with pytest.raises(ValueError, match="divisible"):
            quantize_keys(torch.zeros(1, 4, group_channels(bits) + 1), KeyIndexConfig(bits=bits))


def test_the_key_index_is_scored_at_4_or_8_bits_only() -> None:
    with pytest.raises(ValueError, match="bits"):
        KeyIndexSummarizer(KeyIndexConfig(bits=2))
    art = quantize_keys(torch.randn(1, 64, 8), KeyIndexConfig(bits=2))
    with pytest.raises(ValueError, match="dequantize_keys"):
        index_logits(torch.randn(1, 1, 1, 8), art["codes"], art["lo"], art["step"], 2, 64)
    with pytest.raises(ValueError, match="bits"):
        KeyIndexConfig(bits=5)


@pytest.mark.parametrize(("bits", "block"), [(4, 64), (8, 16), (4, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "start", "end", "chunk"), [(1000, 0, 1000, None), (1000, 4, 987, 128),
                                                          (300, 65, 130, 64), (5003, 3, 4999, 512)])
def test_scores_from_codes_equal_scores_on_the_dequantized_keys(bits: int, block: int, dtype: torch.dtype, n: int,
                                                                 start: int, end: int, chunk: int | None) -> None:
    """``index_logits`` (per block ``q . lo + (q * step) . codes``, chunked) equals ``q . dequantize_keys`` to
    1e-5 of the largest logit: unaligned mid ranges, a partial last block, several chunks, bf16 queries."""
    k, dirs = structured_keys(2, n, 32, seed=n)
    art = quantize_keys(k, KeyIndexConfig(bits=bits, block=block))
    q = _queries(dirs, n_q=3, g_size=4, seed=5).to(dtype)
    keys = dequantize_keys(art["codes"], art["lo"], art["step"], bits, block, start, end)
    ref = torch.einsum("thgd,hnd->thgn", q.float(), keys)
    got = index_logits(q, art["codes"], art["lo"], art["step"], bits, block, start, end, chunk_tokens=chunk)
    assert got.shape == ref.shape == (3, 2, 4, end - start) and got.dtype == torch.float32
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("k_tok", [16, 48])
def test_index_recalls_exact_topk_and_a_broken_index_does_not(k_tok: int) -> None:
    k, dirs = structured_keys(2, 4096, 64, seed=1)
    q = _queries(dirs, n_q=6, g_size=4, seed=2)
    art = {f"0.{n}": t for n, t in KeyIndexSummarizer().summarize(0, k, k).items()}
    assert _recall(IndexedTopKSelector(art), k, q, 4, 4080, k_tok) >= 0.95
    # the same selector over an index of random codes re-scores a random shortlist: recall collapses
    broken = dict(art, **{"0.codes": torch.randint(0, 256, art["0.codes"].shape, dtype=torch.uint8,
                                                   generator=torch.Generator().manual_seed(3))})
    assert _recall(IndexedTopKSelector(broken), k, q, 4, 4080, k_tok) < 0.5


def _steps(attn, q: torch.Tensor, n_steps: int) -> None:  # noqa: ANN001 - any sparse PrefixAttention
    for _ in range(n_steps):
        for layer in range(len(attn.source._kv)):
            attn.attend(layer, q, q.shape[-1] ** -0.5)


def test_read_report_is_index_once_plus_shortlist_keys_plus_topk_kv() -> None:
    n, hkv, d, layers, budget, steps = 2000, 2, 32, 2, 0.05, 5
    kv = [structured_keys(hkv, n, d, seed=10 + i)[0] for i in range(layers)]
    src = MemorySource.build([(k, k.flip(1)) for k in kv], TopK.summarizers)
    attn = get_method("topk-token").open(src, DecodeConfig(budget=budget))
    q = torch.randn(1, hkv * 2, 1, d, generator=torch.Generator().manual_seed(4))
    _steps(attn, q, steps)
    assert isinstance(attn, ReportsReads)
    report = attn.read_report()
    plan = plan_budget(prefill_len=n, fraction=budget, head_dim=d)
    tok = 2 * d * 4  # K and V of one token and KV head, float32
    index_once = layers * (hkv * n * d // 2 + 2 * hkv * math.ceil(n / 64) * d * 2 + 2 * 8)
    per_step = layers * hkv * ((plan.sink + plan.tail + plan.k_topk) * tok + (SHORTLIST - 1) * plan.k_topk * tok // 2)
    assert report.once_bytes == index_once
    assert report.step_bytes == steps * per_step
    assert report.extra["selection_keys_per_step"] == layers * hkv * (SHORTLIST - 1) * plan.k_topk


def test_page_topk_reads_the_index_once_plus_whole_pages_of_the_budget() -> None:
    """Page-granular ``topk``: per step and KV head the anchors plus k // page_size pages' tokens, no key-only
    reads; the index once."""
    n, hkv, d, layers, budget, steps = 2000, 2, 32, 2, 0.05, 5
    kv = [structured_keys(hkv, n, d, seed=10 + i)[0] for i in range(layers)]
    src = MemorySource.build([(k, k.flip(1)) for k in kv], TopK.summarizers)
    attn = get_method("topk").open(src, DecodeConfig(budget=budget))
    _steps(attn, torch.randn(1, hkv * 2, 1, d, generator=torch.Generator().manual_seed(4)), steps)
    report = attn.read_report()
    plan = plan_budget(prefill_len=n, fraction=budget, head_dim=d)
    page = src.layout.page_size
    mid = plan.k_topk // page * page  # pages inside the mid region: every token of a picked page is a mid token
    assert report.tokens_per_step == [layers * hkv * (plan.sink + plan.tail + mid)] * steps
    assert report.extra["selection_keys_per_step"] == 0
    assert report.once_bytes == layers * (hkv * n * d // 2 + 2 * hkv * math.ceil(n / 64) * d * 2 + 2 * 8)


@pytest.mark.parametrize("method", ["topk", "topk-token"])
def test_topk_total_reads_stay_within_2_5x_the_budget_at_16k(method: str) -> None:
    """16k prefix, 2% budget, bf16 keys, 16 steps: index + (shortlist keys +) top-k K/V <= 5% of full."""
    n, d, steps, budget = 16384, 128, 16, 0.02
    k, dirs = structured_keys(1, n, d, seed=7)
    k = k.bfloat16()
    src = MemorySource.build([(k, k)], TopK.summarizers)
    attn = get_method(method).open(src, DecodeConfig(budget=budget))
    q = _queries(dirs, n_q=1, g_size=4, seed=8).permute(0, 1, 2, 3).reshape(1, 4, 1, d).bfloat16()
    _steps(attn, q, steps)
    report = attn.read_report()
    full = steps * n * 2 * d * 2
    assert report.once_bytes > 0 and (report.extra["selection_keys_per_step"] > 0) == (method == "topk-token")
    assert (report.step_bytes + report.once_bytes) / full <= 2.5 * budget
    assert report.step_bytes / full <= 1.6 * budget  # per step: n(f) plus the shortlist's extra keys


@pytest.mark.parametrize(("bits", "lo", "hi"), [(4, 4, 1000), (8, 0, 1024), (4, 70, 300)])
def test_cpu_decoded_index_scores_as_the_codes_do(bits: int, lo: int, hi: int) -> None:
    """On the CPU the selector scores on keys decoded once from the index; its logits equal the codes' own
    (``index_logits``) up to float32 rounding (atol 1e-4 on logits of magnitude ~10), and a cap too small for a
    layer leaves that layer scoring from its codes."""
    k, dirs = structured_keys(2, 1024, 64, seed=3)
    art = {f"0.{n}": t for n, t in KeyIndexSummarizer(KeyIndexConfig(bits=bits)).summarize(0, k, k).items()}
    q = _queries(dirs, 3, 4, seed=4)
    ctx = _resident_ctx(k, lo, hi)
    want = index_logits(q, art["0.codes"], art["0.lo"], art["0.step"], bits, 64, lo, hi) * 0.125
    sel = IndexedTopKSelector(art)
    assert sel.decoded is not None
    got = sel.approx_logits(0, ctx, q, 0.125)
    assert sel.decoded.nbytes == 2 * 1024 * 64 * 4 and 0 in sel.decoded.keys
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    capped = IndexedTopKSelector(art)
    assert capped.decoded is not None
    capped.decoded.max_bytes = 2 * 1024 * 64 * 4 - 1
    torch.testing.assert_close(capped.approx_logits(0, ctx, q, 0.125), want, atol=1e-4, rtol=1e-5)
    assert capped.decoded.nbytes == 0 and not capped.decoded.keys


@pytest.mark.parametrize(("lo", "hi", "rows"), [(4, 1000, 1), (70, 300, 1), (0, 1024, 3)])
def test_cpu_decoded_keys_are_channel_major_and_score_bit_equal(lo: int, hi: int, rows: int) -> None:
    """The decoded keys are held channel-major (for a faster CPU product) and score exactly as token-major keys
    would: the same float32 bits, so the pages a step picks do not change."""
    k, dirs = structured_keys(2, 1024, 64, seed=5)
    art = {f"0.{n}": t for n, t in KeyIndexSummarizer().summarize(0, k, k).items()}
    sel = IndexedTopKSelector(art)
    assert sel.decoded is not None
    keys = sel.decoded.get(0, art["0.codes"], art["0.lo"], art["0.step"], sel.bits, sel.block)
    assert keys is not None and keys.stride() == (1024 * 64, 1, 1024)
    q = _queries(dirs, rows, 4, seed=6)
    token_major = dequantize_keys(art["0.codes"], art["0.lo"], art["0.step"], sel.bits, sel.block).contiguous()
    assert torch.equal(keys, token_major)
    want = decoded_logits(q, token_major, lo, hi).mul_(0.125)
    assert torch.equal(sel.approx_logits(0, _resident_ctx(k, lo, hi), q, 0.125), want)
