"""The CPU gather-entries kernel (``workers/kernels/gather_entries``) == its plain torch reference bit for bit, and
a single-row sparse attention through it (``attend_entries``) == the torch form the sparse path ran before
(``sparse._append`` + ``sparse_decode_attention_torch``), bit for bit."""

from __future__ import annotations

import pytest
import torch

from workers.kernels.gather_entries import attend_entries, cpu_kernel_available, gather_entries, gather_entries_ref
from workers.kernels.sparse_attention import sparse_decode_attention_torch
from workers.methods.sparse import _append

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="no C++ compiler: the kernel is not built")


def _case(seed: int, hkv: int, g: int, d: int, shared: bool, extra: bool, pseudo: bool):
    gen = torch.Generator().manual_seed(seed * 1000 + hkv * 100 + g * 10 + d)
    s, wa, wb = 700, 90, 30
    if shared:  # a host-tier pool: rows shared by every head (zero head stride)
        k, v = (torch.randn(s, d, generator=gen).expand(hkv, -1, -1) for _ in range(2))
    else:
        k, v = torch.randn(hkv, s, d, generator=gen), torch.randn(hkv, s, d, generator=gen)
    rows = torch.randint(0, s, (hkv, wa), generator=gen)
    n = torch.randint(0, wa + 1, (hkv,), generator=gen)
    n[0] = wa
    if seed:
        n[-1] = 0  # a head with no exact entry
        rows[-1, n[-1]:] = -1  # padding past the count: row -1, as the host view gives it
    kw: dict = {}
    if extra:  # extra entries by id: pool rows through a table (seed 0) or the ids themselves (seed 1)
        nb = torch.randint(0, wb + 1, (hkv,), generator=gen)
        nb[-1] = 0 if seed else wb
        mb = 50
        kw = dict(ids_b=torch.randint(0, mb, (hkv, wb), generator=gen), n_b=nb,
                  bias_b=torch.randn(hkv, mb, generator=gen),
                  table_b=None if seed else torch.randint(0, s, (hkv, mb), generator=gen))
    pl = pv = None
    if pseudo:
        pl, pv = torch.randn(1, hkv * g, 1, generator=gen) + 3, torch.randn(1, hkv * g, 1, d, generator=gen)
    q = torch.randn(1, hkv * g, d, generator=gen) * 2
    return q, k, v, rows, n, kw, pl, pv


CASES = [(hkv, g, d, shared, extra, pseudo, seed) for hkv, g, d in [(2, 4, 64), (1, 1, 16), (4, 2, 128), (2, 3, 40)]
         for shared in (False, True) for extra in (False, True) for pseudo in (False, True) for seed in (0, 1)]


@pytest.mark.parametrize("hkv,g,d,shared,extra,pseudo,seed", CASES)
def test_kernel_equals_the_torch_reference(hkv: int, g: int, d: int, shared: bool, extra: bool, pseudo: bool,
                                           seed: int) -> None:
    q, k, v, rows, n, kw, _, _ = _case(seed, hkv, g, d, shared, extra, pseudo)
    for got, want in zip(gather_entries(k, v, rows, n, **kw), gather_entries_ref(k, v, rows, n, **kw), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("hkv,g,d,shared,extra,pseudo,seed", CASES)
def test_attention_through_it_is_the_torch_forms_bits(hkv: int, g: int, d: int, shared: bool, extra: bool,
                                                      pseudo: bool, seed: int) -> None:
    q, k, v, rows, n, kw, pl, pv = _case(seed, hkv, g, d, shared, extra, pseudo)
    kg, vg, bias = gather_entries(k, v, rows, n, **kw)
    out, lse = attend_entries(q, kg[None], vg[None], bias[None], scale=d ** -0.5, pseudo_logits=pl, pseudo_values=pv)
    idx, nv, tbias = rows[None], n[None], None
    if extra:  # the sparse path's torch form: the extra rows and their bias gathered, then joined
        e = kw["ids_b"]
        rows_b = kw["table_b"].gather(1, e) if kw["table_b"] is not None else e
        idx, nv, tbias = _append(idx, nv, rows_b[None], kw["n_b"][None], kw["bias_b"].gather(1, e)[None])
    kb, vb = k.unsqueeze(0), v.unsqueeze(0)
    want_out, want_lse = sparse_decode_attention_torch(q, kb, vb, scale=d ** -0.5, idx=idx, n_valid=nv, bias=tbias,
                                                       pseudo_logits=pl, pseudo_values=pv)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_rows_and_ids_outside_their_tables_raise() -> None:
    k = torch.zeros(2, 10, 8)
    with pytest.raises(ValueError, match="pool"):
        gather_entries(k, k, torch.full((2, 3), 10), torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="table"):
        gather_entries(k, k, torch.zeros(2, 3, dtype=torch.long), torch.tensor([3, 3]), torch.full((2, 1), 4),
                       torch.tensor([1, 1]), torch.zeros(2, 4))


@pytest.mark.parametrize("method", ["doublep", "doublep+phi", "topk-exact", "moba"])
@pytest.mark.parametrize("fraction", [0.05, 0.3])
def test_single_row_steps_through_the_kernel_are_the_torch_forms_bits(method: str, fraction: float,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The sparse path's single-row steps over resident K/V (extra rows by rule, not a table) with and without
    ``CPU_GATHER_KERNEL``: the same out and lse bits."""
    from workers.methods import sparse
    from workers.methods.memory import MemorySource
    from workers.methods.registry import METHODS, get_method
    from workers.requests import DecodeConfig

    gen = torch.Generator().manual_seed(5)
    hkv, g, d, n = 2, 2, 16, 403
    kv = [(torch.randn(hkv, n, d, generator=gen), torch.randn(hkv, n, d, generator=gen)) for _ in range(2)]
    src = MemorySource.build(kv, METHODS[method].summarizers)
    cfg = DecodeConfig(budget=fraction, sink=2, tail=4, gen_len=256)
    q = [torch.randn(1, hkv * g, 1, d, generator=gen) * 2 for _ in range(3)]
    got = {}
    for on in (True, False):
        monkeypatch.setattr(sparse, "CPU_GATHER_KERNEL", on)
        attn = get_method(method).open(src, cfg)
        got[on] = [attn.attend(layer, qs, d ** -0.5) for qs in q for layer in range(len(kv))]
    for (o1, s1), (o2, s2) in zip(got[True], got[False], strict=True):
        assert torch.equal(o1, o2) and torch.equal(s1, s2)
