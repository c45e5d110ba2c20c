"""Why does Double-P lose variable tracking? (issue 14) Double-P's selection against dense attention, per row.

For each synthetic-suite sample (same seeds as ``kvstash eval``), on the CPU in float32:

1. prefill the document (``workers.prefill.prefill_kv``), build the product's ``clusters`` artifact
   (``ClusterSummarizer``, optionally with ``--cluster-size`` / ``--iters`` / ``--init`` changed on the instance;
   ``--init random`` is the seeding before summary version 3)
   and serve it from a ``MemorySource``;
2. answer greedily with dense attention and with the product's ``doublep`` (``get_method("doublep").open``) at
   each ``--budget`` (``none``: the paper's p1/p2 only), and score the answers;
3. teacher-force the query and *full's* answer through each ``doublep`` and, at every layer, KV head, query head
   and query/answer token, split the dense attention over the prefix by what the step did with each token:
   ``anchor`` (sink/tail), ``exact`` (stage 2), ``approx`` (stage 1 kept, entered through its centroid),
   ``drop`` (past p1). The *needle* tokens are the chain statements' tokens (``VAR x = ...``); ``needle_*`` is the
   dense mass of the needle tokens in each class, over rows where the needles hold at least ``--needle-row`` of
   the row's dense attention. Output errors (rel. L1, eq. 53, float64, against dense):

   - ``err_dp``: the step as the product computes it (exact tokens + anchors + centroids ``log s + q·C``, ``V̄``);
   - ``err_nodrop``: every stage-1 cluster attended exactly, dropped ones left out (the error of the drop alone);
   - ``err_exactonly``: exact tokens + anchors, no centroid entries;
   - ``err_truemass``: the centroids with their true mass ``log Σ exp(s)``, value ``V̄``;
   - ``err_truevalue``: the centroids' estimated mass, their true attention-weighted mean value;
   - ``share_approx`` / ``share_approx_est``: the approximated clusters' share of the step's softmax, true and as
     estimated; ``share_drop``: the dropped clusters' true share of the prefix.

   For each needle-holding row, ``needle_rank`` is the stage-1 rank of the cluster holding the needle token full
   attends most, with the row's stage-1 and stage-2 cut-offs, and ``needle_cluster_size``.

    OMP_NUM_THREADS=1 python -m lab.doublep_probe --task vt --length 4096 --samples 1,3 --budget 0.02 \\
        --budget none --output probe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from collections import defaultdict
from typing import Any

import torch

from lab.phi_diagnose import Dense, Rows, decode, rel_l1
from workers.attention import PREFIX_KWARG
from workers.methods.doublep import ClusterSummarizer, DoublePSelector
from workers.methods.memory import MemorySource
from workers.methods.registry import get_method
from workers.methods.sparse import SparsePrefixAttention
from workers.requests import DecodeConfig

NEEDLE = re.compile(r"VAR [^.]*\.")


def needle_positions(lm: Any, document: str, ids: list[int]) -> torch.Tensor:
    """Token ids of the document whose characters overlap a chain statement (``VAR ... .``)."""
    enc = lm.tokenizer(document, return_offsets_mapping=True)
    if list(enc.input_ids) != ids:
        raise ValueError("offsets tokenization differs from the prefill's")
    spans = [m.span() for m in NEEDLE.finditer(document)]
    out = [i for i, (a, b) in enumerate(enc.offset_mapping) if b > a and any(a < e and b > s for s, e in spans)]
    return torch.tensor(out, dtype=torch.long)


class SelectProbe:
    """Wraps a ``DoublePSelector.select``: records each step's row diagnostics against dense attention."""

    def __init__(self, sel: DoublePSelector, kv: list[tuple[torch.Tensor, torch.Tensor]], needles: torch.Tensor,
                 record: Rows, needle_row: float):
        self.sel, self.kv, self.record, self.needle_row = sel, kv, record, needle_row
        self.needles = needles
        self.calls: dict[int, int] = defaultdict(int)
        """Per layer, select calls so far (call 0: the query's forward; call i: answer token i - 1 fed)."""
        inner = sel.select

        def select(layer: int, ctx: Any, q: torch.Tensor, scale: float, k: int | None) -> Any:
            out = inner(layer, ctx, q, scale, k)
            self._probe(layer, ctx, q, scale, out)
            return out

        sel.select = select  # type: ignore[method-assign]

    def _probe(self, layer: int, ctx: Any, q: torch.Tensor, scale: float, out: Any) -> None:
        cl = self.sel._layers[layer]
        k, v = (x.double() for x in self.kv[layer])  # [Hkv, N, D]
        t, hkv, g, _ = q.shape
        n, c = k.shape[1], cl.centroids.shape[1]
        s = torch.einsum("thgd,hnd->thgn", q.double(), k) * scale  # [T, Hkv, G, N]
        neg = torch.tensor(float("-inf"), dtype=torch.float64)
        # token -> cluster (mid tokens of this request; -1 elsewhere)
        labels = torch.full((hkv, n), -1, dtype=torch.long)
        pos_label = torch.repeat_interleave(torch.arange(c).expand(hkv, -1).reshape(-1), cl.sizes.reshape(-1))
        labels.scatter_(1, cl.perm.long(), pos_label.view(hkv, -1))
        exact = torch.zeros(t, hkv, n + 1, dtype=torch.bool)
        valid = torch.arange(out.tokens.shape[-1]) < out.counts.unsqueeze(-1)
        exact.scatter_(-1, torch.where(valid, out.tokens.long(), n), True)
        exact = exact[..., :n]
        capprox = torch.zeros(t, hkv, c + 1, dtype=torch.bool)
        cvalid = torch.arange(out.centroids.shape[-1]) < out.n_centroids.unsqueeze(-1)
        capprox.scatter_(-1, torch.where(cvalid, out.centroids.long(), c), True)
        capprox = capprox[..., :c]
        mid = labels >= 0  # [Hkv, N]
        approx = capprox.gather(2, labels.clamp_min(0).expand(t, -1, -1)) & mid & ~exact
        anchor = ~mid.expand(t, -1, -1)
        drop = mid & ~exact & ~approx
        p = torch.softmax(s, -1)
        o_full = torch.einsum("thgn,hnd->thgd", p, v)
        needle = torch.zeros(n, dtype=torch.bool)
        needle[self.needles] = True

        def mass(m: torch.Tensor) -> torch.Tensor:
            return (p * m.unsqueeze(2)).sum(-1)

        # the product's step in float64: exact logits of anchors + exact, centroid entries of approx clusters
        keep = (exact | anchor).unsqueeze(2)
        lc = torch.einsum("thgd,hcd->thgc", q.double(), cl.centroids.double()) * scale + cl.log_sizes.double()[:, None]
        lc = torch.where(capprox.unsqueeze(2), lc, neg)
        vbar = cl.vbar.double()
        # true per-cluster mass and value of the approximated clusters
        lab = labels.clamp_min(0)
        se = torch.where(approx.unsqueeze(2), s, neg)
        onehot = torch.nn.functional.one_hot(lab, c).double() * mid.unsqueeze(-1)  # [Hkv, N, C]
        mx = se.amax(-1, keepdim=True).clamp_min(-1e30)
        w = torch.exp(se - mx)  # [T, Hkv, G, N]
        zc = torch.einsum("thgn,hnc->thgc", w, onehot)
        lz_true = torch.where(zc > 0, zc.log() + mx, neg)

        def combine(l_cent: torch.Tensor, true_value: bool = False) -> torch.Tensor:
            """Softmax over anchors + exact tokens and the centroid entries ``l_cent``; their value ``V̄`` or (
            ``true_value``) each approximated cluster's attention-weighted mean value."""
            pw = torch.softmax(torch.cat([torch.where(keep, s, neg), l_cent], -1), -1)
            o = torch.einsum("thgn,hnd->thgd", pw[..., :n], v)
            if not true_value:
                return o + torch.einsum("thgc,hcd->thgd", pw[..., n:], vbar)
            coef = (pw[..., n:] / zc.clamp_min(1e-300)).gather(-1, lab.unsqueeze(0).unsqueeze(2).expand(t, -1, g, -1))
            return o + torch.einsum("thgn,hnd->thgd", torch.where(approx.unsqueeze(2), coef * w, 0.0), v)

        o_dp = combine(lc)
        kept = keep | approx.unsqueeze(2)
        o_nodrop = torch.einsum("thgn,hnd->thgd", torch.softmax(torch.where(kept, s, neg), -1), v)
        o_exact = torch.einsum("thgn,hnd->thgd", torch.softmax(torch.where(keep, s, neg), -1), v)
        o_tm = combine(torch.where(capprox.unsqueeze(2), lz_true, neg))
        o_tv = combine(lc, true_value=True)
        lz_keep = torch.logsumexp(torch.where(keep, s, neg), -1)
        lz_ap_est = torch.logsumexp(lc, -1)
        lz_ap_true = torch.logsumexp(torch.where(approx.unsqueeze(2), s, neg), -1)
        nmass = mass(needle & torch.ones_like(exact))
        # the needle token dense attention weights most, its cluster's stage-1 rank
        pn = torch.where(needle, p, 0.0)
        top_needle = pn.argmax(-1)  # [T, Hkv, G]
        top_lab = labels.unsqueeze(0).unsqueeze(2).expand(t, -1, g, -1).gather(-1, top_needle.unsqueeze(-1))[..., 0]
        lg = torch.einsum("thgd,hcd->thgc", q.double(), cl.centroids.double()) * scale + cl.log_sizes.double()[:, None]
        mass_c = torch.softmax(lg, -1).mean(2)  # [T, Hkv, C] group mean, as stage 1
        rank_of = torch.argsort(torch.argsort(-mass_c, dim=-1, stable=True), dim=-1)  # rank of each cluster
        nr = rank_of.unsqueeze(2).expand(-1, -1, g, -1).gather(-1, top_lab.clamp_min(0).unsqueeze(-1))[..., 0]
        n_exact_cl = torch.zeros(t, hkv, dtype=torch.long)
        for ti in range(t):
            for h in range(hkv):
                toks = out.tokens[ti, h, :int(out.counts[ti, h])].long()
                n_exact_cl[ti, h] = labels[h, toks].unique().numel() if toks.numel() else 0
        stage1 = n_exact_cl + out.n_centroids.long()
        top_cls = torch.where(top_lab >= 0, top_lab, 0)
        csize = cl.sizes[torch.arange(hkv)[None, :, None], top_cls]
        call = self.calls[layer]
        self.calls[layer] += 1
        self.record.add(
            layer=torch.full((t, hkv, g), float(layer)), call=torch.full((t, hkv, g), float(call)),
            head=torch.arange(hkv * g, dtype=torch.float64).view(1, hkv, g).expand(t, -1, -1),
            step=torch.arange(t, dtype=torch.float64)[:, None, None].expand(-1, hkv, g),
            m_anchor=mass(anchor), m_exact=mass(exact), m_approx=mass(approx), m_drop=mass(drop), m_needle=nmass,
            needle_exact=mass(needle & exact), needle_approx=mass(needle & approx), needle_drop=mass(needle & drop),
            err_dp=rel_l1(o_dp, o_full), err_nodrop=rel_l1(o_nodrop, o_full), err_exactonly=rel_l1(o_exact, o_full),
            err_truemass=rel_l1(o_tm, o_full), err_truevalue=rel_l1(o_tv, o_full),
            share_approx=torch.sigmoid(lz_ap_true - lz_keep).nan_to_num(0.0),
            share_approx_est=torch.sigmoid(lz_ap_est - lz_keep).nan_to_num(0.0),
            d_mass_approx=(lz_ap_est - lz_ap_true).nan_to_num(0.0, 0.0, 0.0),
            needle_rank=nr.double(), stage1=stage1[..., None].expand(-1, -1, g).double(),
            stage2=n_exact_cl[..., None].expand(-1, -1, g).double(), needle_cluster_size=csize.double(),
            exact_tokens=out.counts[..., None].expand(-1, -1, g).double())


KEYS = ("m_anchor", "m_exact", "m_approx", "m_drop", "m_needle", "needle_exact", "needle_approx", "needle_drop",
        "err_dp", "err_nodrop", "err_exactonly", "err_truemass", "err_truevalue", "share_approx", "share_approx_est",
        "d_mass_approx", "exact_tokens")


@torch.inference_mode()
def forced_logits(lm: Any, prefix: Any, n_prefix: int, q_ids: list[int], forced: list[int]) -> torch.Tensor:
    """Next-token log-probabilities ``[len(forced) + 1, V]`` with ``prefix`` attending the prefix, teacher-forcing
    ``forced`` after the query (row i: after the query and ``forced[:i]``)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.model.config)
    ids, pos, out = list(q_ids), n_prefix, []
    for i in range(len(forced) + 1):
        logits = lm.model(input_ids=torch.tensor([ids]), position_ids=torch.arange(pos, pos + len(ids))[None],
                          past_key_values=cache, use_cache=True, logits_to_keep=1, **{PREFIX_KWARG: prefix}).logits
        out.append(torch.log_softmax(logits[0, -1].double(), -1))
        pos += len(ids)
        if i < len(forced):
            ids = [forced[i]]
    return torch.stack(out)


def summarize(r: dict[str, torch.Tensor], needle_row: float) -> dict[str, Any]:
    """Means over all rows and over needle rows (dense needle mass >= ``needle_row``), plus per layer."""
    res: dict[str, Any] = {}
    nrow = r["m_needle"] >= needle_row
    for name, sel in (("all", torch.ones_like(nrow)), ("needle", nrow)):
        if not sel.any():
            continue
        res[name] = {"rows": int(sel.sum()), **{k: float(r[k][sel].mean()) for k in KEYS}}
    if nrow.any():
        rank, s1, s2 = r["needle_rank"][nrow], r["stage1"][nrow], r["stage2"][nrow]
        res["needle"].update({"needle_rank_median": float(rank.median()),
                              "needle_in_stage2": float((rank < s2).double().mean()),
                              "needle_in_stage1": float((rank < s1).double().mean()),
                              "stage1_median": float(s1.median()), "stage2_median": float(s2.median()),
                              "needle_cluster_size_mean": float(r["needle_cluster_size"][nrow].mean())})
    layers = []
    for layer in sorted(set(r["layer"].long().tolist())):
        sel = r["layer"] == layer
        sn = sel & nrow
        layers.append({"layer": layer, "rows": int(sel.sum()), "needle_rows": int(sn.sum()),
                       **{k: float(r[k][sel].mean()) for k in ("err_dp", "err_nodrop", "err_truemass", "m_drop",
                                                                "m_approx")},
                       **({f"needle_{k}": float(r[k][sn].mean()) for k in ("needle_exact", "needle_approx",
                                                                           "needle_drop", "err_dp", "err_nodrop")}
                          if sn.any() else {})})
    res["per_layer"] = layers
    return res


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lab.eval.accuracy import EVAL_SEED_BASE
    from lab.synth import SynthContext, generate
    from workers.model import load_model
    from workers.prefill import prefill_kv

    lm = load_model(args.model, dtype="float32", progress=False)
    ctx = SynthContext(tokenizer=lm.tokenizer, split="eval")
    summ = ClusterSummarizer()
    for attr in ("cluster_size", "iters", "init"):
        val = getattr(args, attr.replace("-", "_"))
        if val is not None:
            setattr(summ, attr, val)
    budgets = [None if b == "none" else float(b) for b in args.budget]
    result: dict[str, Any] = {"args": vars(args), "samples": []}
    pooled: dict[str, Rows] = defaultdict(Rows)
    for i in args.samples:
        t0 = time.perf_counter()
        sample = generate(args.task, args.length, EVAL_SEED_BASE + i, ctx)
        ids = list(lm.tokenizer(sample.document).input_ids)
        q_ids = list(lm.tokenizer(sample.query, add_special_tokens=False).input_ids)
        needles = needle_positions(lm, sample.document, ids)
        kv = [(k.float(), v.float()) for _, k, v in prefill_kv(lm, ids, progress=False)]
        src = MemorySource.build(kv, [summ])
        full_ans = decode(lm, Dense(kv), len(ids), q_ids, max_new=args.max_new_tokens)
        texts = {"full": str(lm.tokenizer.decode(full_ans))}
        summaries: dict[str, Any] = {}
        for b in budgets:
            label = f"doublep@{b if b is not None else 'none'}"
            cfg = DecodeConfig(budget=b, gen_len=1)
            method = get_method("doublep", lm.phi_map)
            if args.p1 is not None or args.p2 is not None:
                method = dataclasses.replace(method, **{  # type: ignore[type-var]
                    k: x for k, x in (("p1", args.p1), ("p2", args.p2)) if x is not None})
            texts[label] = str(lm.tokenizer.decode(decode(lm, method.open(src, cfg), len(ids), q_ids,
                                                          max_new=args.max_new_tokens)))
            attn = method.open(src, cfg)
            assert isinstance(attn, SparsePrefixAttention) and isinstance(attn.selector, DoublePSelector)
            rows = Rows()
            SelectProbe(attn.selector, kv, needles, rows, args.needle_row)
            lp = forced_logits(lm, attn, len(ids), q_ids, full_ans)
            r = rows.cat()
            # the answer steps where this method's greedy pick leaves full's answer (call i predicts token i)
            target = torch.tensor(full_ans + [next(iter(lm.eos_ids))])
            flips = (lp.argmax(-1) != target).nonzero().flatten().tolist()
            margin = (lp.gather(1, target[:, None])[:, 0] - lp.masked_fill(
                torch.nn.functional.one_hot(target, lp.shape[1]).bool(), -torch.inf).amax(-1))
            flip_rows = torch.zeros_like(r["call"], dtype=torch.bool)
            for f in flips:  # the forward that predicts token f: call f, its last query row for f = 0
                flip_rows |= (r["call"] == f) & ((r["step"] == r["step"][r["call"] == f].max()) if f == 0 else True)
            summaries[label + ":flips"] = {"steps": flips, "margins": [round(float(x), 3) for x in margin],
                                           **({"rows": summarize({k: x[flip_rows] for k, x in r.items()},
                                                                 args.needle_row)} if flips else {})}
            for key, x in r.items():
                pooled[label].cols[key].append(x)
            summaries[label] = summarize(r, args.needle_row)
        scores = {m: sample.score(tx) for m, tx in texts.items()}
        result["samples"].append({"index": i, "answers": sample.answers, "texts": texts, "scores": scores,
                                  "needle_tokens": int(needles.numel()), "summary": summaries,
                                  "seconds": round(time.perf_counter() - t0, 1)})
        print(json.dumps({"index": i, "scores": scores, "seconds": round(time.perf_counter() - t0, 1),
                          **{lb: {k: round(s["needle"][k], 4) for k in ("needle_exact", "needle_approx",
                                                                        "needle_drop", "err_dp", "err_nodrop",
                                                                        "needle_in_stage2", "needle_in_stage1")}
                             for lb, s in summaries.items() if "needle" in s}}), flush=True)
    result["summary"] = {lb: summarize(rows.cat(), args.needle_row) for lb, rows in pooled.items()}
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/kvstash-tiny")
    p.add_argument("--task", default="vt")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--samples", type=lambda s: [int(x) for x in s.split(",")], default=[0])
    p.add_argument("--budget", action="append", default=[], help="budget fraction or 'none' (repeatable)")
    p.add_argument("--p1", type=float)
    p.add_argument("--p2", type=float)
    p.add_argument("--cluster-size", type=int)
    p.add_argument("--iters", type=int)
    p.add_argument("--init", help="k-means init of ClusterSummarizer (where it has one)")
    p.add_argument("--needle-row", type=float, default=0.2, help="needle rows: dense needle mass at least this")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--output")
    args = p.parse_args(argv)
    if not args.budget:
        args.budget = ["0.02", "none"]
    res = run(args)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({lb: {k: v for k, v in s.items() if k != "per_layer"} for lb, s in res["summary"].items()},
                     indent=1))


if __name__ == "__main__":
    main()
