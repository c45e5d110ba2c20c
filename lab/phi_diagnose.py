"""Why does φ completion lower Top-K's attention error but not its accuracy? (issue 14)

For each synthetic-suite sample (same seeds as ``kvstash eval``: ``EVAL_SEED_BASE + i``), on the CPU in float32:

1. prefill the document (``workers.prefill.prefill_kv``) and keep K/V in a ``MemorySource`` with the product's
   summaries (the φ cache is built with the model's shipped map);
2. answer greedily with ``full``, ``topk`` and ``topk+phi`` (and any ``--fix`` variants of ``topk+phi``), the
   product's method objects (``get_method(...).open``) attending the prefix for every query and answer token,
   and score the answers with the task's scorer;
3. teacher-force the query and *full's* answer through ``topk+phi`` and ``topk`` and, at every layer, KV head,
   query head and token of the query/answer, compare against full attention over the same query vector:

   - ``lzR``: the true remainder mass ``log Σ_{i∈R} exp(s_i)`` over the mid tokens the step did not read
     (R = mid \\ K) against φ's estimate ``log Ẑ_R`` (``d_mass = log Ẑ_R - lzR``, nats);
   - ``pR``: the remainder's share of the prefix's attention, true ``Z_R / (Z_R + Z_E)`` and φ's
     ``Ẑ_R / (Ẑ_R + Z_E)`` (E: every exact entry, anchors included);
   - rel. L1 errors (eq. 53) of the prefix outputs: ``exact`` (the same entries without φ), ``phi`` (the product's
     combination), ``phi|true mass`` (φ's value, true mass) and ``phi|true value`` (φ's mass, true mean value);
     and the product's own ``topk`` output at its own (larger) k;
   - ``v_err``: ``||N̂_R/Ẑ_R - v̄_R|| / ||v̄_R||`` (φ's remainder mean against the true one);
   - rows are bucketed by how peaked full attention is over the mid region (max weight of one mid token).

Candidate corrections (``--fix``, this script only; the product is unchanged): ``shift:X`` adds X nats to
``log Ẑ_R``; ``cap:P`` caps φ's share of the prefix attention at P; ``gate:X`` drops φ in rows where
``log Ẑ_R - max exact logit`` exceeds X (φ claims more than e^X times the best read token's weight).

    OMP_NUM_THREADS=1 python -m lab.phi_diagnose --task fwe --length 8192 --samples 1,7 --budget 0.01 \\
        --fix shift:-1 --fix cap:0.5
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.attention import PREFIX_KWARG, dense_attention
from workers.methods.memory import MemorySource
from workers.methods.registry import METHODS, get_method
from workers.requests import DecodeConfig

PEAK_EDGES = (0.1, 0.5)
"""Buckets of full attention's largest single mid-token weight: diffuse < 0.1 <= mixed < 0.5 <= peaked."""
BUCKETS = ("diffuse", "mixed", "peaked")


def parse_fix(spec: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``shift:X`` / ``cap:P`` / ``gate:X`` -> ``f(log_z, lz_exact, max_exact_logit) -> log_z``."""
    kind, _, val = spec.partition(":")
    x = float(val)
    if kind == "shift":
        return lambda lz, le, mx: lz + x
    if kind == "cap":  # share p = σ(lz - le) <= x  <=>  lz <= le + logit(x)
        if not 0 < x <= 1:
            raise ValueError(f"cap takes a share in (0, 1], got {x}")
        cap = math.inf if x == 1 else math.log(x / (1 - x))
        return lambda lz, le, mx: torch.minimum(lz, le + cap)
    if kind == "gate":
        return lambda lz, le, mx: lz.masked_fill(lz - mx > x, float("-inf"))
    raise ValueError(f"unknown fix {spec!r} (shift:X, cap:P, gate:X)")


def rel_l1(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Eq. 53 per row."""
    return (out - ref).abs().sum(-1) / (ref.abs().sum(-1) + 1e-6)


@dataclass
class Rows:
    """Per-row diagnostics, appended as flat tensors; keys of ``cols``."""

    cols: dict[str, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))

    def add(self, **kw: torch.Tensor) -> None:
        for k, v in kw.items():
            self.cols[k].append(v.reshape(-1).double())

    def cat(self) -> dict[str, torch.Tensor]:
        return {k: torch.cat(v) for k, v in self.cols.items()}


class PhiProbe:
    """Wraps a ``topk+phi`` generation's ``completion.term``: records the remainder diagnostics against the true
    prefix (``kv``) and optionally rewrites φ's logit (``fix``)."""

    def __init__(self, attn: Any, kv: list[tuple[torch.Tensor, torch.Tensor]], record: Rows | None,
                 fix: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None):
        self.kv, self.record, self.fix = kv, record, fix
        comp = attn.completion
        inner = comp.term

        def term(layer: int, ctx: Any, q: torch.Tensor, scale: float, k_sel: torch.Tensor, v_sel: torch.Tensor,
                 counts: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
            log_z, mean = inner(layer, ctx, q, scale, k_sel, v_sel, counts, **kw)
            if self.record is None and self.fix is None:
                return log_z, mean
            return self._probe(layer, ctx, q, scale, counts, kw, log_z, mean)

        comp.term = term

    def _probe(self, layer: int, ctx: Any, q: torch.Tensor, scale: float, counts: torch.Tensor, kw: dict,
               log_z: torch.Tensor, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.kv[layer]  # [Hkv, N, D]
        t, hkv, g, _ = q.shape
        n = k.shape[1]
        s = torch.einsum("thgd,hnd->thgn", q.double(), k.double()) * scale  # [T, Hkv, G, N]
        tokens, valid = kw["tokens"], kw.get("valid")
        if valid is None:
            valid = torch.arange(tokens.shape[-1]) < counts.unsqueeze(-1)
        picked = torch.zeros(t, hkv, n + 1, dtype=torch.bool)
        ids = torch.where(valid.bool(), tokens.long().clamp(0, n - 1), n)
        picked.scatter_(-1, ids, True)
        picked = picked[..., :n]
        mid = torch.zeros(n, dtype=torch.bool)
        mid[ctx.lo:ctx.hi] = True
        rem = (mid & ~picked).unsqueeze(2)  # [T, Hkv, 1, N]
        neg = torch.tensor(float("-inf"), dtype=s.dtype)
        lz_r = torch.logsumexp(torch.where(rem, s, neg), -1)
        lz_e = torch.logsumexp(torch.where(rem, neg, s), -1)
        mx_e = torch.where(rem, neg, s).amax(-1)
        lz_full = torch.logsumexp(s, -1)
        vv = v.double().unsqueeze(0)  # [1, Hkv, N, D]
        p_r = torch.softmax(torch.where(rem, s, neg), -1).nan_to_num(0.0)
        v_r = torch.einsum("thgn,thnd->thgd", p_r, vv.expand(t, -1, -1, -1))
        p_e = torch.softmax(torch.where(rem, neg, s), -1)
        o_e = torch.einsum("thgn,thnd->thgd", p_e, vv.expand(t, -1, -1, -1))
        o_full = torch.einsum("thgn,thnd->thgd", torch.softmax(s, -1), vv.expand(t, -1, -1, -1))
        lz = log_z.double()

        def mix(lz_x: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
            w = torch.sigmoid(lz_x - lz_e).nan_to_num(0.0).unsqueeze(-1)  # share of the pseudo-entry
            return (1 - w) * o_e + w * val

        new = self.fix(lz, lz_e, mx_e) if self.fix is not None else lz
        if self.record is not None:
            pm = torch.softmax(s, -1)[..., ctx.lo:ctx.hi].amax(-1)
            top = torch.softmax(s, -1).argmax(-1)  # the token full attends most
            top_read = ~rem.squeeze(2).gather(-1, top.view(t, hkv, g)).bool()
            w_top_full = torch.softmax(s, -1).amax(-1)
            w_top_phi = torch.where(top_read, torch.exp(s.amax(-1) - torch.logaddexp(lz_e, new)), 0.0)
            w_top_exact = torch.where(top_read, torch.exp(s.amax(-1) - lz_e), 0.0)
            md = mean.double()
            self.record.add(
                layer=torch.full_like(lz, layer), head=torch.arange(hkv * g, dtype=torch.float64).view(1, hkv, g)
                .expand(t, -1, -1), lzR=lz_r, lz_est=lz, lz_e=lz_e, lz_full=lz_full, peak=pm,
                pR=torch.sigmoid(lz_r - lz_e), pR_est=torch.sigmoid(lz - lz_e), pR_fix=torch.sigmoid(new - lz_e),
                err_exact=rel_l1(o_e, o_full), err_phi=rel_l1(mix(lz, md), o_full),
                err_true_mass=rel_l1(mix(lz_r, md), o_full), err_true_value=rel_l1(mix(lz, v_r), o_full),
                err_fix=rel_l1(mix(new, md), o_full),
                v_err=(md - v_r).norm(dim=-1) / v_r.norm(dim=-1).clamp_min(1e-9),
                v_cos=torch.nn.functional.cosine_similarity(md - o_e, v_r - o_e, dim=-1),
                w_top_full=w_top_full, w_top_phi=w_top_phi, w_top_exact=w_top_exact, top_read=top_read.double(),
            )
        return new.to(log_z.dtype), mean


class Outputs:
    """PrefixAttention wrapper: records the prefix output per layer next to full attention's."""

    def __init__(self, attn: Any, kv: list[tuple[torch.Tensor, torch.Tensor]], record: Rows | None):
        self.attn, self.kv, self.record = attn, kv, record

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = self.attn.attend(layer, q, scale)
        if self.record is not None:
            k, v = self.kv[layer]
            ref, _ = dense_attention(q, k[None], v[None], scale)
            self.record.add(err=rel_l1(out.float(), ref.float()))
        return out, lse

    def __getattr__(self, name: str) -> Any:
        return getattr(self.attn, name)


class Dense:
    """Full attention over the prefix."""

    def __init__(self, kv: list[tuple[torch.Tensor, torch.Tensor]]):
        self.kv = kv

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.kv[layer]
        return dense_attention(q, k[None], v[None], scale)


@torch.inference_mode()
def decode(lm: Any, prefix: Any, n_prefix: int, q_ids: list[int], *, max_new: int,
           forced: list[int] | None = None) -> list[int]:
    """Greedy answer (or teacher-forced ``forced``) with ``prefix`` attending the stored prefix."""
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.model.config)
    ids, pos, out = list(q_ids), n_prefix, []
    eos = lm.eos_ids
    steps = len(forced) if forced is not None else max_new
    for i in range(steps + 1):
        logits = lm.model(input_ids=torch.tensor([ids]), position_ids=torch.arange(pos, pos + len(ids))[None],
                          past_key_values=cache, use_cache=True, logits_to_keep=1, **{PREFIX_KWARG: prefix}).logits
        pos += len(ids)
        if i == steps:
            break
        nxt = forced[i] if forced is not None else int(logits[0, -1].argmax())
        if forced is None and nxt in eos:
            break
        out.append(nxt)
        ids = [nxt]
    return out


def summarize(rows: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Means (medians for log ratios) per peak bucket and overall."""
    b = torch.bucketize(rows["peak"], torch.tensor(PEAK_EDGES, dtype=torch.float64))
    res: dict[str, Any] = {}
    for name, sel in [("all", torch.ones_like(b, dtype=torch.bool))] + [(n, b == i) for i, n in enumerate(BUCKETS)]:
        if not sel.any():
            continue
        r = {k: x[sel] for k, x in rows.items()}
        d = r["lz_est"] - r["lzR"]
        fin = torch.isfinite(d)
        res[name] = {
            "rows": int(sel.sum()),
            "d_mass_median": float(d[fin].median()) if fin.any() else float("nan"),
            "d_mass_mean": float(d[fin].mean()) if fin.any() else float("nan"),
            "over_e1": float((d[fin] > 1).double().mean()) if fin.any() else float("nan"),
            **{k: float(r[k].nan_to_num(0.0).mean()) for k in
               ("pR", "pR_est", "pR_fix", "err_exact", "err_phi", "err_true_mass", "err_true_value", "err_fix",
                "v_err", "v_cos", "w_top_full", "w_top_exact", "w_top_phi", "top_read")},
        }
    return res


def per_head(rows: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Per (layer, query head): mean peak, pR, pR_est, median d_mass, errors."""
    out = []
    for layer in sorted(set(rows["layer"].long().tolist())):
        for head in sorted(set(rows["head"].long().tolist())):
            sel = (rows["layer"] == layer) & (rows["head"] == head)
            d = rows["lz_est"][sel] - rows["lzR"][sel]
            d = d[torch.isfinite(d)]
            out.append({"layer": layer, "head": head, "peak": float(rows["peak"][sel].mean()),
                        "pR": float(rows["pR"][sel].mean()), "pR_est": float(rows["pR_est"][sel].mean()),
                        "d_mass_median": float(d.median()) if d.numel() else float("nan"),
                        "err_exact": float(rows["err_exact"][sel].mean()),
                        "err_phi": float(rows["err_phi"][sel].mean()),
                        "w_top_full": float(rows["w_top_full"][sel].mean()),
                        "w_top_phi": float(rows["w_top_phi"][sel].mean())})
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lab.eval.accuracy import EVAL_SEED_BASE
    from lab.synth import SynthContext, generate
    from workers.methods.phi import PhiSummarizer
    from workers.model import load_model
    from workers.prefill import prefill_kv

    lm = load_model(args.model, dtype="float32", progress=False)
    fmap = lm.phi_map
    ctx = SynthContext(tokenizer=lm.tokenizer, split="eval")
    fixes = {spec: parse_fix(spec) for spec in args.fix}
    classes = {s for m in ("topk", "topk+phi") for s in METHODS[m].summarizers}
    summarizers = [PhiSummarizer(fmap) if s is PhiSummarizer else s for s in classes]
    result: dict[str, Any] = {"args": vars(args), "samples": []}
    all_rows, topk_err = Rows(), Rows()
    for i in args.samples:
        t0 = time.perf_counter()
        sample = generate(args.task, args.length, EVAL_SEED_BASE + i, ctx)
        ids = list(lm.tokenizer(sample.document).input_ids)
        q_ids = list(lm.tokenizer(lm.prompt.format_query(sample.query), add_special_tokens=False).input_ids)
        kv = [(k.float(), v.float()) for _, k, v in prefill_kv(lm, ids, progress=False)]
        src = MemorySource.build(kv, summarizers)
        cfg = DecodeConfig(budget=args.budget, gen_len=args.gen_len)

        def opened(name: str, source: MemorySource = src, config: DecodeConfig = cfg) -> Any:
            return get_method(name, fmap).open(source, config)

        answers: dict[str, Any] = {}
        full_ans = decode(lm, Dense(kv), len(ids), q_ids, max_new=args.max_new_tokens)
        answers["full"] = full_ans
        answers["topk"] = decode(lm, opened("topk"), len(ids), q_ids, max_new=args.max_new_tokens)
        answers["topk+phi"] = decode(lm, opened("topk+phi"), len(ids), q_ids, max_new=args.max_new_tokens)
        for spec, f in fixes.items():
            a = opened("topk+phi")
            PhiProbe(a, kv, None, f)
            answers[f"topk+phi {spec}"] = decode(lm, a, len(ids), q_ids, max_new=args.max_new_tokens)
        texts = {m: str(lm.tokenizer.decode(a)) for m, a in answers.items()}
        scored = {m: {"text": t, "score": sample.score(t)} for m, t in texts.items()}
        # teacher-forced diagnostics on full's answer
        rows = Rows()
        a = opened("topk+phi")
        PhiProbe(a, kv, rows, fixes[args.fix[0]] if args.fix else None)
        decode(lm, a, len(ids), q_ids, max_new=0, forced=full_ans)
        te = Rows()
        decode(lm, Outputs(opened("topk"), kv, te), len(ids), q_ids, max_new=0, forced=full_ans)
        r = rows.cat()
        for k, x in r.items():
            all_rows.cols[k].append(x)
        topk_err.cols["err"].append(te.cat()["err"])
        result["samples"].append({"index": i, "answers": sample.answers, "scored": scored,
                                  "summary": summarize(r), "topk_err_own_k": float(te.cat()["err"].mean()),
                                  "seconds": round(time.perf_counter() - t0, 1)})
        print(json.dumps({"index": i, "scores": {m: s["score"] for m, s in scored.items()},
                          "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    rows_all = all_rows.cat()
    result["summary"] = summarize(rows_all)
    result["topk_err_own_k"] = float(topk_err.cat()["err"].mean())
    result["per_head"] = per_head(rows_all)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/kvstash-tiny")
    p.add_argument("--task", default="fwe")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--samples", type=lambda s: [int(x) for x in s.split(",")], default=[0],
                   help="eval sample indices (seed EVAL_SEED_BASE + i), comma-separated")
    p.add_argument("--budget", type=float, default=0.01)
    p.add_argument("--gen-len", type=int, default=1, help="L_gen of the budget (kvstash eval uses 1)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--fix", action="append", default=[],
                   help="candidate correction of φ's logit, repeatable: shift:X, cap:P, gate:X (the first one is "
                        "also measured at the attention level)")
    p.add_argument("--output", help="write the JSON result here")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    res = run(args)
    text = json.dumps(res, indent=1)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    print(json.dumps({"summary": res["summary"], "topk_err_own_k": res["topk_err_own_k"]}, indent=1))


if __name__ == "__main__":
    main()
