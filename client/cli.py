"""The ``kvstash`` command line: prefill, generate, ls, rm, info, store check."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from client.cli_budget import add_budget_command
from client.config import ClientConfig
from client.kvclient import KVClient
from store.errors import KVStashError
from store.manifest import Manifest
from workers.requests import LIMITS

EXIT_ERROR = 2
EXIT_PROBLEMS = 1
"""``kvstash store check``: problems remain (none were repaired, or some could not be)."""


def _client(args: argparse.Namespace) -> KVClient:
    overrides: dict[str, Any] = {"progress": not args.json and sys.stderr.isatty()}
    if args.home:
        overrides["home"] = Path(args.home)
    if args.model:
        overrides["model"] = args.model
    if args.device:
        overrides["device"] = args.device
    if args.tenant:
        overrides["tenant"] = args.tenant
    return KVClient(config=ClientConfig(**overrides))


def _manifest_summary(m: Manifest) -> dict[str, Any]:
    return {"prefix_id": m.prefix_id, "n_tokens": m.n_tokens, "model": m.model_name, "kv_bytes": m.kv_bytes,
            "artifact_bytes": m.artifact_bytes, "created_at": m.created_at}


def cmd_prefill(args: argparse.Namespace) -> dict[str, Any]:
    """Prefill a file (``-`` for stdin)."""
    text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    h = _client(args).prefill(text)
    if not args.json:
        print(f"{h.prefix_id}  {h.n_tokens} tokens  {'cached' if h.cached else 'stored'}")
    return {"prefix_id": h.prefix_id, "n_tokens": h.n_tokens, "cached": h.cached}


def cmd_generate(args: argparse.Namespace) -> dict[str, Any]:
    """Answer a query over a stored prefix, streaming text unless --json."""
    gen = _client(args).generate(args.query, prefix=args.prefix, method=args.method, budget=args.budget,
                                 max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                 seed=args.seed, stop=tuple(args.stop or ()), gen_len=args.gen_len)
    if args.json:
        text = gen.text
    else:
        for piece in gen:
            print(piece, end="", flush=True)
        print()
        text = gen.text
    st = gen.stats
    stats = {**st.to_json(), "seconds": round(st.seconds, 4)}
    if args.stats and not args.json:
        print(json.dumps(stats, indent=2), file=sys.stderr)
    return {"text": text, "prefix_id": args.prefix, "method": args.method, "token_ids": st.token_ids,
            "stats": stats}


def cmd_ls(args: argparse.Namespace) -> list[dict[str, Any]]:
    """List stored prefixes."""
    rows = [_manifest_summary(m) for m in _client(args).ls()]
    if not args.json:
        for r in rows:
            print(f"{r['prefix_id']}  {r['n_tokens']:>8} tok  {r['kv_bytes'] / 2**20:9.2f} MiB  {r['model']}")
    return rows


def cmd_rm(args: argparse.Namespace) -> dict[str, Any]:
    """Delete a stored prefix."""
    _client(args).rm(args.prefix_id)
    if not args.json:
        print(f"removed {args.prefix_id}")
    return {"removed": args.prefix_id}


def cmd_info(args: argparse.Namespace) -> dict[str, Any]:
    """Show a prefix's manifest, sizes and artifacts."""
    m = _client(args).info(args.prefix_id)
    d = {**_manifest_summary(m), "layout": m.layout.to_dict(), "tenant": m.tenant, "state": m.state,
         "model_fingerprint": m.key.model_fingerprint, "files": [asdict(f) for f in m.files],
         "artifacts": [asdict(a) for a in m.artifacts]}
    if not args.json:
        print(json.dumps(d, indent=2))
    return d


def cmd_eval(args: argparse.Namespace) -> dict[str, Any]:
    """Accuracy of the synthetic suite per task x length x method x budget."""
    import tempfile

    from lab.eval.accuracy import EvalSpec, run_eval, summary, table

    spec = EvalSpec(tasks=tuple(args.task), lengths=tuple(args.length), methods=tuple(args.method),
                    budgets=tuple(args.budget) if args.budget else (None,), samples=args.samples,
                    max_new_tokens=args.max_new_tokens, gen_len=args.gen_len)
    with tempfile.TemporaryDirectory(prefix="kvstash-eval-") as tmp:
        if not args.home:  # evaluation prefixes are throwaway unless a data dir is named
            args.home = tmp
        rows = run_eval(_client(args), spec, progress=not args.json and sys.stderr.isatty())
    result = summary(rows)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))
    if not args.json:
        print(table(rows))
        print(f"overall accuracy {result['accuracy']:.3f} over {result['samples']} samples")
    return result


def cmd_store_check(args: argparse.Namespace) -> dict[str, Any]:
    """Compare the store's metadata with its prefix directories; fix what was found with --repair."""
    from store.config import StoreConfig, default_home
    from store.kvstore import KVStore

    home = Path(args.home) if args.home else default_home()
    # Opening does not recover here, so that a check without --repair changes nothing.
    store = KVStore(StoreConfig(home=home, metadata_url=args.metadata_url), recover=False)
    try:
        report = store.check(repair=args.repair, hash_pages=not args.quick)
    finally:
        store.close()
    if not args.json:
        for pr in report.problems:
            print(f"{'fixed' if pr.fixed else 'found'}  {pr.kind:<13} {pr.name}  {pr.detail}")
        for name in report.busy:
            print(f"busy   {name} (a writer holds it; check again later)")
        state = "ok" if report.ok else "problems remain (run with --repair)" if not args.repair else "problems remain"
        print(f"{report.prefixes} prefixes, {len(report.problems)} problems: {state}")
    args.exit_code = 0 if report.ok else EXIT_PROBLEMS
    return report.to_dict()


def _add_store_commands(sub: argparse._SubParsersAction) -> None:
    """``kvstash store check``: needs no model."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--home", help="data directory (default $KVSTASH_HOME or ~/.cache/kvstash)")
    common.add_argument("--metadata-url", default=None, help="redis://host:port/db (default: LMDB in the data dir)")
    store_sub = sub.add_parser("store", help="maintain the data directory").add_subparsers(dest="store_command",
                                                                                           required=True)
    s = store_sub.add_parser("check", parents=[common],
                             help="report (and with --repair fix) metadata and prefix directories that disagree")
    s.add_argument("--repair", action="store_true",
                   help="register committed directories, drop dangling entries, remove orphans and damaged prefixes")
    s.add_argument("--quick", action="store_true", help="do not re-hash page files (sizes are still checked)")
    s.set_defaults(func=cmd_store_check)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--home", help="data directory (default $KVSTASH_HOME or ~/.cache/kvstash)")
    common.add_argument("--model", help="hub id or local path (default $KVSTASH_MODEL or the shipped model)")
    common.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    common.add_argument("--tenant", help="tenant namespace (default: default)")
    p = argparse.ArgumentParser(prog="kvstash", description="Prefill long documents once; ask them many questions.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("prefill", parents=[common], help="store a document's KV cache")
    s.add_argument("file", help="UTF-8 text file, or - for stdin")
    s.set_defaults(func=cmd_prefill)
    s = sub.add_parser("generate", parents=[common], help="answer a query over a stored prefix")
    s.add_argument("query")
    s.add_argument("--prefix", required=True, help="prefix id from `kvstash prefill`")
    s.add_argument("--method", default=LIMITS.method_default, help=f"decode method (default {LIMITS.method_default})")
    s.add_argument("--budget", type=float, default=None,
                   help=f"read budget as a fraction of the prefix, in (0, {LIMITS.budget_max}]")
    s.add_argument("--max-new-tokens", type=int, default=LIMITS.max_new_tokens_default,
                   help=f"1 to {LIMITS.max_new_tokens_cap} (default {LIMITS.max_new_tokens_default})")
    s.add_argument("--temperature", type=float, default=LIMITS.temperature_default,
                   help=f"0 (greedy) to {LIMITS.temperature_max} (default {LIMITS.temperature_default})")
    s.add_argument("--top-p", type=float, default=LIMITS.top_p_default,
                   help=f"nucleus mass in (0, 1] (default {LIMITS.top_p_default})")
    s.add_argument("--seed", type=int, default=None, help=f"sampling seed, 0 to {LIMITS.seed_max}")
    s.add_argument("--stop", action="append",
                   help=f"stop string (repeatable, at most {LIMITS.stop_max_count} of {LIMITS.stop_max_chars} chars)")
    s.add_argument("--gen-len", type=int, default=LIMITS.gen_len_default,
                   help=f"steps to amortize one-time summary reads over (default {LIMITS.gen_len_default})")
    s.add_argument("--stats", action="store_true", help="print per-generation statistics to stderr")
    s.set_defaults(func=cmd_generate)
    add_budget_command(sub, common)
    s = sub.add_parser("eval", parents=[common], help="accuracy on the synthetic long-context suite")
    s.add_argument("--task", action="append", required=True, help="task name (repeatable)")
    s.add_argument("--length", action="append", type=int, required=True, help="context tokens (repeatable)")
    s.add_argument("--method", action="append", default=None, help="decode method (repeatable; default full)")
    s.add_argument("--budget", action="append", type=float, default=None, help="read budget (repeatable)")
    s.add_argument("--samples", type=int, default=20)
    s.add_argument("--gen-len", type=int, default=LIMITS.gen_len_default,
                   help="steps to amortize one-time summary reads over")
    s.add_argument("--max-new-tokens", type=int, default=48)
    s.add_argument("--output", help="also write the JSON result to this file")
    s.set_defaults(func=cmd_eval)
    s = sub.add_parser("ls", parents=[common], help="list stored prefixes")
    s.set_defaults(func=cmd_ls)
    s = sub.add_parser("rm", parents=[common], help="delete a stored prefix")
    s.add_argument("prefix_id")
    s.set_defaults(func=cmd_rm)
    s = sub.add_parser("info", parents=[common], help="show a prefix's manifest")
    s.add_argument("prefix_id")
    s.set_defaults(func=cmd_info)
    _add_store_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvstash`` command."""
    args = build_parser().parse_args(argv)
    if getattr(args, "command", "") == "eval" and args.method is None:
        args.method = [LIMITS.method_default]
    func: Callable[[argparse.Namespace], Any] = args.func
    try:
        result = func(args)
    except KVStashError as e:
        if args.json:
            print(json.dumps({"error": str(e), "code": e.grpc_code}))
        print(f"kvstash: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError) as e:
        if args.json:
            print(json.dumps({"error": str(e), "code": "INVALID_ARGUMENT"}))
        print(f"kvstash: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(json.dumps(result))
    return int(getattr(args, "exit_code", 0))


if __name__ == "__main__":
    sys.exit(main())
