"""Attention-level error of every sparse method at matched token-equivalent reads.

Relative L1 error of the attention output against full attention (``topk-phi-completion.txt``
eq. 53), per (layer, query head, decode step) row, averaged within quartiles of the
mid-region normalized entropy H_mid (eq. 52), at per-step budgets f = 1..5 % of the prefix
(appendix D: Top-K reads ``k_topk(f)`` mid tokens, φ-completed methods ``k_hyb(f, L_gen=1)``).

Two data sources:
- ``--model PATH``: q/K/V captured from a model (post-RoPE, what attention saw) over documents of
  the synthetic task suite; the queries are the question tokens that follow the document.
- otherwise planted synthetic heads: keys follow topic segments (locality, cluster structure),
  queries aim at a needle token or a topic with a per-head sharpness that spreads H_mid over [0, 1].

    .venv/bin/python bench/bench_attention_error.py                                  # planted
    .venv/bin/python bench/bench_attention_error.py --model models/kvstash-tiny --n 16384
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch

from workers.attention import PREFIX_KWARG, dense_attention
from workers.budget import plan_budget
from workers.methods.base import mid_range
from workers.methods.memory import MemorySource
from workers.methods.phi import PhiSummarizer
from workers.methods.phi_maps import FeatureMap
from workers.methods.registry import METHODS, get_method
from workers.requests import DecodeConfig

METHODS_SHOWN = ["topk", "topk+phi", "quest", "quest+phi", "doublep", "doublep+phi"]


def synth(n: int, d: int, hkv: int, g: int, nq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Planted K, V ``[Hkv, n, d]`` and queries ``[1, Hkv*g, nq, d]``.

    Keys: topic segments (mean length 128) around per-topic centers, plus 4 sink keys along a
    shared direction. Values: a per-head mean, a per-topic component and noise. Queries: a random
    mix of a sink component and a target (a single mid token, or a topic center) scaled by a
    per-KV-head sharpness spread log-uniformly over [0.3, 3] (so H_mid covers ~[0, 1]).
    """
    gen = torch.Generator().manual_seed(seed)
    n_topics = max(2, n // 128)
    cuts = torch.sort(torch.randperm(n - 1, generator=gen)[: n_topics - 1] + 1).values
    topic = torch.zeros(n, dtype=torch.long)
    topic[cuts] = 1
    topic = topic.cumsum(0)
    centers = torch.randn(hkv, n_topics, d, generator=gen)
    k = centers[:, topic] * 0.8 + torch.randn(hkv, n, d, generator=gen) * 0.6
    sink_dir = torch.nn.functional.normalize(torch.randn(hkv, d, generator=gen), dim=-1)
    k[:, :4] = sink_dir[:, None] * math.sqrt(d) * 1.5
    v = (torch.randn(hkv, 1, d, generator=gen) + 0.5 * torch.randn(hkv, n_topics, d, generator=gen)[:, topic]
         + torch.randn(hkv, n, d, generator=gen))
    sharp = torch.logspace(math.log10(0.3), math.log10(3.0), hkv)
    q = torch.empty(1, hkv * g, nq, d)
    for h in range(hkv * g):
        kv_h = h // g
        for j in range(nq):
            if torch.rand((), generator=gen) < 0.5:
                target = k[kv_h, int(torch.randint(4, n - 16, (), generator=gen))]
            else:
                target = centers[kv_h, int(torch.randint(n_topics, (), generator=gen))]
            jitter = float(torch.empty(()).uniform_(0.5, 2.0, generator=gen))
            sink = float(torch.empty(()).uniform_(0.0, 1.0, generator=gen))
            q[0, h, j] = sharp[kv_h] * jitter * target / target.norm() * math.sqrt(d)
            q[0, h, j] += sink * sink_dir[kv_h] * math.sqrt(d) + 0.3 * torch.randn(d, generator=gen)
    return k, v, q


def mid_entropy(q: torch.Tensor, k: torch.Tensor, scale: float, lo: int, hi: int) -> torch.Tensor:
    """H_mid per (query head, query): normalized entropy of full attention restricted to the mid region."""
    g = q.shape[1] // k.shape[0]
    logits = torch.einsum("hqd,hnd->hqn", q[0].double(), k.repeat_interleave(g, 0)[:, lo:hi].double()) * scale
    p = torch.softmax(logits, -1)
    return -(p * p.clamp_min(1e-300).log()).sum(-1) / math.log(hi - lo)


def rel_l1(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Eq. 53 per row: ``|y - y_full|_1 / (|y_full|_1 + eps)``."""
    return (out - ref).abs().sum(-1) / (ref.abs().sum(-1) + 1e-6)


def variants(f: float) -> list[tuple[str, str, DecodeConfig]]:
    """(label, method, config) rows of one budget."""
    rows = [(m, m, DecodeConfig(budget=f)) for m in METHODS_SHOWN]
    rows.append(("topk+phi, L_gen=1e9 (same k as topk)", "topk+phi", DecodeConfig(budget=f, gen_len=10**9)))
    return rows


@dataclass
class Case:
    """One prefix: K/V per layer ``[Hkv, N, D]`` and its decode queries per layer ``[1, Hq, L, D]``."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    q: list[torch.Tensor]
    scale: float


def synthetic_cases(args: argparse.Namespace) -> list[Case]:
    k, v, q = synth(args.n, args.head_dim, args.kv_heads, args.group, args.queries, args.seed)
    return [Case([(k, v)], [q], args.head_dim ** -0.5)]


class _Recorder:
    """A PrefixAttention that keeps each layer's queries and attends exactly."""

    def __init__(self, kv: list[tuple[torch.Tensor, torch.Tensor]]):
        self.kv, self.q, self.scale = kv, {}, 1.0

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        self.q[layer], self.scale = q.float().clone(), scale
        k, v = self.kv[layer]
        return dense_attention(q, k[None], v[None], scale)


@torch.inference_mode()
def model_cases(args: argparse.Namespace) -> tuple[list[Case], FeatureMap | None]:
    """Capture q/K/V from ``args.model`` over synthetic-suite documents of ~``args.n`` tokens; also
    the φ map to complete with (the model's distilled one, unless ``--phi-map favor``)."""
    from transformers import DynamicCache

    from lab.synth import SynthContext, generate
    from workers.model import load_model
    from workers.prefill import prefill_kv

    lm = load_model(args.model, dtype="float32", progress=False)
    ctx = SynthContext(tokenizer=lm.tokenizer, split="eval")
    cases = []
    for i in range(args.samples):
        sample = generate(args.tasks[i % len(args.tasks)], args.n, args.seed + i, ctx)
        ids = list(lm.tokenizer(sample.document).input_ids)
        q_ids = list(lm.tokenizer(lm.prompt.format_query(sample.query), add_special_tokens=False).input_ids)
        kv = [(k.float(), v.float()) for _, k, v in prefill_kv(lm, ids, progress=False)]
        rec = _Recorder(kv)
        pos = torch.arange(len(ids), len(ids) + len(q_ids))[None]
        cache = DynamicCache(config=lm.model.config)
        lm.model(input_ids=torch.tensor([q_ids]), position_ids=pos, past_key_values=cache, use_cache=True,
                 logits_to_keep=1, **{PREFIX_KWARG: rec})
        last = slice(-args.queries, None)
        cases.append(Case(kv, [rec.q[layer][:, :, last] for layer in range(len(kv))], rec.scale))
    return cases, lm.phi_map if args.phi_map == "model" else None


def measure(src: MemorySource, name: str, cfg: DecodeConfig, case: Case,
            fmap: FeatureMap | None = None) -> tuple[list[torch.Tensor], dict]:
    """Each query token is one decode step over every layer; (out per layer, per-step reads per KV head)."""
    attn = get_method(name, fmap).open(src, cfg)
    steps = [[attn.attend(layer, q[:, :, j:j + 1], case.scale)[0] for layer, q in enumerate(case.q)]
             for j in range(case.q[0].shape[2])]
    rep = attn.read_report()
    units = src.layout.n_kv_heads * src.layout.n_layers
    return [torch.cat([s[layer] for s in steps], dim=2) for layer in range(len(case.q))], {
        "k": rep.extra.get("budget_k", float("nan")),
        "exact": rep.extra["exact_tokens_per_step"] / units,
        "pseudo": rep.extra["pseudo_entries_per_step"] / (case.q[0].shape[1] * src.layout.n_layers),
        "once": rep.once_bytes / src.layout.token_kv_bytes() / units,
    }


def run(args: argparse.Namespace) -> tuple[list[str], dict]:
    cases, fmap = model_cases(args) if args.model else (synthetic_cases(args), None)
    n, d = cases[0].kv[0][0].shape[1], cases[0].kv[0][0].shape[2]
    lo, hi = mid_range(n, 4, 16)
    refs = [[dense_attention(q, k[None], v[None], c.scale)[0] for q, (k, v) in zip(c.q, c.kv)] for c in cases]
    ent = torch.cat([mid_entropy(q, k, c.scale, lo, hi).flatten() for c in cases for q, (k, _) in zip(c.q, c.kv)])
    edges = torch.quantile(ent, torch.tensor([0.25, 0.5, 0.75], dtype=ent.dtype))
    quart = torch.bucketize(ent, edges)
    t0 = time.perf_counter()
    classes = {s for m in METHODS_SHOWN for s in METHODS[m].summarizers}
    summarizers = [PhiSummarizer(fmap) if s is PhiSummarizer else s for s in classes]
    sources = [MemorySource.build(c.kv, summarizers) for c in cases]
    prefill_s = time.perf_counter() - t0
    rows, results = [], {}
    jobs = [(f, *c) for f in args.budgets for c in variants(f)]
    jobs.append((None, "doublep, top-p (0.95, 0.7), no budget", "doublep", DecodeConfig()))
    for f, label, name, cfg in jobs:
        errs, counts = [], []
        for case, src, ref in zip(cases, sources, refs):
            outs, c = measure(src, name, cfg, case, fmap)
            errs += [rel_l1(o, r).flatten() for o, r in zip(outs, ref)]
            counts.append(c)
        err = torch.cat(errs)
        c = {key: sum(x[key] for x in counts) / len(counts) for key in counts[0]}
        per_q = [float(err[quart == i].mean()) for i in range(4)]
        results[(f, label)] = (float(err.mean()), per_q)
        feasible = f is None or not name.endswith("+phi") or cfg.gen_len > 1 or plan_budget(
            prefill_len=n, fraction=f, head_dim=d, phi_dim=fmap.phi_dim if fmap else d).hybrid_feasible
        rows.append(f"| {'-' if f is None else f'{f:.0%}'} | {label}{'' if feasible else ' (infeasible)'} | "
                    f"{c['k']:.0f} | {float(err.mean()):.3f} | " + " | ".join(f"{e:.3f}" for e in per_q)
                    + f" | {c['exact']:.0f} | {c['pseudo']:.0f} | {c['once']:.0f} |")
    kv0 = cases[0].kv[0][0]
    used = [args.tasks[i % len(args.tasks)] for i in range(len(cases))]
    source = (f"model {args.model}, {len(cases)} documents ({', '.join(used)}, seeds from {args.seed})" if args.model
              else f"planted data, seed {args.seed}")
    phi = f"distilled phi map, d_phi={fmap.phi_dim}" if fmap else f"FAVOR+ phi, d_phi={d}"
    header = [f"{source}; N={n}, d_h={d}, {phi}, {len(cases[0].kv)} layers x {kv0.shape[0]} KV heads x "
              f"G={cases[0].q[0].shape[1] // kv0.shape[0]}, {cases[0].q[0].shape[2]} decode steps "
              f"({len(ent)} rows); H_mid quartile edges {', '.join(f'{x:.2f}' for x in edges.tolist())}; "
              f"summaries built in {prefill_s:.1f} s",
              "",
              "| f | method | k | rel. L1 all | Q1 (low H_mid) | Q2 | Q3 | Q4 (high H_mid) | exact reads/step "
              "| pseudo-entries/step | one-time reads |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    return header + rows, results


def gain_lines(results: dict, budgets: list[float]) -> list[str]:
    """Gain = e_sel - e_hyb per quartile (positive: φ completion helps at matched reads)."""
    lines = ["", "| f | selector | gain all | gain Q1 | Q2 | Q3 | Q4 |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for f in budgets:
        for sel in ("topk", "quest", "doublep"):
            a, qa = results[(f, sel)]
            b, qb = results[(f, sel + "+phi")]
            lines.append(f"| {f:.0%} | {sel} | {a - b:+.3f} | " + " | ".join(f"{x - y:+.3f}" for x, y in zip(qa, qb))
                         + " |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--queries", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="capture q/K/V from this model (hub id or path) instead of planted data")
    p.add_argument("--samples", type=int, default=2, help="documents to capture (with --model)")
    p.add_argument("--phi-map", choices=("model", "favor"), default="model",
                   help="with --model: its distilled phi map when it ships one (model), or FAVOR+ (favor)")
    p.add_argument("--tasks", type=lambda s: s.split(","), default=["niah_multikey", "fwe"],
                   help="synthetic tasks the documents come from (with --model)")
    p.add_argument("--budgets", type=lambda s: [float(x) for x in s.split(",")], default=[0.01, 0.02, 0.03, 0.04, 0.05])
    args = p.parse_args()
    torch.manual_seed(args.seed)
    lines, results = run(args)
    print("\n".join(lines + gain_lines(results, args.budgets)))


if __name__ == "__main__":
    main()
