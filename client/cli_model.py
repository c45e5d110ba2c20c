"""``kvstash prefill | generate | eval``: the commands that load a model (torch is imported only when they run)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from client.cli_store import store_client
from store.errors import InvalidInput
from workers.methods.compressed_names import PREFILL_SCORERS
from workers.requests import LIMITS, QUERY_PAGES

if TYPE_CHECKING:
    from lab.eval.accuracy import EvalRow, EvalSpec

METHOD_HELP = {
    "full": "exact attention over every prefix token (reads it all; ignores --budget)",
    "topk": "sink/tail anchors + the k/page_size prefix pages holding the most attention, scored on a low-bit "
            "key index (reads about the budget, fetched or not)",
    "quest": "sink/tail anchors + the pages whose key bounds score highest (Quest)",
    "moba": "sink/tail anchors + the 64-token blocks whose mean key scores highest (MoBA)",
    "doublep": "sink/tail anchors + hierarchical top-p over key clusters (adaptive without --budget)",
    "topk+phi": "topk, plus a feature-map estimate of the tokens it does not read",
    "topk+vi": "topk, plus an estimate of the tokens it does not read from its key index and a 2-bit value index "
               "(reads the value index once, about 8 % of the KV)",
    "quest+phi": "quest, plus a feature-map estimate of the pages it does not read",
    "doublep+phi": "doublep, plus a feature-map estimate of the clusters it does not read",
    "topk-exact": "topk from every mid token's exact key (the selection oracle; reads every mid key)",
    "topk-exact+phi": "topk-exact, plus a feature-map estimate of the tokens it does not read",
    "topk-token": "sink/tail anchors + the top-k prefix tokens on the key index, a shortlist re-scored on exact "
                  "keys (fetched, each token pulls its page)",
    "snapkv": "query-time cache: the query's attention keeps --budget-tokens prefix entries per KV head (SnapKV)",
    "lookahead": "query-time cache: trained lookahead tokens after the query pick the kept entries (LookaheadKV)",
    "kvzip": "a compressed cache: the KV pairs the model attends most while repeating the document (--ratio)",
    "hybridkv": "kvzip scored on the model's calibrated top half of heads, the other heads pruned (--ratio)",
    "streamingllm": "a compressed cache of sink tokens plus the most recent ones (--ratio)",
    "kvzip+quest": "kvzip's cache, plus per step the evicted pages whose key bounds score highest (--ratio, "
                   "--budget: recalled fraction of the prefix per step)",
    "hybridkv+quest": "hybridkv's cache, plus the evicted pages as for kvzip+quest (--ratio, --budget)",
}
"""Every decode method (``workers.methods.registry.METHODS``; a test keeps the two in step) in one line each."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def _model_client(args: argparse.Namespace, progress: bool = True) -> Any:
    extra: dict[str, Any] = {"progress": progress and not args.json and sys.stderr.isatty()}
    if args.model:
        extra["model"] = args.model
    if args.device:
        extra["device"] = args.device
    return store_client(args, **extra)


def cmd_prefill(args: argparse.Namespace) -> dict[str, Any]:
    """Prefill a file (``-`` for stdin)."""
    text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    h = _model_client(args).prefill(text, compress=tuple(args.compress or ()))
    if not args.json:
        print(f"{h.prefix_id}  {h.n_tokens} tokens  {'cached' if h.cached else 'stored'}")
    return {"prefix_id": h.prefix_id, "n_tokens": h.n_tokens, "cached": h.cached}


def cmd_generate(args: argparse.Namespace) -> dict[str, Any]:
    """Answer a query over a stored prefix, streaming text unless --json."""
    gen = _model_client(args).generate(args.query, prefix=args.prefix, method=args.method, budget=args.budget,
                                       budget_tokens=args.budget_tokens,
                                       max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                       top_p=args.top_p, seed=args.seed, stop=tuple(args.stop or ()),
                                       gen_len=args.gen_len, ratio=args.ratio, query_pages=args.query_pages)
    if not args.json:
        printed = False
        try:
            for piece in gen:
                printed = printed or bool(piece)
                print(piece, end="", flush=True)
        except BaseException:
            if printed:  # a partial answer ends its line before the error message
                print(flush=True)
            raise
        print()
    text = gen.text
    st = gen.stats
    stats = {**st.to_json(), "seconds": round(st.seconds, 4)}
    if args.stats and not args.json:
        print(json.dumps(stats, indent=2), file=sys.stderr)
    return {"text": text, "prefix_id": args.prefix, "method": args.method, "token_ids": st.token_ids,
            "stats": stats}


def cmd_eval(args: argparse.Namespace) -> dict[str, Any]:
    """Accuracy of the synthetic suite per task x length x method x budget."""
    import tempfile

    from lab.eval.accuracy import EvalSpec, run_eval, summary, table

    try:
        spec = EvalSpec(tasks=tuple(args.task), lengths=tuple(args.length),
                        methods=tuple(args.method or (LIMITS.method_default,)),
                        budgets=tuple(args.budget) if args.budget else (None,),
                        budget_tokens=tuple(args.budget_tokens) if args.budget_tokens else (None,),
                        ratios=tuple(args.ratio) if args.ratio else (None,), samples=args.samples,
                        max_new_tokens=args.max_new_tokens, gen_len=args.gen_len, query_pages=args.query_pages,
                        concurrency=args.concurrency)
    except ValueError as e:
        raise InvalidInput(str(e)) from None
    with tempfile.TemporaryDirectory(prefix="kvstash-eval-") as tmp:
        if not args.home:  # evaluation prefixes are throwaway unless a data dir is named
            args.home = tmp
        # One bar over the samples: per-prefill bars would interleave with it.
        rows = run_eval(_model_client(args, progress=False), spec, progress=not args.json and sys.stderr.isatty(),
                        on_rows=None if not args.output else lambda rows: _write_result(args.output, spec, rows))
    result = {**summary(rows), "query_pages": spec.query_pages}
    if args.output:
        _write_result(args.output, spec, rows)
    if not args.json:
        print(table(rows))
        print(f"overall accuracy {result['accuracy']:.3f} over {result['samples']} samples")
    return result


def _write_result(path: str, spec: EvalSpec, rows: Sequence[EvalRow]) -> None:
    """Write the eval's JSON result (the rows so far) whole or not at all: a stopped run leaves the last one."""
    from lab.eval.accuracy import summary

    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps({**summary(rows), "query_pages": spec.query_pages}, indent=2))
    tmp.replace(out)


def _methods_epilog() -> str:
    return "methods:\n" + "\n".join(f"  {name:<12} {what}" for name, what in METHOD_HELP.items())


def add_model_commands(sub: Any, model_opts: argparse.ArgumentParser) -> None:
    """Add ``prefill``, ``generate`` and ``eval``."""
    fmt = argparse.RawDescriptionHelpFormatter
    s = sub.add_parser("prefill", parents=[model_opts], help="store a document's KV cache",
                       description="Run the model over a document once and store its KV cache; prints its prefix "
                                   "id (a second prefill of the same text is a cache hit).")
    s.add_argument("file", help="UTF-8 text file, or - for stdin")
    s.add_argument("--compress", action="append", choices=PREFILL_SCORERS, metavar="METHOD",
                   help=f"also compute this compression method's scores now ({', '.join(PREFILL_SCORERS)}; "
                        "repeatable): a later --method METHOD at any --ratio skips the scoring pass")
    s.set_defaults(func=cmd_prefill)
    s = sub.add_parser("generate", parents=[model_opts], help="answer a query over a stored prefix",
                       formatter_class=fmt, epilog=_methods_epilog(),
                       description="Answer QUERY over a stored prefix, streaming the text.")
    s.add_argument("query", help="the question (sent through the model's query template)")
    s.add_argument("--prefix", required=True, metavar="ID", help="prefix id from `kvstash prefill`")
    s.add_argument("--method", default=LIMITS.method_default, choices=list(METHOD_HELP), metavar="METHOD",
                   help=f"decode method, one of: {', '.join(METHOD_HELP)} (default {LIMITS.method_default}; "
                        "see below)")
    s.add_argument("--budget", type=_finite_float, default=None, metavar="FRACTION",
                   help=f"prefix tokens a sparse method reads per step, as a fraction of the prefix, in "
                        f"(0, {LIMITS.budget_max}] (default: the method's own)")
    s.add_argument("--budget-tokens", type=_positive_int, default=None, metavar="N",
                   help=f"prefix KV entries per KV head a query-time cache (snapkv, lookahead) keeps, 1 to "
                        f"{LIMITS.budget_tokens_max} (default: the method's own)")
    s.add_argument("--ratio", type=_finite_float, default=None, metavar="FRACTION",
                   help=f"fraction of the prefix's KV pairs a compression method's cache keeps, in "
                        f"(0, {LIMITS.ratio_max}] (default: the method's own, 0.3)")
    s.add_argument("--max-new-tokens", type=int, default=LIMITS.max_new_tokens_default, metavar="TOKENS",
                   help=f"answer length cap, 1 to {LIMITS.max_new_tokens_cap} "
                        f"(default {LIMITS.max_new_tokens_default})")
    s.add_argument("--temperature", type=_finite_float, default=LIMITS.temperature_default, metavar="T",
                   help=f"0 (greedy) to {LIMITS.temperature_max} (default {LIMITS.temperature_default})")
    s.add_argument("--top-p", type=_finite_float, default=LIMITS.top_p_default, metavar="MASS",
                   help=f"nucleus probability mass in (0, 1] (default {LIMITS.top_p_default})")
    s.add_argument("--seed", type=int, default=None, help=f"sampling seed, 0 to {LIMITS.seed_max} (default: random)")
    s.add_argument("--stop", action="append", metavar="TEXT",
                   help=f"stop string (repeatable, at most {LIMITS.stop_max_count} of {LIMITS.stop_max_chars} "
                        "characters; default: the model's)")
    s.add_argument("--gen-len", type=int, default=LIMITS.gen_len_default, metavar="STEPS",
                   help=f"decode steps a method's one-time summary read is amortized over when its budget is "
                        f"matched (default {LIMITS.gen_len_default})")
    _add_query_pages(s)
    s.add_argument("--stats", action="store_true", help="print per-generation statistics (JSON) to stderr")
    s.set_defaults(func=cmd_generate)
    _add_eval(sub, model_opts, fmt)


def _add_eval(sub: Any, model_opts: argparse.ArgumentParser, fmt: type[argparse.HelpFormatter]) -> None:
    from lab.eval.accuracy import EVAL_CONCURRENCY_DEFAULT, EVAL_CONCURRENCY_MAX
    from lab.synth.registry import TASKS

    s = sub.add_parser("eval", parents=[model_opts], help="accuracy on the synthetic long-context suite",
                       formatter_class=fmt, epilog=_methods_epilog() + "\ntasks:\n  " + ", ".join(TASKS),
                       description="Score generated tasks with gold answers at each context length, method and "
                                   "budget (prefixes go to a temporary data dir unless --home is given).")
    s.add_argument("--task", action="append", required=True, choices=list(TASKS), metavar="TASK",
                   help="task name (repeatable; listed below)")
    s.add_argument("--length", action="append", type=_positive_int, required=True, metavar="TOKENS",
                   help="context length (repeatable)")
    s.add_argument("--method", action="append", default=None, choices=list(METHOD_HELP), metavar="METHOD",
                   help=f"decode method (repeatable; default {LIMITS.method_default})")
    s.add_argument("--budget", action="append", type=_finite_float, default=None, metavar="FRACTION",
                   help="read budget per step as a fraction of the prefix (repeatable; default: each method's own)")
    s.add_argument("--budget-tokens", action="append", type=_positive_int, default=None, metavar="N",
                   help="KV entries per KV head a query-time cache keeps (repeatable; default: each method's own)")
    s.add_argument("--ratio", action="append", type=_finite_float, default=None, metavar="FRACTION",
                   help="kept fraction of a compression method's cache (repeatable; default: each method's own)")
    s.add_argument("--samples", type=_positive_int, default=20, metavar="N",
                   help="samples per task and length (default 20)")
    s.add_argument("--gen-len", type=_positive_int, default=LIMITS.gen_len_default, metavar="STEPS",
                   help="decode steps a one-time summary read is amortized over")
    s.add_argument("--max-new-tokens", type=_positive_int, default=48, metavar="TOKENS",
                   help="answer length cap (default 48)")
    _add_query_pages(s)
    s.add_argument("--concurrency", type=_positive_int, default=EVAL_CONCURRENCY_DEFAULT, metavar="N",
                   help=f"generations in flight at once, batched by the engine (the same answers as one at a time; "
                        f"1 to {EVAL_CONCURRENCY_MAX}, default {EVAL_CONCURRENCY_DEFAULT})")
    s.add_argument("--output", metavar="FILE", help="also write the JSON result to this file (rewritten after each "
                                                    "group of samples, so a stopped run keeps what it measured)")
    s.set_defaults(func=cmd_eval)


def _add_query_pages(s: argparse.ArgumentParser) -> None:
    s.add_argument("--query-pages", choices=QUERY_PAGES, default=QUERY_PAGES[0],
                   help="page methods: each query token picks its own pages (token, the default) or a query chunk's "
                        "tokens share one set (shared: fewer pages read before the first token)")
