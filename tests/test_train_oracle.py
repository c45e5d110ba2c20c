"""The oracle top-k attention used for the model card's realism check."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lab.train.oracle_topk import ANCHORS, STATE, mid_entropy, topk_attention
from workers.budget import k_topk, n_budget
from workers.methods.selector import group_mass


def reference(q, k, v):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    q_len, k_len = q.shape[2], k.shape[2]
    mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def make(q_len: int, k_len: int):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(1, 4, q_len, 16, generator=g),
        torch.randn(1, 2, k_len, 16, generator=g),
        torch.randn(1, 2, k_len, 16, generator=g),
    )


def test_full_fraction_matches_causal_sdpa():
    q, k, v = make(5, 37)
    STATE.doc_len, STATE.fraction = 32, 1.0
    out, _ = topk_attention(None, q, k, v, None)
    torch.testing.assert_close(out, reference(q, k, v), rtol=1e-4, atol=1e-5)


@pytest.fixture
def selection():
    """Restore the default selection after a test changes it."""
    yield
    STATE.selection = "kv-head"


def test_query_head_topk_keeps_only_each_heads_best_document_keys(selection):
    q, k, v = make(1, 40)
    # ceil(1.6) = 2 of 32 document keys per query head, plus 8 resident keys
    STATE.doc_len, STATE.fraction, STATE.selection = 32, 0.05, "query-head"
    out, _ = topk_attention(None, q, k, v, None)
    k2, v2 = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    for h in range(4):
        scores = (q[0, h, 0] @ k2[0, h].T) / 4.0  # 1 / sqrt(head_dim 16)
        kept = scores[:32].topk(2).indices.tolist() + list(range(32, 40))
        p = torch.softmax(scores[kept], 0)
        torch.testing.assert_close(out[0, 0, h], p @ v2[0, h, kept], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(out, reference(q, k, v), atol=1e-3)


def test_mid_entropy_is_normalized_over_the_mid_region():
    n = 4 + 100 + 16  # sink + mid + tail (the runtime's anchors)
    flat = torch.zeros(2, n)
    flat[1, 4 + 7] = 1e4  # head 1: one mid key takes everything
    flat[:, :4] = 50.0  # sink scores do not count: the mid region is renormalized alone
    h = mid_entropy(flat)
    torch.testing.assert_close(h, torch.tensor([1.0, 0.0]), atol=1e-6, rtol=0)


def test_kv_head_topk_charges_anchors_and_shares_the_mid_selection_in_a_group():
    n_doc, n_res = 200, 3
    q, k, v = make(1, n_doc + n_res)
    STATE.doc_len, STATE.fraction, STATE.selection = n_doc, 0.15, "kv-head"
    out, _ = topk_attention(None, q, k, v, None)
    sink, tail = ANCHORS.sink, ANCHORS.tail
    n_keep = k_topk(n_budget(0.15, n_doc), sink, tail)  # 30 token equivalents - 20 anchors = 10 mid keys
    assert n_keep == 10
    logits = torch.einsum("hd,cnd->chn", q[0, :, 0], k[0]) / 4.0  # [kv, q heads, keys]
    for kv in range(2):
        group = logits[kv, 2 * kv : 2 * kv + 2, sink : n_doc - tail]  # the KV head's 2 query heads
        mid = (group_mass(group[None]).squeeze(0).topk(n_keep).indices + sink).tolist()
        kept = list(range(sink)) + sorted(mid) + list(range(n_doc - tail, n_doc + n_res))
        for h in (2 * kv, 2 * kv + 1):  # both query heads of the group attend to the same keys
            p = torch.softmax(logits[kv, h, kept], 0)
            torch.testing.assert_close(out[0, 0, h], p @ v[0, kv, kept], rtol=1e-4, atol=1e-5)


def test_kv_head_budget_below_the_anchors_keeps_only_anchors_and_resident_tokens():
    q, k, v = make(2, 64 + 2)
    STATE.doc_len, STATE.fraction, STATE.selection = 64, 0.05, "kv-head"  # ceil(3.2) = 4 < sink + tail
    out, _ = topk_attention(None, q, k, v, None)
    kept = list(range(ANCHORS.sink)) + list(range(64 - ANCHORS.tail, 66))
    ref = reference(q, k[:, :, kept], v[:, :, kept])
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
