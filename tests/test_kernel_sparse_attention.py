"""Sparse decode attention kernel == float64 reference.

Runs the Triton kernels in the CPU interpreter (TRITON_INTERPRET=1, set here before
triton is imported) where there is no CUDA device, and compiled on the GPU where there is
one (set ``TRITON_INTERPRET=1`` to force the interpreter there: then run this file alone, as
the interpreter would also take every other test's CUDA kernels in the same process).

Tolerances (``|kernel - ref| <= atol + rtol * |ref|``, reference in float64 from the
same rounded inputs):
- float32 inputs: out atol 1e-5, rtol 1e-5; lse atol 1e-5, rtol 1e-6 (fp32 arithmetic,
  IEEE dots).
- bfloat16 / float16 inputs: out atol 2e-2, rtol 2e-2 (probabilities are rounded to
  the input dtype before the P @ V dot, and out is rounded to it); lse atol 1e-4
  and rtol 1e-6 (q . k of rounded inputs is exact in fp32 up to summation order).
Every buffer the launcher allocates is pre-filled with NaN, so an unwritten output
fails; NaN also fills K/V rows and bias/index padding the kernel must not read.
"""

from __future__ import annotations

import math
import os
import sys

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

pytest.importorskip("triton")


def _ensure_interpreter_mode() -> None:
    """Re-import triton if something imported it before TRITON_INTERPRET was set.

    triton picks interpreter vs compiled mode per function when ``@triton.jit`` runs at
    import time, and ``torch._dynamo`` (pulled in by transformers via other test modules
    and conftest) imports triton early. Only the pure-Python modules are dropped; the
    compiled ``triton._C`` extension stays loaded.
    """
    import triton.language.standard as std
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(std.zeros, InterpretedFunction):
        return
    for name in list(sys.modules):
        is_triton = (name == "triton" or name.startswith("triton.")) and not name.startswith("triton._C")
        if is_triton or name == "workers.kernels.sparse_attention.triton":
            del sys.modules[name]
    import triton.language  # noqa: F401  (fresh, in interpreter mode)


if os.environ["TRITON_INTERPRET"].lower() in ("1", "true", "on", "yes"):
    _ensure_interpreter_mode()

from workers.kernels.sparse_attention import (  # noqa: E402
    choose_num_splits,
    merge_attention_states,
    ops,
    sparse_decode_attention,
    sparse_decode_attention_ref,
)

INTERPRET = os.environ["TRITON_INTERPRET"].lower() in ("1", "true", "on", "yes")
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5, lse_atol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2, lse_atol=1e-4),
    torch.float16: dict(atol=2e-2, rtol=2e-2, lse_atol=1e-4),
}
MODES = ("dense", "idx", "idx+nvalid", "idx+nvalid+bias", "pseudo", "all")


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    """Every tensor the launcher allocates starts as NaN: unwritten outputs fail."""

    def nan_empty(*shape, **kw):
        return torch.empty(*shape, **kw).fill_(float("nan"))

    monkeypatch.setattr(ops, "_empty", nan_empty)


def _gen(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def make_case(seed, B, Hkv, G, D, S, N, dtype, mode, M=3, qmul=1.0):
    """Random inputs for one case; returns (q, k, v, kwargs). Unselected K/V rows are NaN."""
    g = _gen(seed)
    q = (torch.randn(B, Hkv * G, D, generator=g) * qmul).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    kw: dict = {}
    if mode != "dense" and mode != "pseudo":
        idx = torch.stack([torch.randperm(S, generator=g)[:N] for _ in range(B * Hkv)]).view(B, Hkv, N)
        kw["idx"] = idx.to(torch.int32 if seed % 2 else torch.int64)
    if "nvalid" in mode or mode == "all":
        nv = torch.randint(0, N + 1, (B, Hkv), generator=g, dtype=torch.int32)
        nv.view(-1)[0] = N  # at least one full head
        kw["n_valid"] = nv
        pos = torch.arange(N).view(1, 1, N)
        kw["idx"] = torch.where(pos < nv.unsqueeze(-1), kw["idx"], torch.full_like(kw["idx"], 10**9))
    if "bias" in mode or mode == "all":
        bias = torch.randn(B, Hkv, N, generator=g).abs().log1p()  # like log(cluster size)
        bias[..., 0] = float("-inf") if N > 1 else 0.0
        kw["bias"] = bias
    if "pseudo" in mode or mode == "all":
        pl = torch.randn(B, Hkv * G, M, generator=g) + 1.0
        pl[0, 0, 0] = float("-inf")
        kw["pseudo_logits"] = pl
        kw["pseudo_values"] = torch.randn(B, Hkv * G, M, D, generator=g).to(dtype)
    if "idx" in kw:  # rows never selected are NaN: reading one poisons the output
        sel = torch.zeros(B, Hkv, S, dtype=torch.bool)
        nv = kw.get("n_valid", torch.full((B, Hkv), N))
        for b in range(B):
            for h in range(Hkv):
                sel[b, h, kw["idx"][b, h, : nv[b, h]].long()] = True
        k = k.masked_fill(~sel.unsqueeze(-1), float("nan"))
        v = v.masked_fill(~sel.unsqueeze(-1), float("nan"))
        if "bias" in kw:
            pos = torch.arange(N).view(1, 1, N)
            kw["bias"] = kw["bias"].masked_fill(pos >= nv.unsqueeze(-1), float("nan"))
    return q, k, v, kw


def to_dev(*ts, kw=None):
    moved = [t.to(DEVICE) for t in ts]
    return moved, {k: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for k, t in (kw or {}).items()}


def check(q, k, v, kw, dtype, num_splits=None, scale=None):
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    (qd, kd, vd), kwd = to_dev(q, k, v, kw=kw)
    out, lse = sparse_decode_attention(qd, kd, vd, scale=scale, num_splits=num_splits, **kwd)
    ref_out, ref_lse = sparse_decode_attention_ref(q, k, v, scale=scale, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    assert not torch.isnan(out).any(), "NaN in out"
    assert not torch.isnan(lse).any(), "NaN in lse"
    tol = TOL[dtype]
    torch.testing.assert_close(out.cpu().double(), ref_out, atol=tol["atol"], rtol=tol["rtol"])
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=tol["lse_atol"], rtol=1e-6)
    return out.cpu(), lse.cpu()


# odd N x GQA ratio, cycling head dim, dtype and mode
SHAPE_CASES = [
    (N, G, (64, 128)[i % 2], (torch.float32, torch.bfloat16)[(i // 2) % 2], MODES[i % len(MODES)])
    for i, (N, G) in enumerate((N, G) for N in (1, 7, 63, 111, 1000) for G in (1, 4, 8))
]


@pytest.mark.parametrize("N,G,D,dtype,mode", SHAPE_CASES)
def test_matches_reference_shapes(N, G, D, dtype, mode):
    S = N if mode in ("dense", "pseudo") else N + 5
    q, k, v, kw = make_case(N * 31 + G, B=2, Hkv=2, G=G, D=D, S=S, N=N, dtype=dtype, mode=mode)
    check(q, k, v, kw, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_matches_reference_modes(mode, dtype):
    q, k, v, kw = make_case(7, B=2, Hkv=2, G=4, D=128, S=300, N=111, dtype=dtype, mode=mode)
    check(q, k, v, kw, dtype)


@pytest.mark.parametrize("D", [64, 128, 80])
def test_head_dims_fp16_and_non_pow2(D):
    q, k, v, kw = make_case(3, B=1, Hkv=2, G=4, D=D, S=200, N=130, dtype=torch.float16, mode="all")
    check(q, k, v, kw, torch.float16)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 16, 64])
def test_split_count_does_not_change_result(num_splits):
    q, k, v, kw = make_case(11, B=1, Hkv=2, G=4, D=64, S=1200, N=1000, dtype=torch.float32, mode="all")
    check(q, k, v, kw, torch.float32, num_splits=num_splits)


def test_small_blocks_many_splits():
    """63 splits of 16 entries (internal launcher): the reduce kernel merges many partials."""
    q, k, v, kw = make_case(12, B=1, Hkv=2, G=4, D=64, S=1200, N=1000, dtype=torch.float32, mode="all")
    (qd, kd, vd), kwd = to_dev(q, k, v, kw=kw)
    out = torch.full_like(qd, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=DEVICE)
    ops._launch(
        qd,
        kd,
        vd,
        0.125,
        kwd["idx"],
        kwd["n_valid"],
        kwd["bias"],
        kwd["pseudo_logits"],
        kwd["pseudo_values"],
        out,
        lse,
        1000,
        63,
        block_n=16,
    )
    ref_out, ref_lse = sparse_decode_attention_ref(q, k, v, scale=0.125, **kw)
    torch.testing.assert_close(out.cpu().double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=1e-5, rtol=1e-6)


def test_peaked_logits_are_stable():
    q, k, v, kw = make_case(5, B=2, Hkv=2, G=4, D=64, S=400, N=333, dtype=torch.float32, mode="all", qmul=30.0)
    kw["pseudo_logits"] = kw["pseudo_logits"] * 50
    check(q, k, v, kw, torch.float32, num_splits=4)


@pytest.mark.parametrize("with_pseudo", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_set(with_pseudo, dtype):
    mode = "all" if with_pseudo else "idx+nvalid+bias"
    q, k, v, kw = make_case(13, B=2, Hkv=2, G=4, D=64, S=100, N=70, dtype=dtype, mode=mode)
    kw["n_valid"] = torch.zeros_like(kw["n_valid"])
    kw["idx"] = torch.full_like(kw["idx"], -(10**9))  # all padding: must never be read
    out, lse = check(q, k, v, kw, dtype, num_splits=2)
    if not with_pseudo:
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.isneginf(lse).all()
    else:
        assert torch.isneginf(lse[0, 0]) == torch.isneginf(kw["pseudo_logits"][0, 0]).all()


def test_empty_set_every_way():
    """N=0 (no idx columns, or S=0), all-(-inf) bias, all-(-inf) pseudo logits: out 0, lse -inf."""
    B, Hkv, G, D = 2, 2, 4, 64
    q = torch.randn(B, Hkv * G, D, generator=_gen(1))
    k = torch.randn(B, Hkv, 10, D, generator=_gen(2))
    empties = [
        (k[:, :, :0], k[:, :, :0], {}),
        (k, k, {"idx": torch.zeros(B, Hkv, 0, dtype=torch.int32)}),
        (k, k, {"bias": torch.full((B, Hkv, 10), float("-inf"))}),
        (
            k,
            k,
            {
                "n_valid": torch.zeros(B, Hkv, dtype=torch.int32),
                "pseudo_logits": torch.full((B, Hkv * G, 2), float("-inf")),
                "pseudo_values": torch.randn(B, Hkv * G, 2, D, generator=_gen(3)),
            },
        ),
    ]
    for kk, vv, kw in empties:
        (qd, kd, vd), kwd = to_dev(q, kk, vv, kw=kw)
        out, lse = sparse_decode_attention(qd, kd, vd, scale=0.125, **kwd)
        assert torch.equal(out.cpu(), torch.zeros_like(q)), kw.keys()
        assert torch.isneginf(lse).all(), kw.keys()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_entry(dtype):
    q, k, v, kw = make_case(17, B=2, Hkv=2, G=8, D=128, S=50, N=1, dtype=dtype, mode="idx")
    out, lse = check(q, k, v, kw, dtype)
    row = kw["idx"][:, :, 0].long()
    v_sel = v[torch.arange(2)[:, None], torch.arange(2)[None, :], row]  # [B, Hkv, D]
    torch.testing.assert_close(out, v_sel.repeat_interleave(8, dim=1), atol=0, rtol=0)


def test_strided_page_cache_view():
    """k, v as views of a [B, S, Hkv, D] cache (non-contiguous heads) and q a slice."""
    g = _gen(21)
    B, Hkv, G, D, S = 2, 2, 4, 64, 150
    cache = torch.randn(2, B, S, Hkv, D, generator=g)
    k, v = cache[0].transpose(1, 2), cache[1].transpose(1, 2)
    q = torch.randn(B, Hkv * G, 2 * D, generator=g)[..., :D]
    idx = torch.randint(0, S, (B, Hkv, 77), generator=g)
    check(q, k, v, {"idx": idx}, torch.float32, num_splits=2)


@pytest.mark.parametrize("mode", ["pseudo", "all", "dense"])
def test_output_written_into_a_given_strided_out(mode):
    """``out=``: the kernel writes a column of a packed [1, Hq, T, D] output in place (what a captured step's
    members do), equal to the returned tensor of a call without it, and touches nothing else of it."""
    q, k, v, kw = make_case(5, B=1, Hkv=2, G=4, D=64, S=40, N=33, dtype=torch.bfloat16, mode=mode)
    (qd, kd, vd), kwd = to_dev(q, k, v, kw=kw)
    want, want_lse = sparse_decode_attention(qd, kd, vd, scale=0.125, **kwd)
    packed = torch.full((1, 8, 3, 64), 7.0, dtype=torch.bfloat16, device=DEVICE)
    got, lse = sparse_decode_attention(qd, kd, vd, scale=0.125, out=packed[:, :, 1], **kwd)
    assert got.data_ptr() == packed[:, :, 1].data_ptr()
    assert torch.equal(packed[:, :, 1], want) and torch.equal(lse, want_lse)
    assert (packed[:, :, 0] == 7).all() and (packed[:, :, 2] == 7).all()
    with pytest.raises(ValueError, match="out must be"):
        sparse_decode_attention(qd, kd, vd, scale=0.125, out=packed[:, :, 1].float(), **kwd)


def test_merge_of_disjoint_parts_equals_union():
    """Kernel over a partition (exact part A, exact part B + pseudo, an empty part) merged == union."""
    q, k, v, kw = make_case(23, B=2, Hkv=2, G=4, D=64, S=500, N=400, dtype=torch.float32, mode="idx+bias+pseudo")
    idx, bias = kw["idx"], kw["bias"]
    nv = torch.full((2, 2), 400, dtype=torch.int32)
    kw_union = {"idx": idx, "bias": bias, "pseudo_logits": kw["pseudo_logits"], "pseudo_values": kw["pseudo_values"]}
    cut = 150
    parts = [
        {"idx": idx[..., :cut], "bias": bias[..., :cut]},
        {
            "idx": idx[..., cut:],
            "bias": bias[..., cut:],
            "n_valid": nv - cut,
            "pseudo_logits": kw["pseudo_logits"],
            "pseudo_values": kw["pseudo_values"],
        },
        {"idx": idx, "n_valid": torch.zeros_like(nv)},
    ]
    outs, lses = [], []
    for part in parts:
        (qd, kd, vd), kwd = to_dev(q, k, v, kw=part)
        o, s = sparse_decode_attention(qd, kd, vd, scale=0.125, **kwd)
        outs.append(o.cpu())
        lses.append(s.cpu())
    out, lse = merge_attention_states(torch.stack(outs), torch.stack(lses))
    ref_out, ref_lse = sparse_decode_attention_ref(q, k, v, scale=0.125, **kw_union)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=0)
    (qd, kd, vd), kwd = to_dev(q, k, v, kw=kw_union)
    out_u, lse_u = sparse_decode_attention(qd, kd, vd, scale=0.125, **kwd)
    torch.testing.assert_close(out, out_u.cpu(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, lse_u.cpu(), atol=1e-5, rtol=0)


def test_merge_attention_states_edges():
    outs = torch.randn(3, 2, 4, 8)
    lses = torch.randn(3, 2, 4)
    lses[:, 0, 0] = float("-inf")  # every part empty
    lses[1, 1, :] = float("-inf")  # one empty part whose out is garbage
    outs[1, 1, :] = float("nan")
    out, lse = merge_attention_states(outs, lses)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[0, 0], torch.zeros(8)) and torch.isneginf(lse[0, 0])
    w = torch.softmax(lses[:, 1, 2].double(), dim=0)
    torch.testing.assert_close(out[1, 2].double(), (w[0] * outs[0, 1, 2] + w[2] * outs[2, 1, 2]).double())
    torch.testing.assert_close(lse[1, 2], torch.logsumexp(lses[[0, 2], 1, 2], dim=0))
    # one part is the identity; merge is invariant to part order
    o1, l1 = merge_attention_states(outs[:1], lses[:1])
    torch.testing.assert_close(o1[1:], outs[0, 1:])
    o2, l2 = merge_attention_states(outs.flip(0), lses.flip(0))
    torch.testing.assert_close(o2, out)
    with pytest.raises(ValueError, match="outs must be"):
        merge_attention_states(outs, lses[:2])


def test_choose_num_splits():
    dev = torch.device("cpu")
    assert choose_num_splits(1, 8, 1, dev) == 1
    assert choose_num_splits(1, 8, 64, dev) == 1
    assert choose_num_splits(1, 1, 10**6, dev) >= 2
    assert 1 <= choose_num_splits(64, 8, 10**6, dev) <= choose_num_splits(1, 8, 10**6, dev)


def _bad_calls():
    B, Hkv, G, D, S, N = 2, 2, 4, 64, 30, 20
    q = torch.randn(B, Hkv * G, D)
    k = torch.randn(B, Hkv, S, D)
    idx = torch.zeros(B, Hkv, N, dtype=torch.int32)
    pl, pv = torch.zeros(B, Hkv * G, 3), torch.zeros(B, Hkv * G, 3, D)
    ok = dict(q=q, k=k, v=k, scale=0.1)
    return [
        ("q must be a tensor of shape", dict(ok, q=q[0])),
        ("k has shape", dict(ok, k=k[:, :, :, :32], v=k[:, :, :, :32])),
        ("v has shape", dict(ok, v=k[:, :, :10])),
        ("k has dtype", dict(ok, k=k.double())),
        ("q has dtype", dict(ok, q=q.long(), k=k.long(), v=k.long())),
        ("multiple of Hkv", dict(ok, k=torch.randn(B, 3, S, D), v=torch.randn(B, 3, S, D))),
        ("scale must be", dict(ok, scale=float("nan"))),
        ("scale must be", dict(ok, scale=torch.tensor(0.1))),
        ("idx has dtype", dict(ok, idx=idx.float())),
        ("idx has shape", dict(ok, idx=idx[0])),
        ("n_valid has shape", dict(ok, idx=idx, n_valid=torch.zeros(B, dtype=torch.int32))),
        ("bias has shape", dict(ok, idx=idx, bias=torch.zeros(B, Hkv, N + 1))),
        ("bias has dtype", dict(ok, idx=idx, bias=torch.zeros(B, Hkv, N, dtype=torch.float64))),
        ("together", dict(ok, pseudo_logits=pl)),
        ("pseudo_values has shape", dict(ok, pseudo_logits=pl, pseudo_values=pv[:, :, :2])),
        ("pseudo_logits has dtype", dict(ok, pseudo_logits=pl.half(), pseudo_values=pv)),
        (
            "contiguous in its last dimension",
            dict(
                ok, k=k.transpose(2, 3).contiguous().transpose(2, 3), v=k.transpose(2, 3).contiguous().transpose(2, 3)
            ),
        ),
        ("head dim", dict(ok, q=torch.randn(B, 8, 512), k=torch.randn(B, 2, S, 512), v=torch.randn(B, 2, S, 512))),
        ("num_splits must be", dict(ok, num_splits=0)),
    ]


@pytest.mark.parametrize("match,call", _bad_calls(), ids=[m for m, _ in _bad_calls()])
def test_launcher_rejects_bad_arguments(match, call):
    call = {k: (t.to(DEVICE) if isinstance(t, torch.Tensor) and k != "scale" else t) for k, t in call.items()}
    with pytest.raises(ValueError, match=match):
        sparse_decode_attention(**call)


def test_launcher_rejects_mixed_devices_and_cpu_without_interpreter(monkeypatch):
    q = torch.randn(1, 4, 64)
    k = torch.randn(1, 1, 8, 64)
    if DEVICE == "cuda":
        with pytest.raises(ValueError, match="move all tensors to one device"):
            sparse_decode_attention(q.cuda(), k, k, scale=0.1)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="move them to a CUDA device"):
        sparse_decode_attention(q, k, k, scale=0.1)
