"""Selection recall: do a block/page selector's picks hold the mid tokens full attention weighs most?

For NIAH samples, the prefix K/V is computed with the model and the query is run over it with exact
attention, recording each layer's queries. Then, per layer and query token, a selector (MoBA, Quest) picks
its units at a budget, and the picks are compared with full attention's mid-region mass (group-mean of the
query heads' distributions, as selection sees a KV head): the share of that mass the picks hold, and the
recall of the top-mass units that fit the same token budget. The needle's own tokens are scored too (the
mass on them under full attention, and whether the picks hold them).

    python -m bench.bench_selection_recall --model models/kvstash-tiny-cont --task niah_single --samples 3
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from lab.eval.accuracy import EVAL_SEED_BASE
from lab.synth import SynthContext, generate
from workers.attention import PREFIX_KWARG, dense_attention
from workers.budget import plan_budget
from workers.methods.base import mid_range
from workers.methods.layer_kv import ResidentKV
from workers.methods.moba import MobaBlocks, MobaSelector
from workers.methods.quest import QuestBounds, QuestSelector
from workers.methods.selector import LayerContext, Selector
from workers.model import LoadedModel, load_model
from workers.prefill import prefill_kv
from workers.requests import DecodeConfig


@dataclass
class Recorder:
    """A ``PrefixAttention`` that attends the whole prefix exactly and keeps every layer's queries."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    queries: dict[int, torch.Tensor] = field(default_factory=dict)

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact attention over the prefix; records q ``[B, Hq, L, D]``."""
        self.queries[layer] = q.detach().float().clone()
        return dense_attention(q.float(), self.k[layer][None], self.v[layer][None], scale)


def run_query(lm: LoadedModel, doc_ids: list[int], query: str) -> tuple[Recorder, list[int], float]:
    """Prefix K/V of ``doc_ids`` and the per-layer queries of ``query`` (raw) over it."""
    ks, vs = [], []
    for _, k, v in prefill_kv(lm, doc_ids, progress=False):
        ks.append(k.float())
        vs.append(v.float())
    rec = Recorder(ks, vs)
    q_ids = list(lm.tokenizer(query, add_special_tokens=False).input_ids)
    n = len(doc_ids)
    ids = torch.tensor([q_ids])
    pos = torch.arange(n, n + len(q_ids))[None]
    with torch.no_grad():
        lm.model(input_ids=ids, position_ids=pos, past_key_values=DynamicCache(config=lm.model.config),
                 use_cache=True, **{PREFIX_KWARG: rec})
    attn = lm.model.model.layers[0].self_attn
    return rec, q_ids, float(attn.scaling)


def full_mass(k: torch.Tensor, q: torch.Tensor, scale: float) -> torch.Tensor:
    """Group-mean attention ``[T, Hkv, N]`` of grouped queries ``[T, Hkv, G, D]`` over keys ``[Hkv, N, D]``."""
    logits = torch.einsum("thgd,hnd->thgn", q, k) * scale
    return torch.softmax(logits, -1).mean(2)


def unit_recall(mass: torch.Tensor, picked: torch.Tensor, lo: int, hi: int, unit: int) -> tuple[float, float]:
    """(share of the mid mass on picked tokens, recall of the top-mass units that fit as many tokens).

    ``mass`` ``[T, Hkv, N]``, ``picked`` ``[T, Hkv, N]`` bool."""
    mid = mass[..., lo:hi]
    share = float(((mass * picked)[..., lo:hi].sum(-1) / mid.sum(-1).clamp_min(1e-30)).mean())
    n = mass.shape[-1]
    units = (n + unit - 1) // unit
    pad = torch.zeros(*mass.shape[:-1], units * unit)
    pad[..., lo:hi] = mid
    umass = pad.view(*mass.shape[:-1], units, unit).sum(-1)
    ppad = torch.zeros(*mass.shape[:-1], units * unit, dtype=torch.bool)
    ppad[..., lo:hi] = picked[..., lo:hi]
    upicked = ppad.view(*mass.shape[:-1], units, unit).any(-1)
    m = max(1, int(upicked.sum(-1).float().mean().round()))
    top = torch.topk(umass, m, -1).indices
    return share, float(upicked.gather(-1, top).float().mean())


def picks(sel: Selector, layer: int, ctx: LayerContext, qg: torch.Tensor, scale: float, k: int) -> torch.Tensor:
    """``[T, Hkv, N]`` bool: the mid tokens ``sel`` attends at budget ``k``."""
    s = sel.select(layer, ctx, qg, scale, k)
    t, hkv = qg.shape[:2]
    out = torch.zeros(t, hkv, ctx.n_tokens, dtype=torch.bool)
    valid = torch.arange(s.tokens.shape[-1]) < s.counts[..., None]
    out.scatter_(-1, s.tokens.clamp(0, ctx.n_tokens - 1), valid)
    return out


def needle_positions(lm: LoadedModel, doc_ids: list[int], answers: tuple[str, ...]) -> list[int]:
    """Token positions of the document whose text contains a gold answer."""
    out: list[int] = []
    for a in answers:
        a_ids = list(lm.tokenizer(a, add_special_tokens=False).input_ids)
        for i in range(len(doc_ids) - len(a_ids) + 1):
            if doc_ids[i:i + len(a_ids)] == a_ids:
                out.extend(range(i, i + len(a_ids)))
    return out


def selectors(layer: int, k: torch.Tensor, v: torch.Tensor,
              moba_blocks: tuple[int, ...]) -> dict[str, tuple[Selector, int]]:
    """MoBA (one per block size, named ``moba<B>``) and Quest (16-token pages) over one layer's keys, with their
    unit sizes."""
    out: dict[str, tuple[Selector, int]] = {}
    for b in moba_blocks:
        mb = MobaBlocks()
        mb.block = b
        mo = mb.summarize(layer, k, v)
        out[f"moba{b}"] = (MobaSelector({f"{layer}.kmean": mo["kmean"], "0.meta": mo["meta"]}), b)
    qu = QuestBounds().summarize(layer, k, v)
    quest = QuestSelector({f"{layer}.kmin": qu["kmin"], f"{layer}.kmax": qu["kmax"], "0.meta": qu["meta"]})
    out["quest"] = (quest, QuestBounds.page_size)
    return out


def sample_report(lm: LoadedModel, task: str, length: int, seed: int, budget: float,
                  moba_blocks: tuple[int, ...] = (MobaBlocks.block,)) -> dict[str, object]:
    """Per-layer share / recall / needle hit rate of MoBA's and Quest's picks for one sample.

    The query is followed by the gold answer (teacher forcing); the rows scored are the last query token and
    the answer tokens but the last (the rows that predict answer tokens). ``hit``: over rows whose full
    attention puts more than half its mass on gold-answer tokens of the document, the fraction whose picks
    hold the gold token full attention weighs most (the paper's H1 hit rate)."""
    ctx_s = SynthContext(tokenizer=lm.tokenizer, split="eval")
    sample = generate(task, length, seed, ctx_s)
    doc_ids = list(lm.tokenizer(sample.document).input_ids)
    answer = " " + " ".join(sample.answers)
    n_ans = len(lm.tokenizer(sample.query + answer, add_special_tokens=False).input_ids) - len(
        lm.tokenizer(sample.query, add_special_tokens=False).input_ids)
    rec, _, scale = run_query(lm, doc_ids, sample.query + answer)
    n = len(doc_ids)
    cfg = DecodeConfig()
    lo, hi = mid_range(n, cfg.sink, cfg.tail)
    k_tok = plan_budget(fraction=budget, prefill_len=n, head_dim=rec.k[0].shape[-1], sink=cfg.sink,
                        tail=cfg.tail, gen_len=1).k_exact(False)
    needle = torch.tensor([p for p in needle_positions(lm, doc_ids, sample.answers) if lo <= p < hi], dtype=torch.long)
    rows: list[dict[str, object]] = []
    for layer in range(len(rec.k)):
        k, v = rec.k[layer], rec.v[layer]
        q = rec.queries[layer][0].permute(1, 0, 2)[-n_ans - 1:-1]  # [T, Hq, D]: the rows predicting the answer
        hkv = k.shape[0]
        qg = q.reshape(q.shape[0], hkv, -1, q.shape[-1])
        ctx = LayerContext(kv=ResidentKV(k, v, page_size=16), lo=lo, hi=hi)
        mass = full_mass(k, qg, scale)
        row: dict[str, object] = {"layer": layer}
        retrieving = mass[..., needle].sum(-1) > 0.5  # [T, Hkv]; all False without a needle in the mid region
        best = needle[mass[..., needle].argmax(-1)] if needle.numel() else None
        row["retrieving_rows"] = int(retrieving.sum())
        for name, (sel, unit) in selectors(layer, k, v, moba_blocks).items():
            p = picks(sel, layer, ctx, qg, scale, k_tok)
            share, recall = unit_recall(mass, p, lo, hi, unit)
            row[f"{name}_share"], row[f"{name}_recall"] = round(share, 3), round(recall, 3)
            if best is not None and bool(retrieving.any()):
                hit = p.gather(-1, best[..., None])[..., 0]
                row[f"{name}_hit"] = round(float(hit[retrieving].float().mean()), 3)
        rows.append(row)
    return {"task": task, "seed": seed, "n": n, "budget": budget, "k": k_tok, "answer_rows": n_ans, "layers": rows}


def main() -> None:
    """Print one JSON line per sample."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/kvstash-tiny-cont")
    ap.add_argument("--task", default="niah_single")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--moba-block", type=int, action="append", help="MoBA block size (repeatable; default 64)")
    args = ap.parse_args()
    lm = load_model(args.model, device="cpu", progress=False)
    for i in range(args.samples):
        print(json.dumps(sample_report(lm, args.task, args.length, EVAL_SEED_BASE + i, args.budget,
                                              tuple(args.moba_block or (MobaBlocks.block,)))), flush=True)


if __name__ == "__main__":
    main()
