"""``kvstash ls | info | rm | verify | store check``: commands over the data directory that load no model."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from client.cli_errors import EXIT_PROBLEMS
from client.config import ClientConfig
from client.kvclient import KVClient, PrefixHealth
from store.manifest import Manifest
from workers.methods.compressed_names import parse_cache_artifact


def store_client(args: argparse.Namespace, **extra: Any) -> KVClient:
    """An embedded client over ``--home`` for ``--tenant`` (its worker, and so torch, load only if used)."""
    overrides: dict[str, Any] = {k: v for k, v in (("home", args.home and Path(args.home)), ("tenant", args.tenant))
                                 if v}
    return KVClient(config=ClientConfig(**overrides, **extra))


def manifest_summary(m: Manifest) -> dict[str, Any]:
    """The fields ``ls`` shows of a prefix."""
    return {"prefix_id": m.prefix_id, "n_tokens": m.n_tokens, "model": m.model_name, "kv_bytes": m.kv_bytes,
            "artifact_bytes": m.artifact_bytes, "created_at": m.created_at}


def cmd_ls(args: argparse.Namespace) -> list[dict[str, Any]]:
    """List stored prefixes, each with whether its page files are all there (``verify`` reads them)."""
    kv = store_client(args)
    rows = []
    for m in kv.ls():
        problem = kv.health(m.prefix_id, summaries=False).problem  # a stat per page file: cheap for many prefixes
        rows.append({**manifest_summary(m), "status": "ok" if problem is None else "damaged", "problem": problem})
    if not args.json:
        for r in rows:
            print(f"{r['prefix_id']}  {r['n_tokens']:>8} tok  {r['kv_bytes'] / 2**20:9.2f} MiB  {r['status']:<7}  "
                  f"{r['model']}" + (f"  ({r['problem']})" if r["problem"] else ""))
        if any(r["problem"] for r in rows):
            print("damaged prefixes cannot be decoded: `kvstash rm ID` them, or `kvstash store check --repair`")
    return rows


def _print_health(h: PrefixHealth) -> None:
    checked = "every page read and hashed" if h.verified else "sizes and summaries; `kvstash verify ID` reads pages"
    print(f"health: {'ok' if h.ok else 'DAMAGED: ' + str(h.problem)} ({checked})"
          + (f"; in use by {h.leases} generation(s)" if h.leases else ""))


def compressed_caches(m: Manifest) -> list[dict[str, Any]]:
    """The compressed caches a prefix holds: method, kept ratio, version and bytes, one per artifact."""
    out = []
    for a in m.artifacts:
        if (c := parse_cache_artifact(a.name)) is not None:
            out.append({"method": c.method, "ratio": c.ratio, "version": c.version, "bytes": a.size})
    return out


def cmd_info(args: argparse.Namespace) -> dict[str, Any]:
    """Show a prefix's manifest, sizes, artifacts and health."""
    kv = store_client(args)
    m = kv.info(args.prefix_id)
    health = kv.health(args.prefix_id)
    d = {**manifest_summary(m), "layout": m.layout.to_dict(), "tenant": m.tenant, "state": m.state,
         "model_fingerprint": m.key.model_fingerprint, "files": [asdict(f) for f in m.files],
         "artifacts": [asdict(a) for a in m.artifacts], "compressed": compressed_caches(m),
         "health": health.to_json()}
    if not args.json:
        print(json.dumps({k: v for k, v in d.items() if k != "health"}, indent=2))
        _print_health(health)
    return d


def cmd_verify(args: argparse.Namespace) -> dict[str, Any]:
    """Read every page file of a prefix and check it against the manifest's digests."""
    health = store_client(args).health(args.prefix_id, verify=True)
    if not args.json:
        _print_health(health)
    args.exit_code = 0 if health.ok else EXIT_PROBLEMS
    return {"prefix_id": args.prefix_id, **health.to_json()}


def cmd_rm(args: argparse.Namespace) -> dict[str, Any]:
    """Delete a stored prefix (refused while a generation reads it, unless --force)."""
    store_client(args).rm(args.prefix_id, force=args.force, wait_s=args.wait)
    if not args.json:
        print(f"removed {args.prefix_id}")
    return {"removed": args.prefix_id}


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


def add_store_commands(sub: Any, store_opts: argparse.ArgumentParser, json_opt: argparse.ArgumentParser) -> None:
    """Add ``ls``, ``info``, ``verify``, ``rm`` and ``store check`` (none takes --model or --device)."""
    s = sub.add_parser("ls", parents=[store_opts], help="list stored prefixes (with a damaged/ok status)",
                       description="List this tenant's stored prefixes, newest first.")
    s.set_defaults(func=cmd_ls)
    s = sub.add_parser("info", parents=[store_opts], help="show a prefix's manifest and health",
                       description="A prefix's manifest, sizes, artifacts and health (page files present at their "
                                   "sizes, summaries intact); `kvstash verify` also reads every page.")
    s.add_argument("prefix_id", help="32 hex characters, from `kvstash prefill` or `kvstash ls`")
    s.set_defaults(func=cmd_info)
    s = sub.add_parser("verify", parents=[store_opts], help="read and check every page of a prefix",
                       description="Hash every page file of a prefix against its manifest and check its summaries. "
                                   f"Exit status {EXIT_PROBLEMS} when damaged.")
    s.add_argument("prefix_id", help="32 hex characters")
    s.set_defaults(func=cmd_verify)
    s = sub.add_parser("rm", parents=[store_opts], help="delete a stored prefix",
                       description="Delete a prefix and its files. Refused while a generation reads it (holds a "
                                   "lease) unless --wait lets it finish or --force deletes under it.")
    s.add_argument("prefix_id", help="32 hex characters")
    s.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to this many seconds for generations reading the prefix to finish (default 0)")
    s.add_argument("--force", action="store_true",
                   help="delete even while generations read it (they fail mid-answer)")
    s.set_defaults(func=cmd_rm)
    check_opts = argparse.ArgumentParser(add_help=False, parents=[json_opt])
    check_opts.add_argument("--home", help="data directory (default $KVSTASH_HOME or ~/.cache/kvstash)")
    check_opts.add_argument("--metadata-url", default=None,
                            help="redis://host:port/db (default: LMDB in the data dir)")
    store_sub = sub.add_parser("store", help="maintain the data directory").add_subparsers(
        dest="store_command", required=True, metavar="{check}")
    s = store_sub.add_parser("check", parents=[check_opts],
                             help="report (and with --repair fix) metadata and prefix directories that disagree",
                             description=f"Exit status {EXIT_PROBLEMS} when problems remain.")
    s.add_argument("--repair", action="store_true",
                   help="register committed directories, drop dangling entries, remove orphans and damaged prefixes")
    s.add_argument("--quick", action="store_true", help="do not re-hash page files (sizes are still checked)")
    s.set_defaults(func=cmd_store_check)
