"""The ``kvstash`` command line: prefill, generate, eval, ls, info, verify, rm, budget, store check.

Start-up imports no torch: commands that need no model (``--help``, ``ls``, ``info``, ``rm``, ``verify``,
``budget``, ``store check``, and every argument error) stay fast; ``prefill``/``generate``/``eval`` load it.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from client.cli_budget import add_budget_command
from client.cli_errors import EXIT_MEANINGS, Parser, UsageError, failure_of, report
from client.cli_model import add_model_commands
from client.cli_store import add_store_commands
from client.kvclient import UsageWarning

EXIT_STATUS_HELP = "exit status:\n" + "\n".join(f"  {n:<4} {what}" for n, what in EXIT_MEANINGS) + """
Errors are one `kvstash: error: ...` line on stderr; with --json also {"error", "code", "exit_status"} on stdout.

The default model is the shipped models/kvstash-tiny, which answers only the synthetic task formats
(see README.md); --model or $KVSTASH_MODEL names any Hugging Face causal LM (hub id or local path)."""


def version() -> str:
    """The installed package's version (the source tree's when not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("kvstash")
    except PackageNotFoundError:
        return "0.1.0 (source tree)"


def _option_groups() -> tuple[argparse.ArgumentParser, ...]:
    """Shared options: --json (all); + --home, --tenant (store commands); + --model, --device (model commands)."""
    json_opt = argparse.ArgumentParser(add_help=False)
    json_opt.add_argument("--json", action="store_true", help="machine-readable output (errors too)")
    store_opts = argparse.ArgumentParser(add_help=False, parents=[json_opt])
    store_opts.add_argument("--home", metavar="DIR", help="data directory (default $KVSTASH_HOME or ~/.cache/kvstash)")
    store_opts.add_argument("--tenant", help="tenant namespace (default: default)")
    model_opts = argparse.ArgumentParser(add_help=False, parents=[store_opts])
    model_opts.add_argument("--model", metavar="NAME_OR_PATH",
                            help="Hugging Face hub id or local model directory (default $KVSTASH_MODEL, else the "
                                 "shipped models/kvstash-tiny)")
    model_opts.add_argument("--device", metavar="DEVICE",
                            help="cpu, cuda or cuda:N (default: cuda when a GPU is visible, else cpu)")
    return json_opt, store_opts, model_opts


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    json_opt, store_opts, model_opts = _option_groups()
    p = Parser(prog="kvstash", description="Prefill long documents once; ask them many questions.",
               epilog=EXIT_STATUS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"kvstash {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    add_model_commands(sub, model_opts)
    add_budget_command(sub, json_opt)
    add_store_commands(sub, store_opts, json_opt)
    return p


def _parse(argv: list[str]) -> argparse.Namespace:
    """Parsed arguments; UsageError naming the subcommand for options it does not take (``ls --model``)."""
    args, extra = build_parser().parse_known_args(argv)
    if extra:
        prog = " ".join(["kvstash", args.command, *([args.store_command] if args.command == "store" else [])])
        raise UsageError(f"{prog}: unrecognized arguments: {' '.join(extra)} (see `{prog} --help` for what it "
                         "takes)")
    return args


def _on_sigint(signum: int, frame: Any) -> None:
    """The first Ctrl-C interrupts; later ones are ignored, so the clean-up it starts runs to its end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


@contextmanager
def _warnings_as_lines(sink: list[str]) -> Iterator[None]:
    """kvstash's UsageWarnings as one ``kvstash: warning:`` line per distinct message (and into ``sink`` for
    --json)."""
    def show(message: Warning | str, category: type[Warning], *rest: Any, **kw: Any) -> None:
        if issubclass(category, UsageWarning):
            if str(message) not in sink:  # once per command, however many requests it makes (eval)
                sink.append(str(message))
                print(f"kvstash: warning: {message}", file=sys.stderr, flush=True)
        else:
            shown(message, category, *rest, **kw)

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always", UsageWarning)
        warnings.showwarning = show
        yield


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvstash`` command; returns its exit status."""
    argv = sys.argv[1:] if argv is None else argv
    as_json = "--json" in argv
    before = signal.getsignal(signal.SIGINT)
    if before is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
    said: list[str] = []
    try:
        args = _parse(argv)
        as_json = args.json
        func: Callable[[argparse.Namespace], Any] = args.func
        with _warnings_as_lines(said):
            result = func(args)
    except (Exception, KeyboardInterrupt) as e:
        return report(failure_of(e), as_json, e)
    finally:
        signal.signal(signal.SIGINT, before)
    if as_json:
        if said and isinstance(result, dict):
            result = {**result, "warnings": said}
        print(json.dumps(result))
    return int(getattr(args, "exit_code", 0))


__all__ = ["main", "build_parser", "UsageError"]

if __name__ == "__main__":
    sys.exit(main())
