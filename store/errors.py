"""Typed errors of kvstash, with the gRPC status and HTTP code each maps to (one table)."""

from __future__ import annotations


class KVStashError(Exception):
    """Base of every error kvstash raises on purpose."""

    grpc_code = "INTERNAL"
    http_status = 500


class InvalidInput(KVStashError):
    """The caller's input is malformed or empty."""

    grpc_code = "INVALID_ARGUMENT"
    http_status = 400


class PrefixNotFound(KVStashError):
    """No committed prefix with that id (or not visible to this tenant)."""

    grpc_code = "NOT_FOUND"
    http_status = 404


class ModelMismatch(KVStashError):
    """The prefix was saved by a different model than the one asked to decode it."""

    grpc_code = "FAILED_PRECONDITION"
    http_status = 409


class ContextTooLong(KVStashError):
    """The document (plus query and generation) exceeds the model's context."""

    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 413


class CorruptData(KVStashError):
    """Stored bytes failed verification (checksum, size or identity); never decoded."""

    grpc_code = "DATA_LOSS"
    http_status = 500


class StoreUnavailable(KVStashError):
    """The data directory cannot be used (not writable, missing, locked)."""

    grpc_code = "UNAVAILABLE"
    http_status = 503


class Unauthenticated(KVStashError):
    """Missing or unknown API key."""

    grpc_code = "UNAUTHENTICATED"
    http_status = 401


class TooLarge(KVStashError):
    """A request body or document over the configured limit."""

    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 413


class UnknownMethod(InvalidInput):
    """The requested sparse/compression method is not registered."""


class LockTimeout(KVStashError):
    """A per-prefix lock could not be taken in time: another writer or evictor holds it."""

    grpc_code = "ABORTED"
    http_status = 409


class QuotaExceeded(KVStashError):
    """A write would take a tenant over its quota (stored bytes or prefixes), or the store over its capacity."""

    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 429


class PrefixInUse(KVStashError):
    """The prefix is being read (a live lease: a generation decodes it), so it is not removed now."""

    grpc_code = "FAILED_PRECONDITION"
    http_status = 409


class Overloaded(KVStashError):
    """Capacity pressure: too many generations in flight (for this tenant or in all); retry after a while."""

    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 429

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = max(1, int(retry_after_s))


class Cancelled(KVStashError):
    """The caller went away (cancelled the call or passed its deadline) before the work finished."""

    grpc_code = "CANCELLED"
    http_status = 499


class StoreFull(QuotaExceeded):
    """The data directory has too little free disk space for a write."""

    http_status = 507
