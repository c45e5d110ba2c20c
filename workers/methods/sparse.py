"""The shared sparse decode path: anchors + a selector's picks + pseudo-entries under one softmax.

Per decode step, layer and KV head, a step attends exactly the sink and tail anchors and the
mid-region tokens its selector picks (per query token; GQA groups share one pick per KV head),
plus pseudo-entries: Double-P centroids (extra buffer rows, bias ``log s``, value ``V̄``) and the
φ completion term (logit ``log Ẑ_R``, value ``N̂_R / Ẑ_R``). All go through one call of the
sparse attention op (the Triton kernel on CUDA, its float32 torch form elsewhere).

Where the K/V comes from is the source's ``LayerKV``: with a ``PageFetcher`` (the worker's default)
each step fetches only the pages of the tokens it attends, through the GPU page cache, the pinned
host tier and the SSD page files; without one, each layer is read once and held resident (the
reference path), and reads are counted per step as if fetched.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch

from store.errors import InvalidInput
from workers.budget import plan_budget
from workers.kernels.gather_entries import attend_entries, gather_entries, gather_entries_usable
from workers.kernels.page_entries import page_entries
from workers.kernels.sparse_attention import sparse_decode_attention, sparse_decode_attention_torch
from workers.methods.base import Method, ReadReport, mid_range
from workers.methods.layer_kv import StepKV
from workers.methods.page_step import PagePlan, entry_bias, entry_tokens, page_plan, step_pages
from workers.methods.pages_together import PageScoring
from workers.methods.phi import Completion, PhiCompletion
from workers.methods.phi_maps import FeatureMap
from workers.methods.reads import KV_ONCE, ReadCounter, mark_tokens
from workers.methods.selector import LayerContext, Selection, Selector
from workers.methods.source import PrefixSource
from workers.methods.step_graphs import StepGraphs, run_graphed
from workers.offload.device_plan import DevicePageCache
from workers.offload.fetcher import PageFetcher
from workers.requests import DecodeConfig

DEFAULT_FRACTION = 0.05
"""Budget of fixed-budget selectors when the request gives none."""
ROW_ELEMS = 1 << 25
CPU_GATHER_KERNEL = True
"""A single query row over selected token rows (``_attend_rows``) on the CPU gathers its entries (exact rows, then
extra rows such as Double-P's centroids) in one C++ call (``workers/kernels/gather_entries``, where it builds: copies
only) and attends with the torch form's float ops: the same bits, without some fifteen small index ops a layer.
False: the torch form throughout."""
"""Rows of query tokens are processed in chunks of about this many score elements."""


def gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, idx: torch.Tensor,
                       n_valid: torch.Tensor | None, bias: torch.Tensor | None, pseudo_logits: torch.Tensor | None,
                       pseudo_values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[T, Hq, D]`` over rows ``idx [T, Hkv, N]`` of one shared buffer k, v ``[Hkv, S, D]``.

    Returns float32 out ``[T, Hq, D]`` and lse ``[T, Hq]``. CUDA tensors run the Triton kernel;
    others its float32 torch form (``sparse_decode_attention_ref``, float64, is the tests' oracle).
    """
    t = q.shape[0]
    kb, vb = k.unsqueeze(0).expand(t, -1, -1, -1), v.unsqueeze(0).expand(t, -1, -1, -1)
    op = sparse_decode_attention if q.is_cuda else sparse_decode_attention_torch
    out, lse = op(q.to(k.dtype), kb, vb, scale=scale, idx=idx, n_valid=n_valid, bias=bias,
                  pseudo_logits=pseudo_logits, pseudo_values=pseudo_values)
    return out.float(), lse.float()


def _append(ids: torch.Tensor, n: torch.Tensor, more: torch.Tensor, n_more: torch.Tensor, more_bias: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two parts ``[..., W]`` whose valid entries come first (``n``, ``n_more`` of them) as one, valid entries first:
    the first part's, then the second's (bias 0, then ``more_bias``), moved by one scatter; past ``n + n_more``,
    entries and bias are unspecified. Returns (ids, counts, bias)."""
    at = n.unsqueeze(-1) + torch.arange(more.shape[-1], device=more.device)  # at most the first part's width
    idx = torch.cat([ids, more], dim=-1).scatter_(-1, at, more)
    bias = torch.cat([more_bias.new_zeros(ids.shape), more_bias], dim=-1).scatter_(-1, at, more_bias)
    return idx, n + n_more, bias


def offload_counters(fetcher: PageFetcher, device_cache: DevicePageCache | None, steps: int) -> dict[str, float]:
    """``offload_*`` counters of one generation: the fetcher's, plus the device-planned cache's fetches
    (its hits are GPU-cache hits, its misses host-tier pages). Raises if it was given bad page ids."""
    x = fetcher.stats.as_dict()
    if device_cache is not None:
        device_cache.check()
        d = device_cache.stats()
        x["offload_pages_requested"] += d.pages
        x["offload_gpu_hits"] += d.hits
        x["offload_host_pages"] += d.misses
        x["offload_bytes_gpu_hit"] += d.hits * d.payload_bytes
        x["offload_bytes_host"] += d.bytes_host
        x["offload_device_plan_fetches"] = float(d.fetches)
        x["offload_device_plan_pages"] = float(d.pages)
        x["offload_hit_rate"] = x["offload_gpu_hits"] / x["offload_pages_requested"] if x[
            "offload_pages_requested"] else 0.0
    x["offload_steps"] = float(steps)
    return x


class SparsePrefixAttention:
    """``PrefixAttention`` of a selector (+ optional φ completion) over one stored prefix."""

    def __init__(self, source: PrefixSource, config: DecodeConfig, selector: Selector,
                 completion: Completion | None, k: int | None, counter: ReadCounter):
        self.source, self.config, self.selector, self.completion = source, config, selector, completion
        self.k, self.counter = k, counter
        self._ctx: dict[int, tuple[LayerContext, torch.Tensor | None]] = {}
        self._plans: dict[int, PagePlan] = {}
        self._counts: dict[int, torch.Tensor] = {}
        """Per layer with a plan: ``[1, Hkv]`` picked tokens per head of a single row (made once, not per step)."""
        self._step = -1
        self._graph_heads = 0
        """Query heads of the captured step (``graph_attend`` ran at its capture)."""
        self.graphs: StepGraphs | None = None
        """CUDA graphs of the fixed-shape single-row steps (None: every step eager)."""

    def use_cuda_graphs(self) -> None:
        """Replay fixed-shape decode steps from per-layer CUDA graphs (on a CUDA device; see ``step_graphs``)."""
        if self.source.device.type == "cuda":
            self.graphs = StepGraphs()

    def verify_summaries(self) -> None:
        """Before the first token goes out: the summaries the query's forward selected with must be the recorded
        ones (they may have been read while it ran: ``workers.offload.streamed_summary``)."""
        self.selector.verify_summaries()

    def read_report(self) -> ReadReport:
        """Reads made so far (per step and one-time)."""
        report = self.counter.report()
        if (fetcher := self.source.fetcher) is not None:
            # What the tiers really moved: whole pages, GPU-cache hits included.
            report.extra.update(offload_counters(fetcher, self.source.device_cache, len(report.tokens_per_step)))
            # Plus what selection scanned from resident summaries (Double-P's centroids): no tier moved it.
            report.step_bytes = (int(report.extra["offload_pages_requested"]) * self.source.layout.page_payload_bytes
                                 + int(report.extra.get("index_bytes", 0)))
        return report

    def _layer(self, layer: int) -> tuple[LayerContext, torch.Tensor | None]:
        if layer not in self._ctx:
            kv = self.source.layer(layer)
            lo, hi = mid_range(kv.n_tokens, self.config.sink, self.config.tail)
            for r in (self.selector.summary_range(layer), self.completion and self.completion.summary_range(layer)):
                if r:
                    lo, hi = max(lo, r[0]), min(hi, r[1])
            ctx = LayerContext(kv, lo, max(lo, hi))
            if self.k is not None and self.selector.page_size == kv.page_size:
                # Whole pages under a fixed budget: fixed-shape steps (see page_step).
                plan = self._plans[layer] = page_plan(anchors=ctx.anchors, lo=ctx.lo, hi=ctx.hi,
                                                      page_size=kv.page_size, k=self.k, n_heads=kv.n_heads)
                self._counts[layer] = torch.full((1, kv.n_heads), plan.n_pages * plan.page_size, device=ctx.device)
            self.selector.prepare(layer, ctx)
            if self.completion is not None:
                self.completion.prepare(layer, ctx)
            self.counter.add_once(KV_ONCE, self.selector.resident_bytes(ctx))
            extra = self.selector.extra_entries(layer)
            if extra is not None:
                kv.set_extra(extra.k, extra.v)
            self._ctx[layer] = (ctx, None if extra is None else extra.bias.float())
        return self._ctx[layer]

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[B, Hq, L, D]`` -> (out ``[B, Hq, L, D]``, lse ``[B, Hq, L]``) over the prefix, per query token."""
        if layer == 0:
            self.counter.start_step()
            self._step += 1
        ctx, ebias = self._layer(layer)
        ctx.kv.at_step = self._step
        b, hq, l, d = q.shape
        hkv, n = ctx.kv.n_heads, ctx.n_tokens
        rows = q.permute(0, 2, 1, 3).reshape(b * l, hq, d)
        chunk = max(1, ROW_ELEMS // max(1, hq * n))
        outs, lses, pseudo, index = [], [], [], []
        plan = self._plans.get(layer)
        key = None
        if rows.shape[0] == 1 and self.graphs is not None and plan is not None and ebias is None:
            key = ctx.kv.graph_key(plan.n_pages + plan.anchor_pages.shape[1])
        if key is not None:  # a fixed-shape decode step: replayed from the layer's CUDA graph
            assert self.graphs is not None and plan is not None
            n_anchor = ctx.anchors.numel() * hkv

            def step(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                sel, o, s = self._attend_pages(layer, ctx, plan, r, scale)
                assert sel.n_distinct is not None
                return o, s, sel.n_distinct + n_anchor

            o, s, n_read = run_graphed(self.graphs, layer, key, rows, step)
            self.counter.add_layer(n_read, rows.shape[0] * hq if self.completion is not None else 0)
            return o.reshape(b, l, hq, d).permute(0, 2, 1, 3), s.reshape(b, l, hq).permute(0, 2, 1)
        n_keys: torch.Tensor | int = 0
        if rows.shape[0] == 1:  # a decode step: one row's tokens need no marking to be counted
            sel, o, s = self._attend_rows(layer, ctx, ebias, rows, scale)
            outs, lses = [o], [s]
            n_mid = sel.n_distinct if sel.n_distinct is not None else sel.counts.sum()
            pseudo.append(sel.n_centroids.sum() if sel.n_centroids is not None else 0)
            if sel.scored is not None:  # the shortlist holds the attended tokens: the rest are key-only reads
                n_keys = sel.scored[0].numel() - sel.counts.sum()
            index.append(sel.index_bytes)
        else:
            hits = torch.zeros(hkv, n, dtype=torch.int32, device=q.device)
            scored = torch.zeros_like(hits)
            for part in rows.split(chunk):
                sel, o, s = self._attend_rows(layer, ctx, ebias, part, scale)
                outs.append(o)
                lses.append(s)
                mark_tokens(hits, sel.tokens, sel.counts)
                if sel.scored is not None:
                    mark_tokens(scored, sel.scored, torch.full(sel.scored.shape[:2], sel.scored.shape[-1],
                                                               device=q.device))
                pseudo.append(sel.n_centroids.sum() if sel.n_centroids is not None else 0)
                index.append(sel.index_bytes)
            n_mid = (hits > 0).sum()
            n_keys = ((scored > 0) & (hits == 0)).sum()
        n_read = n_mid + ctx.anchors.numel() * hkv
        phi_rows = rows.shape[0] * hq if self.completion is not None else 0
        self.counter.add_layer(n_read, sum(pseudo) + phi_rows, n_keys, sum(index))
        o, s = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(lses))
        return o.reshape(b, l, hq, d).permute(0, 2, 1, 3), s.reshape(b, l, hq).permute(0, 2, 1)

    # -- a whole model step captured in one CUDA graph (workers.step_graph) --------------------------------
    def graph_key(self) -> object | None:
        """Capturable when every layer takes whole pages under the budget, without pseudo-entries, from a
        cache that can serve a captured step, and one eager decode step has warmed it."""
        if self._step < 1 or len(self._ctx) < self.source.layout.n_layers:
            return None
        keys = []
        for layer, (ctx, ebias) in self._ctx.items():
            plan = self._plans.get(layer)
            if plan is None or ebias is not None:
                return None
            key = ctx.kv.graph_key(plan.n_pages + plan.anchor_pages.shape[1])
            if key is None:
                return None
            keys.append(key)
        return tuple(keys)

    def graph_attend(self, layer: int, q: torch.Tensor, scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The fixed-shape page step of one query row (device work only; ``account_step`` counts it)."""
        return self._graph_step(layer, q, scale, None)

    def graph_page_scoring(self, layer: int) -> PageScoring | None:
        """What this layer's page selection scores, when it can run with other members' (``pages_together``)."""
        ctx, ebias = self._ctx[layer]
        plan = self._plans.get(layer)
        scored = self.selector.page_bounds(layer, ctx) if plan is not None and ebias is None else None
        if plan is None or scored is None:
            return None
        return PageScoring(scored=scored, n_pages=plan.n_pages, anchor_pages=plan.anchor_pages)

    def graph_attend_pages(self, layer: int, q: torch.Tensor, scale: float, pages: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``graph_attend`` over pages picked together with other members' (``[Hkv, n + na]``)."""
        return self._graph_step(layer, q, scale, pages)

    def _graph_step(self, layer: int, q: torch.Tensor, scale: float, pages: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        ctx, _ = self._ctx[layer]
        plan = self._plans[layer]
        b, hq, l, d = q.shape
        self._graph_heads = hq
        sel, o, s = self._attend_pages(layer, ctx, plan, q.reshape(1, hq, d), scale, pages)
        assert sel.n_distinct is not None
        # the picked mid tokens only: the anchors' fixed count is added on the host (account_step), not by a
        # kernel per layer and member inside the captured step
        return o.reshape(1, hq, 1, d), s.reshape(1, hq, 1), sel.n_distinct

    def account_step(self, reads: torch.Tensor | None) -> None:
        """What ``attend`` counts on the host for a decode step, for a step that ran captured."""
        assert reads is not None and reads.numel() == len(self._ctx)
        self.counter.start_step()
        self._step += 1
        for ctx, _ in self._ctx.values():
            ctx.kv.at_step = self._step
        # one entry for every layer: the counts stay on the device, summed when the report is read
        self.counter.add_layer(reads, len(self._ctx) * (self._graph_heads if self.completion is not None else 0))
        self.counter.add_layer(sum(ctx.anchors.numel() * ctx.kv.n_heads for ctx, _ in self._ctx.values()))

    def _attend_rows(self, layer: int, ctx: LayerContext, ebias: torch.Tensor | None, q: torch.Tensor,
                     scale: float) -> tuple[Selection, torch.Tensor, torch.Tensor]:
        """Select, make the step's tokens attendable (one fetch), attend."""
        t, hq, d = q.shape
        hkv = ctx.kv.n_heads
        qg = q.view(t, hkv, hq // hkv, d)
        if (plan := self._plans.get(layer)) is not None and ebias is None:
            return self._attend_pages(layer, ctx, plan, q, scale)
        with self._timed("select"):
            sel = self.selector.select(layer, ctx, qg, scale, self.k)
        anchors = ctx.anchors.expand(t, hkv, -1)
        # every anchor is valid and the selection's valid ids come first: the concatenation is compact already
        tok = torch.cat([anchors, sel.tokens], dim=-1)
        n_tok = (sel.counts if sel.counts.dtype == torch.int64 else sel.counts.long()) + anchors.shape[-1]
        # A step whose pages exceed the GPU page cache (e.g. the query's first forward, many rows) still
        # gets them, in a one-off pool of at most one layer's pages.
        step = ctx.kv.step(tok, n_tok, self._step, overflow=True)
        pl = pv = None
        if self.completion is not None:
            n_anchor = anchors.shape[-1]
            if self.completion.reads_pools(step.k, step.v):  # the CPU kernel reads the pools' rows: no copy
                log_z, mean = self.completion.term(layer, ctx, qg, scale, step.k, step.v, sel.counts,
                                                   tokens=sel.tokens, rows=step.rows[..., n_anchor:])
            else:
                k_sel, v_sel = step.gather(step.rows[..., n_anchor:])
                log_z, mean = self.completion.term(layer, ctx, qg, scale, k_sel, v_sel, sel.counts,
                                                   tokens=sel.tokens)
            pl, pv = log_z.reshape(t, hq, 1).contiguous(), mean.reshape(t, hq, 1, d).contiguous()
        centroids = sel.centroids is not None and sel.n_centroids is not None and ebias is not None
        if t == 1 and CPU_GATHER_KERNEL and q.dtype == torch.float32 and gather_entries_usable(step.k, step.v):
            with self._timed("attend"):  # one row on the CPU: the entries gathered in one call, then the same ops
                ids = table = cb = None
                if centroids:
                    assert sel.centroids is not None and ebias is not None
                    ids, table, cb = sel.centroids[0], step.extra_table, ebias  # rows and bias looked up by id
                    if table is None:  # rows by rule: this step's rows and bias, looked up by position
                        table, cb = step.extra_rows(sel.centroids)[0], ebias.gather(1, ids)
                        ids = torch.arange(ids.shape[-1]).expand_as(ids)
                kg, vg, row_bias = gather_entries(step.k, step.v, step.rows[0], n_tok, ids, sel.n_centroids, cb, table)
                out, lse = attend_entries(q, kg[None], vg[None], row_bias[None], scale=scale, pseudo_logits=pl,
                                          pseudo_values=pv)
            return sel, out, lse
        rows = step.rows
        bias = None
        if centroids:
            assert sel.centroids is not None and sel.n_centroids is not None and ebias is not None
            cb = ebias.unsqueeze(0).expand(t, -1, -1).gather(2, sel.centroids)
            rows, n_tok, bias = _append(rows, n_tok, step.extra_rows(sel.centroids), sel.n_centroids, cb)
        with self._timed("attend"):
            out, lse = gathered_attention(q, step.k, step.v, scale=scale, idx=rows, n_valid=n_tok, bias=bias,
                                          pseudo_logits=pl, pseudo_values=pv)
        return sel, out, lse

    def _attend_pages(self, layer: int, ctx: LayerContext, plan: PagePlan, q: torch.Tensor, scale: float,
                      pages: torch.Tensor | None = None) -> tuple[Selection, torch.Tensor, torch.Tensor]:
        """Rows over whole pages (``page_step``): fixed shapes; a single row needs no device -> host copy.
        ``pages``: a single row's pages picked already (``[Hkv, n + na]``, picked then anchor pages)."""
        t, hq, d = q.shape
        hkv = ctx.kv.n_heads
        qg = q.view(t, hkv, hq // hkv, d)
        if pages is None:
            with self._timed("select"):
                picked = self._pick_pages(layer, ctx, qg, scale, plan.n_pages)
        else:
            picked = pages[None, :, :plan.n_pages]
        n_picked = plan.n_pages * plan.page_size
        # Out-of-mid ids become duplicates of their page's mid tokens: read counting sees distinct tokens
        # (for a single row, exactly the picked mid tokens: pages are distinct).
        in_mid: torch.Tensor | None
        if t == 1:  # a decode step: its entries in one launch (page_entries), no device -> host copy
            fetched = step_pages(plan, picked[0]) if pages is None else pages
            k, v, first = ctx.kv.step_pages(fetched, self._step)
            ent = page_entries(picked[0], first, plan.anchor_slot, plan.anchor_offset, page_size=plan.page_size,
                               lo=plan.lo, hi=plan.hi, pool_rows=k.shape[1])
            step = StepKV(k=k, v=v, rows=ent.rows, extra_base=0, extra_stride=0)
            rows, bias, in_mid, mid_rows = ent.rows, ent.bias, ent.valid, ent.mid_rows  # the last two: CPU kernel
            counts = self._counts[layer]
            sel = Selection(tokens=ent.tokens, counts=counts, n_distinct=ent.n_distinct)
        else:  # the query's first forward: the same entries per row, fetched together
            tokens = entry_tokens(plan, picked)
            bias, in_mid = entry_bias(plan, tokens)
            counts = torch.full((t, hkv), n_picked, device=q.device)
            sel = Selection(tokens=tokens[..., :n_picked].clamp(ctx.lo, max(ctx.lo, ctx.hi - 1)), counts=counts)
            n_all = torch.full((t, hkv), plan.n_entries, device=q.device)
            step = ctx.kv.step(tokens.clamp_max(ctx.n_tokens - 1), n_all, self._step, overflow=True)
            rows = step.rows.clamp(0, step.k.shape[1] - 1)  # a masked entry past the prefix still reads a real row
            mid_rows = None
        k, v = step.k, step.v
        pl = pv = None
        if self.completion is not None:
            valid = in_mid if in_mid is not None else bias[..., :n_picked] == 0  # bias -inf: outside the mid region
            if self.completion.reads_pools(step.k, step.v):  # the CPU kernel reads the pools' rows: no copy
                log_z, mean = self.completion.term(layer, ctx, qg, scale, step.k, step.v, counts, valid=valid,
                                                   tokens=sel.tokens,
                                                   rows=mid_rows if mid_rows is not None else rows[..., :n_picked])
            else:
                k_sel, v_sel = step.gather(rows[..., :n_picked])
                log_z, mean = self.completion.term(layer, ctx, qg, scale, k_sel, v_sel, counts, valid=valid,
                                                   tokens=sel.tokens)
            pl, pv = log_z.reshape(t, hq, 1).contiguous(), mean.reshape(t, hq, 1, d).contiguous()
        with self._timed("attend"):  # every entry is valid (out-of-mid ones are dropped by their bias)
            out, lse = gathered_attention(q, k, v, scale=scale, idx=rows, n_valid=None, bias=bias,
                                          pseudo_logits=pl, pseudo_values=pv)
        return sel, out, lse

    def _pick_pages(self, layer: int, ctx: LayerContext, qg: torch.Tensor, scale: float, n: int) -> torch.Tensor:
        """``[T, Hkv, n]`` pages per row: one set for all rows of a query chunk with ``query_pages="shared"``
        (where the selector can), else each row its own."""
        t = qg.shape[0]
        if t > 1 and self.config.query_pages == "shared":
            shared = self.selector.select_pages_shared(layer, ctx, qg, scale, n)
            if shared is not None:
                return shared.unsqueeze(0).expand(t, -1, -1).contiguous()
        return self.selector.select_pages(layer, ctx, qg, scale, n)

    def _timed(self, phase: str) -> contextlib.AbstractContextManager[None]:
        """Time a phase into the fetcher's stats (``offload_<phase>_s``), when there is one."""
        f = self.source.fetcher
        return f.stats.timed(phase, f.device) if f is not None else contextlib.nullcontext()


@dataclass(kw_only=True)
class SparseMethod(Method):
    """A selector over the mid region, optionally φ-completed; the budget is matched in reads."""

    completion: ClassVar[bool] = False
    fetches_pages: ClassVar[bool] = True
    default_fraction: ClassVar[float | None] = DEFAULT_FRACTION
    """Budget when the request gives none (None: the selector's adaptive rule)."""
    feature_map: FeatureMap | None = None
    """φ map the prefix's cache was built with, when it is not the default FAVOR+ map."""

    @abc.abstractmethod
    def selector(self, source: PrefixSource, config: DecodeConfig) -> Selector:
        """The selector of one generation."""

    def make_completion(self, source: PrefixSource, selector: Selector) -> Completion:
        """The completion term of one generation (its summaries read now, so charged with the others): φ's."""
        return PhiCompletion(source, self.feature_map)

    def open(self, source: PrefixSource, config: DecodeConfig) -> SparsePrefixAttention:
        """State for one generation: budget plan, selector, φ cache, read counter.

        A φ-completed method whose budget already covers every mid token exactly reads them all
        and skips the φ fetch (the exact answer is cheaper than the estimate).
        """
        lay = source.layout
        counter = ReadCounter(n_layers=lay.n_layers, n_kv_heads=lay.n_kv_heads, token_bytes=lay.token_kv_bytes())
        before = source.bytes_read
        fraction = config.budget if config.budget is not None else self.default_fraction
        lo, hi = mid_range(source.n_tokens, config.sink, config.tail)
        plan_args = {"prefill_len": source.n_tokens, "head_dim": lay.head_dim, "sink": config.sink,
                     "tail": config.tail, "gen_len": config.gen_len}
        covered = fraction is not None and plan_budget(fraction=fraction, **plan_args).k_topk >= hi - lo
        selector = self.selector(source, config)
        completion = self.make_completion(source, selector) if self.completion and not covered else None
        k = None
        if fraction is not None:
            phi_dim = completion.phi_dim if completion else 0
            ratio = completion.elem_bytes / lay.elem_bytes if completion else 1
            plan = plan_budget(fraction=fraction, phi_dim=phi_dim, elem_ratio=ratio, **plan_args)
            if completion is not None and not plan.hybrid_feasible:  # the paper's "-": no matched-read plan exists
                raise InvalidInput(
                    f"budget {fraction} of {source.n_tokens} tokens allows {plan.n_budget} token equivalents per "
                    f"step, fewer than the {config.sink} sink + {config.tail} tail anchors plus the φ cache's "
                    f"one-time fetch amortized over gen_len={config.gen_len} ({plan.n_off}): raise the budget or "
                    f"gen_len, or use {self.name.split('+')[0]} without φ completion")
            k = plan.k_exact(completion is not None)
            counter.info.update({"budget_fraction": fraction, "budget_n": plan.n_budget, "budget_k": k})
            if completion:
                counter.info["phi_r_once"] = plan.r_phi_once
        counter.add_once("summaries", source.bytes_read - before)
        attn = SparsePrefixAttention(source, config, selector, completion, k, counter)
        for layer in range(lay.n_layers):  # summaries and plans now: the opener pays, not a shared decode step
            attn._layer(layer)
        return attn
