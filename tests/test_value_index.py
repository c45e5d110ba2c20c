"""The index remainder of `topk+phi` (`workers/methods/value_index.py`): its value and mass against a float64
reference, exact attention when the indexes are lossless, and its one-time reads charged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workers.attention import dense_attention
from workers.methods.key_index import KeyIndexConfig, KeyIndexSummarizer, dequantize_keys, quantize_keys
from workers.methods.layer_kv import ResidentKV
from workers.methods.memory import MemorySource
from workers.methods.registry import get_method
from workers.methods.selector import LayerContext
from workers.methods.topk import IndexedTopKSelector, TopKIndexRemainder, TopKPhi
from workers.methods.value_index import (
    VALUE_INDEX,
    IndexRemainder,
    ValueIndexSummarizer,
    merged_ref,
    remainder_mask,
    remainder_ref,
)
from workers.requests import DecodeConfig


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _grid(hkv: int, n: int, d: int, seed: int, bits: int = 4) -> torch.Tensor:
    """Values on a ``bits``-bit grid per channel and 64-token block (the lowest and highest code present): an index of
    that many bits or more holds them exactly."""
    top = (1 << bits) - 1
    x = torch.randint(0, top + 1, (hkv, n, d), generator=_gen(seed)).float()
    x[:, 0::64], x[:, 1::64] = 0.0, float(top)
    return x * 0.25 - 1.0


def _decoded(art: dict[str, torch.Tensor], lo: int = 0, hi: int | None = None) -> torch.Tensor:
    """Layer 0 of an index artifact, decoded at its own bits and block."""
    bits, block = (int(x) for x in art["0.meta"][:2])
    return dequantize_keys(art["0.codes"], art["0.lo"], art["0.step"], bits, block, lo, hi)


def test_the_shipped_value_index_is_the_gpu_measured_2_bit_one() -> None:
    """``VALUE_INDEX`` is the format the H200 evals compared with 4 bits: 2 bits over 64-token blocks, min-max
    ranges; its version is not the 4-bit format's (stored 4-bit indexes are not read as the default's)."""
    assert (VALUE_INDEX.bits, VALUE_INDEX.block, VALUE_INDEX.clip) == (2, 64, False)
    assert ValueIndexSummarizer.version == 2


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_the_value_index_holds_each_value_within_half_a_step(bits: int) -> None:
    """Every value within half a step of its ``bits``-bit code (``head_dim * bits / 8`` code bytes a token, over
    64-token blocks, min-max ranges), and the artifact's bytes as ``bytes_per_token`` says (what the one-time read is
    charged)."""
    config = dataclasses.replace(VALUE_INDEX, bits=bits)
    v = torch.randn(2, 256, 8, generator=_gen(1))
    t = ValueIndexSummarizer(config).summarize(0, v, v)
    assert t["meta"][:2].tolist() == [bits, 64] and t["codes"].shape == (2, 256, 8 * bits // 8)
    back = _decoded({f"0.{k}": x for k, x in t.items()})
    step = t["step"].float().repeat_interleave(64, 1)
    assert ((back - v).abs() <= step / 2 + 2e-3).all()  # float16 lo/step add a little rounding
    n_bytes = sum(x.numel() * x.element_size() for k, x in t.items() if k != "meta")
    assert n_bytes == 2 * 256 * config.bytes_per_token(8)


def test_a_clipped_range_is_never_worse_than_min_max() -> None:
    """``clip=True`` keeps, per block and channel, the range of least squared error among ``CLIP_RATIOS`` of min-max
    (min-max included)."""
    v = torch.randn(2, 640, 8, generator=_gen(1))
    got = {}
    for clip in (False, True):
        a = quantize_keys(v, dataclasses.replace(VALUE_INDEX, bits=2, clip=clip))
        got[clip] = (dequantize_keys(a["codes"], a["lo"], a["step"], 2, 64) - v).square().view(2, 10, 64, 8).sum(2)
    assert (got[True] <= got[False] + 1e-6).all() and got[True].sum() < 0.8 * got[False].sum()


def test_remainder_mask_marks_the_unread_mid_tokens() -> None:
    k = torch.zeros(1, 40, 4)
    ctx = LayerContext(ResidentKV(k, k, page_size=16), 4, 30)
    tokens = torch.tensor([[[4, 10, 29, 7]]])
    valid = torch.tensor([[[True, True, True, False]]])
    rem = remainder_mask(ctx, tokens, valid)
    expect = torch.ones(1, 1, 26, dtype=torch.bool)
    expect[0, 0, [0, 6, 25]] = False
    assert torch.equal(rem, expect)


@pytest.mark.parametrize("mass", ["phi", "index"])
def test_index_remainder_matches_the_float64_reference(mass: str) -> None:
    """The product's float32 estimate (decoded keys, bmm) against ``remainder_ref`` in float64 on the same indexes."""
    hkv, n, d, g = 2, 300, 16, 3
    k, v = torch.randn(hkv, n, d, generator=_gen(2)), torch.randn(hkv, n, d, generator=_gen(3))
    src = MemorySource.build([(k, v)], [KeyIndexSummarizer, ValueIndexSummarizer])
    sel = IndexedTopKSelector(src.artifact("keyindex"))
    est = IndexRemainder(src, sel.approx_logits, mass)  # type: ignore[arg-type]
    ctx = LayerContext(ResidentKV(k, v, page_size=16), 4, n - 16)
    q = torch.randn(5, hkv, g, d, generator=_gen(4)) * 2
    tokens = torch.randint(ctx.lo, ctx.hi, (5, hkv, 24), generator=_gen(5))
    valid = torch.rand(5, hkv, 24, generator=_gen(6)) < 0.8
    phi_z, phi_mean = torch.randn(5, hkv, g), torch.randn(5, hkv, g, d)
    phi_z[0, 1, 2] = float("-inf")  # φ's "nothing left": kept as it is
    log_z, mean = est.apply(0, ctx, q, d ** -0.5, tokens, valid, phi_z, phi_mean)
    ki, vi = src.artifact("keyindex"), src.artifact("valueindex")
    keys, values = _decoded(ki, ctx.lo, ctx.hi), _decoded(vi, ctx.lo, ctx.hi)
    ref_z, ref_mean = remainder_ref(q, keys, values, remainder_mask(ctx, tokens, valid), d ** -0.5)
    keep = torch.isfinite(phi_z)
    expect_z = torch.where(keep, ref_z if mass == "index" else phi_z.double(), phi_z.double())
    expect_mean = torch.where(keep.unsqueeze(-1), ref_mean, phi_mean.double())
    assert torch.isinf(log_z[0, 1, 2]) and torch.equal(mean[0, 1, 2], phi_mean[0, 1, 2])
    torch.testing.assert_close(log_z.double(), expect_z, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean.double(), expect_mean, rtol=1e-5, atol=1e-5)
    assert log_z.dtype == torch.float32 and mean.dtype == torch.float32


@pytest.mark.parametrize("fraction", [0.05, 0.2])
def test_lossless_indexes_make_topk_phi_exact(fraction: float) -> None:
    """Keys on the key index's 4-bit grid and values on the value index's: the index remainder (value and
    mass) is the true one, so Top-K + completion equals full attention at any budget (the pseudo-entry and the single
    softmax are exact)."""
    hkv, n, d = 2, 512, 16
    k, v = _grid(hkv, n, d, 7) * 0.5, _grid(hkv, n, d, 8, bits=VALUE_INDEX.bits)
    base = TopKPhi(phi_value="index", phi_mass="index")
    src = MemorySource.build([(k, v)], base.summarizers)
    attn = base.open(src, DecodeConfig(budget=fraction, sink=2, tail=4, gen_len=256))
    for rows in (3, 1):  # the query's rows (page entries per row), then a decode step (one launch)
        q = torch.randn(1, hkv * 2, rows, d, generator=_gen(9 + rows))
        out, lse = attn.attend(0, q, d ** -0.5)
        ref, ref_lse = dense_attention(q, k[None], v[None], d ** -0.5)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=0)
    assert attn.read_report().tokens_per_step[0] < hkv * n


def test_topk_vi_is_the_index_remainder_and_topk_phi_stays_the_papers() -> None:
    m = get_method("topk+vi")
    assert isinstance(m, TopKPhi) and (m.phi_value, m.phi_mass) == ("index", "index")
    paper = get_method("topk+phi")  # the paper's φ pseudo-entry stays topk+phi's
    assert isinstance(paper, TopKPhi) and paper.phi_value == "phi"
    assert {s.name for s in m.summarizers} == {KeyIndexSummarizer.name, "valueindex"}  # no φ cache
    with pytest.raises(ValueError, match="mass"):
        IndexRemainder(MemorySource.build([(torch.zeros(1, 8, 4),) * 2], [ValueIndexSummarizer]),
                       lambda *a: torch.zeros(0), "none")  # type: ignore[arg-type]


def test_the_index_remainder_is_charged_once_and_changes_no_step_reads() -> None:
    """The value index is read once (its bytes in the one-time summaries). With φ's mass the φ cache is read too and
    the steps read what φ's own value reads; with the index's mass no φ cache is read or charged: Top-K's k and
    Top-K's step reads."""
    hkv, n, d = 2, 2048, 16
    k, v = torch.randn(hkv, n, d, generator=_gen(11)), torch.randn(hkv, n, d, generator=_gen(12))
    base = TopKPhi(phi_value="phi")
    src0 = MemorySource.build([(k, v)], base.summarizers)
    size = {name: sum(t.numel() * t.element_size() for t in a.values()) for name, a in src0._artifacts.items()}
    reports = {}
    for label, method in [("topk", get_method("topk")), ("phi", base),
                          ("index@phi", dataclasses.replace(base, phi_value="index", phi_mass="phi")),
                          ("index@index", dataclasses.replace(base, phi_value="index", phi_mass="index"))]:
        src = MemorySource.build([(k, v)], base.summarizers)
        attn = method.open(src, DecodeConfig(budget=0.05, gen_len=16))
        for rows in (4, 1, 1):
            attn.attend(0, torch.randn(1, hkv * 2, rows, d, generator=_gen(13 + rows)), d ** -0.5)
        reports[label] = attn.read_report()
    topk, phi, ip, ii = (reports[x] for x in ("topk", "phi", "index@phi", "index@index"))
    assert phi.once_bytes == topk.once_bytes + size["phi"]
    assert ip.once_bytes == phi.once_bytes + size["valueindex"]
    assert ip.extra["once_bytes_summaries"] == phi.extra["once_bytes_summaries"] + size["valueindex"]
    assert ip.tokens_per_step == phi.tokens_per_step and ip.extra["budget_k"] == phi.extra["budget_k"]
    assert ii.once_bytes == topk.once_bytes + size["valueindex"]  # no φ cache
    assert ii.tokens_per_step == topk.tokens_per_step and ii.extra["budget_k"] == topk.extra["budget_k"]
    assert ii.extra["budget_k"] > phi.extra["budget_k"]  # the φ fetch no longer takes exact tokens
    assert ii.extra["pseudo_entries_per_step"] == phi.extra["pseudo_entries_per_step"] > 0


@pytest.mark.parametrize("fraction", [0.02, 0.05])
def test_topk_vi_output_is_the_float64_merge_of_what_it_read(fraction: float) -> None:
    """The product path (``get_method("topk+vi").open(...).attend``, whole pages, a mid region not aligned to
    pages) against its definition in float64: every token of the picked pages inside the mid region and the
    anchors exactly, each once, and the rest only through the pseudo-entry (no token both read and in the
    remainder, logits on one scale). Real (lossy) indexes, so not full attention: the query's rows, then a
    decode step."""
    hkv, n, d, g, sink, tail = 2, 4000, 16, 3, 5, 11
    k, v = torch.randn(hkv, n, d, generator=_gen(20)), torch.randn(hkv, n, d, generator=_gen(21))
    method = get_method("topk+vi")
    src = MemorySource.build([(k, v)], method.summarizers)
    attn = method.open(src, DecodeConfig(budget=fraction, sink=sink, tail=tail, gen_len=1))
    lo, hi = sink, n - tail
    ctx = LayerContext(ResidentKV(k, v, page_size=16), lo, hi)
    indexes = [_decoded(a, lo, hi) for a in (src.artifact("keyindex"), src.artifact("valueindex"))]
    assert attn.k is not None and attn.k // 16 > 0
    for rows in (4, 1):
        q = torch.randn(1, hkv * g, rows, d, generator=_gen(22 + rows)) * 2
        out, lse = attn.attend(0, q, d ** -0.5)
        pages = attn.selector.select_pages(0, ctx, q[0].transpose(0, 1).reshape(rows, hkv, g, d), d ** -0.5,
                                           attn.k // 16)  # the same selection, asked again
        tok = torch.arange(lo, hi)
        read_mid = (tok.view(1, 1, -1, 1) // 16 == pages.unsqueeze(2)).any(-1)  # [T, Hkv, n_mid]
        assert read_mid.sum(-1).min() > 0 and read_mid.sum(-1).max() < hi - lo
        ref, ref_lse = merged_ref(q, k, v, *indexes, read_mid, lo, hi, d ** -0.5)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)


def test_a_topk_vi_subclass_reads_its_own_value_index_artifact() -> None:
    """A ``topk+vi`` whose summarizer stores another config under another name (``bench/bench_vi_bits.py``'s
    variants) completes from that artifact: the same output as ``topk+vi`` over a prefix whose ``valueindex`` was
    built with that config, and another than over the default's."""
    other = dataclasses.replace(VALUE_INDEX, bits=4 if VALUE_INDEX.bits != 4 else 2)  # not the default's width

    class Summ(ValueIndexSummarizer):
        name = "valueindex_other"

        def __init__(self, config: KeyIndexConfig = other):
            super().__init__(config)

    class Variant(TopKIndexRemainder):
        name = "topk+vi_other"
        summarizers = (KeyIndexSummarizer, Summ)

    hkv, n, d = 2, 1500, 16
    k, v = torch.randn(hkv, n, d, generator=_gen(30)), torch.randn(hkv, n, d, generator=_gen(31))
    q = torch.randn(1, hkv * 2, 1, d, generator=_gen(32)) * 2
    cfg = DecodeConfig(budget=0.05, sink=4, tail=8, gen_len=1)
    outs = {}
    for label, method, summarizers in (
            ("variant", Variant(), Variant.summarizers),  # no ``valueindex`` artifact at all
            ("other", TopKIndexRemainder(), (KeyIndexSummarizer, ValueIndexSummarizer(other))),
            ("default", TopKIndexRemainder(), TopKIndexRemainder.summarizers)):
        outs[label] = method.open(MemorySource.build([(k, v)], summarizers), cfg).attend(0, q, d ** -0.5)[0]
    torch.testing.assert_close(outs["variant"], outs["other"], atol=0, rtol=0)
    assert not torch.equal(outs["variant"], outs["default"])
