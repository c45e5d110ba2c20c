"""How the ``kvstash`` command fails: one ``kvstash: error: ...`` line, a JSON error object under ``--json``, and
a stable exit status per kind of failure (the table below, also in README.md)."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import traceback
from dataclasses import dataclass
from typing import NoReturn

from store.errors import KVStashError

EXIT_OK = 0
EXIT_PROBLEMS = 1
"""``store check`` / ``verify``: the store or a prefix has problems (the command itself worked)."""
EXIT_USAGE = 2
"""Bad arguments or input: unknown option, bad value, missing file, empty document, unknown method."""
EXIT_NOT_FOUND = 3
"""No such prefix (or not this tenant's)."""
EXIT_CONFLICT = 4
"""The prefix is in use or locked (``rm`` while a generation reads it), or was saved by another model."""
EXIT_NO_ROOM = 5
"""Out of room: disk full, quota, store capacity, document longer than the model's context."""
EXIT_DATA_LOSS = 6
"""Stored bytes failed their checksums."""
EXIT_UNAVAILABLE = 7
"""The data directory, metadata store, model or server cannot be used (I/O error, unreachable server)."""
EXIT_INTERNAL = 70
"""A bug: an error kvstash did not expect (``KVSTASH_DEBUG=1`` prints its traceback)."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (SIGINT): whatever was being written is discarded."""

EXIT_BY_CODE = {
    "INVALID_ARGUMENT": EXIT_USAGE,
    "NOT_FOUND": EXIT_NOT_FOUND,
    "FAILED_PRECONDITION": EXIT_CONFLICT,
    "ABORTED": EXIT_CONFLICT,
    "RESOURCE_EXHAUSTED": EXIT_NO_ROOM,
    "DATA_LOSS": EXIT_DATA_LOSS,
    "UNAVAILABLE": EXIT_UNAVAILABLE,
    "UNAUTHENTICATED": EXIT_UNAVAILABLE,
    "PERMISSION_DENIED": EXIT_UNAVAILABLE,
    "DEADLINE_EXCEEDED": EXIT_UNAVAILABLE,
    "CANCELLED": EXIT_INTERRUPTED,
    "INTERNAL": EXIT_INTERNAL,
}
"""Exit status of each error code (the gRPC status names kvstash's typed errors carry)."""
DEBUG_ENV = "KVSTASH_DEBUG"
EXIT_MEANINGS: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "success"),
    (EXIT_PROBLEMS, "`store check` / `verify` found problems"),
    (EXIT_USAGE, "bad arguments or input (unknown option or value, missing file, empty document)"),
    (EXIT_NOT_FOUND, "no such prefix"),
    (EXIT_CONFLICT, "prefix in use or locked (`rm` while a generation reads it), or saved by another model"),
    (EXIT_NO_ROOM, "no room: disk full, quota or capacity, document longer than the model's context"),
    (EXIT_DATA_LOSS, "stored data failed its checksums"),
    (EXIT_UNAVAILABLE, "data directory, metadata store or model unusable (I/O error)"),
    (EXIT_INTERNAL, f"internal error ({DEBUG_ENV}=1 prints the traceback)"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C); nothing is left half-written"),
)
"""Every exit status the command uses, in words (``kvstash --help`` and README.md list them)."""


@dataclass(frozen=True)
class CliFailure:
    """One failure as the user sees it."""

    message: str
    code: str

    @property
    def exit_status(self) -> int:
        """The process exit status."""
        return EXIT_BY_CODE.get(self.code, EXIT_INTERNAL)


class UsageError(Exception):
    """A command line argparse rejected."""


class Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are raised (one line, JSON with ``--json``) instead of printed with usage."""

    def error(self, message: str) -> NoReturn:
        """Raise instead of printing the usage and exiting."""
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")


_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def os_failure(e: OSError) -> CliFailure:
    """A file-system error in words: what happened, to which path."""
    where = f" ({e.filename})" if e.filename else ""
    if e.errno in _DISK_FULL:
        return CliFailure(f"disk full: {os.strerror(e.errno)}{where}; nothing was stored (free some space, or "
                          "`kvstash rm` old prefixes)", "RESOURCE_EXHAUSTED")
    if isinstance(e, FileNotFoundError):
        return CliFailure(f"no such file or directory: {e.filename or e}", "INVALID_ARGUMENT")
    if isinstance(e, IsADirectoryError):
        return CliFailure(f"is a directory, not a file: {e.filename or e}", "INVALID_ARGUMENT")
    if isinstance(e, PermissionError):
        return CliFailure(f"permission denied: {e.filename or e}", "UNAVAILABLE")
    return CliFailure(f"{e.strerror or e}{where}", "UNAVAILABLE")


def failure_of(e: BaseException) -> CliFailure:
    """What the user is told about an exception that ended a command."""
    if isinstance(e, KeyboardInterrupt):
        return CliFailure("interrupted; nothing was left half-written", "CANCELLED")
    if isinstance(e, UsageError):
        return CliFailure(str(e), "INVALID_ARGUMENT")
    if isinstance(e, KVStashError):
        code = getattr(e, "grpc_code", "INTERNAL")
        cause = e.__cause__
        if isinstance(cause, OSError) and cause.errno in _DISK_FULL:  # e.g. a write the store wrapped
            return os_failure(cause)
        return CliFailure(str(e), code)
    if isinstance(e, OSError):
        return os_failure(e)
    if isinstance(e, UnicodeDecodeError):
        return CliFailure(f"input is not UTF-8 text ({e.reason} at byte {e.start})", "INVALID_ARGUMENT")
    detail = str(e).strip().splitlines()
    return CliFailure(f"internal error: {type(e).__name__}: {detail[0] if detail else ''} (set {DEBUG_ENV}=1 for "
                      "the traceback)", "INTERNAL")


def report(failure: CliFailure, as_json: bool, exc: BaseException | None = None) -> int:
    """Print ``failure`` (one stderr line; a JSON object on stdout too under ``--json``); its exit status."""
    if exc is not None and os.environ.get(DEBUG_ENV):
        traceback.print_exception(exc)
    if as_json:
        print(json.dumps({"error": failure.message, "code": failure.code, "exit_status": failure.exit_status}),
              flush=True)
    kind = "" if failure.code == "CANCELLED" else "error: "
    print(f"kvstash: {kind}{failure.message}", file=sys.stderr, flush=True)
    return failure.exit_status
