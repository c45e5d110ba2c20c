"""KVClient: prefill a document once, then ask it many questions (embedded, or through deployed services).

Remote clients import no torch: the store and worker are imported when an embedded client is made.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from client.backends import Backend, remote_backend
from client.config import ClientConfig
from store.errors import CorruptData, InvalidInput, PrefixInUse
from store.manifest import Manifest
from workers.model_source import local_model_problem, trained_context
from workers.requests import (
    LIMITS,
    QUERY_PAGES,
    DecodeConfig,
    GenerateRequest,
    GenerationStats,
    PrefillRequest,
    SamplingParams,
)

if TYPE_CHECKING:
    from workers.engine import Worker
    from workers.model import LoadedModel

LEASE_POLL_S = 0.5
"""How often ``rm --wait`` looks again at a prefix's leases."""


class UsageWarning(UserWarning):
    """A request kvstash carries out but that is likely not what the caller meant (the CLI prints it as one line)."""


@dataclass(frozen=True)
class PrefixHealth:
    """Whether a stored prefix can be decoded: what was checked, and what is wrong if anything."""

    prefix_id: str
    problem: str | None
    """None: nothing wrong found."""
    verified: bool
    """True: every page file was read and hashed; False: only sizes and summaries were checked."""
    leases: int
    """Live leases: generations reading it now."""

    @property
    def ok(self) -> bool:
        """Nothing wrong was found."""
        return self.problem is None

    def to_json(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {"ok": self.ok, "problem": self.problem, "verified": self.verified, "leases": self.leases}


FULL_METHOD = "full"
"""The exact-attention method, which reads every prefix token whatever the budget."""


class Generation:
    """A streamed answer: iterate for text pieces, or read ``.text`` for all of it."""

    def __init__(self, pieces: Iterator[str], stats: GenerationStats):
        self._pieces, self.stats = pieces, stats
        self._parts: list[str] = []
        self._done = False

    def __iter__(self) -> Iterator[str]:
        for piece in self._pieces:
            self._parts.append(piece)
            yield piece
        self._done = True

    @property
    def text(self) -> str:
        """The whole answer (finishes the generation if it is still running)."""
        if not self._done:
            for _ in self:
                pass
        return "".join(self._parts)

    def close(self) -> None:
        """Stop the generation now and release what it holds (its prefix lease, its fetch engines)."""
        close = getattr(self._pieces, "close", None)
        if close is not None:
            close()

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Generation({self.text!r})"


@dataclass(frozen=True)
class PrefixHandle:
    """A stored prefix: its id and size, and whether prefill found it already stored."""

    prefix_id: str
    n_tokens: int
    cached: bool
    client: KVClient

    def generate(self, query: str, **kwargs: Any) -> Generation:
        """Ask this prefix a question (see ``KVClient.generate``)."""
        return self.client.generate(query, prefix=self, **kwargs)


class EmbeddedBackend:
    """Store + worker in this process; no server to start."""

    def __init__(self, config: ClientConfig):
        from store.config import StoreConfig
        from store.kvstore import KVStore

        self.config = config
        self.store = KVStore(StoreConfig(home=config.home, page_size=config.page_size))
        self._worker: Worker | None = None

    @property
    def worker(self) -> Worker:
        """The in-process worker (loads the model on first use)."""
        if self._worker is None:
            lm = _load_model(self.config)  # first: a bad model name or device fails before the engine is imported
            from workers.engine import Worker

            self._worker = Worker(self.store, lm, progress=self.config.progress,
                                  offload=self.config.resolved_offload())
        return self._worker

    def prefill(self, req: PrefillRequest) -> tuple[str, int, bool]:
        """Prefill in process (a UsageWarning first when the document is longer than the model was trained on)."""
        worker = self.worker
        trained = trained_context(worker.lm.name)
        if trained is not None and (n := len(worker.tokenize_document(req.document))) > trained:
            warnings.warn(f"the document has {n} tokens; model {worker.lm.name} was trained on up to {trained}: "
                          "answers beyond that length are unreliable", UsageWarning, stacklevel=3)
        r = worker.prefill(req.document, tenant=self.config.tenant, compress=req.compress)
        return r.prefix_id, r.n_tokens, r.cached

    def generate(self, req: GenerateRequest, stats: GenerationStats) -> Iterator[str]:
        """Generate in process."""
        return self.worker.generate(req.prefix_id, req.query, req.sampling, method=req.method, decode=req.decode,
                                    tenant=self.config.tenant, stats=stats, raw=req.raw)

    def list(self) -> list[Manifest]:
        """This tenant's prefixes."""
        return self.store.list_prefixes(self.config.tenant)

    def manifest(self, prefix_id: str) -> Manifest:
        """A manifest this tenant may see."""
        return self.store.visible(prefix_id, self.config.tenant)

    def remove(self, prefix_id: str, *, force: bool = False, wait_s: float = 0.0) -> None:
        """Delete after checking visibility; PrefixInUse while a generation holds a lease on it (after waiting up
        to ``wait_s`` for the leases to end) unless ``force``."""
        self.manifest(prefix_id)
        deadline = time.monotonic() + wait_s
        while not force and (leases := self.store.leases(prefix_id)):
            if time.monotonic() >= deadline:
                left = max(le.expires_at for le in leases) - time.time()
                raise PrefixInUse(f"prefix {prefix_id} is in use: {len(leases)} generation(s) read it (held by "
                                  f"{', '.join(sorted({le.holder for le in leases}))}; the last lease lapses in "
                                  f"{max(0.0, left):.0f} s unless renewed); wait for them, pass --wait SECONDS, "
                                  "or --force to delete under them")
            time.sleep(LEASE_POLL_S)
        try:  # a generation may have started since the check: the delete itself refuses a leased prefix
            self.store.remove(prefix_id, unless_leased=not force)
        except PrefixInUse as e:
            raise PrefixInUse(f"prefix {prefix_id} is in use: a generation started reading it; retry, or --force "
                              "to delete under it") from e

    def health(self, prefix_id: str, *, verify: bool = False, summaries: bool = True) -> PrefixHealth:
        """Check a prefix this tenant may see: page file sizes, its summaries (unless told not to), and with
        ``verify`` every page's bytes against the manifest's digests."""
        self.manifest(prefix_id)
        problem = self.store.quick_check(prefix_id, artifacts=summaries or verify)
        if problem is None and verify:
            try:
                self.store.verify(prefix_id)
            except (CorruptData, FileNotFoundError) as e:
                problem = str(e)
        return PrefixHealth(prefix_id, problem, verify, len(self.store.leases(prefix_id)))


def _load_model(config: ClientConfig) -> LoadedModel:
    """The model ``config`` names, on its device; InvalidInput saying why when it cannot be loaded."""
    name = config.resolved_model()
    if (problem := local_model_problem(name)) is not None:
        raise InvalidInput(problem)
    device = config.resolved_device()
    from workers.model import load_model

    try:
        return load_model(name, device=device, dtype=config.resolved_dtype(), page_size=config.page_size,
                          progress=config.progress)
    except (OSError, ValueError, KeyError, ImportError, RuntimeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InvalidInput(f"cannot load model {name!r}: {first}") from e


class KVClient:
    """Prefill documents once, then ask them questions: embedded by default, or remote.

    ``KVClient()`` runs store + worker in this process. ``KVClient("grpc://worker:50052")`` or
    ``KVClient("http://gateway:8000")`` talk to deployed services with the same methods.
    """

    def __init__(self, target: str | None = None, *, config: ClientConfig | None = None,
                 api_key: str | None = None, **overrides: Any):
        if unknown := set(overrides) - {f.name for f in fields(ClientConfig)}:
            raise TypeError(f"unknown ClientConfig fields: {sorted(unknown)}")
        self._given, self._overrides = config, overrides
        self._config: ClientConfig | None = None
        self.backend: Backend
        if target in (None, "embedded"):
            self.backend = EmbeddedBackend(self.config)
        else:
            self.backend = remote_backend(target, api_key)
        self.last_prefix: PrefixHandle | None = None

    @property
    def config(self) -> ClientConfig:
        """The embedded settings (built on first use, so a remote client never probes for a GPU)."""
        if self._config is None:
            self._config = replace(self._given or ClientConfig(), **self._overrides)
        return self._config

    @property
    def worker(self) -> Worker:
        """The in-process worker (embedded mode only)."""
        if not isinstance(self.backend, EmbeddedBackend):
            raise InvalidInput("this client talks to a remote worker")
        return self.backend.worker

    def prefill(self, document: str, *, compress: Sequence[str] = ()) -> PrefixHandle:
        """Store a document's KV cache (a cache hit when it is already stored); ``compress`` names compression
        methods (``kvzip``, ``hybridkv``) whose scores to compute now rather than on first use."""
        pid, n, cached = self.backend.prefill(PrefillRequest(document=document, compress=tuple(compress)))
        self.last_prefix = PrefixHandle(pid, n, cached, self)
        return self.last_prefix

    def prefill_file(self, path: str | Path, *, compress: Sequence[str] = ()) -> PrefixHandle:
        """Prefill the UTF-8 text of a file."""
        return self.prefill(Path(path).read_text(encoding="utf-8"), compress=compress)

    def generate(self, query: str, prefix: PrefixHandle | str | None = None, *,
                 max_new_tokens: int = LIMITS.max_new_tokens_default, method: str = LIMITS.method_default,
                 budget: float | None = None, temperature: float = LIMITS.temperature_default,
                 top_p: float = LIMITS.top_p_default, seed: int | None = None,
                 stop: tuple[str, ...] | list[str] = (), raw: bool = False,
                 gen_len: int = LIMITS.gen_len_default, budget_tokens: int | None = None,
                 ratio: float | None = None, query_pages: str = QUERY_PAGES[0]) -> Generation:
        """Answer ``query`` over a stored prefix (default: the one this client prefilled last).

        ``budget_tokens`` is how many prefix KV entries per KV head a query-time cache (``snapkv``,
        ``lookahead``) keeps once the query is in.

        ``raw`` sends the query text as-is instead of through the model's query template;
        ``gen_len`` is the number of steps a method's one-time summary fetch is amortized over
        when its budget is matched (1: the conservative worst case); ``ratio`` is the fraction of the
        prefix's KV pairs a compression method's cache keeps (kvzip, hybridkv, streamingllm);
        ``query_pages="shared"`` lets the query's tokens share one page selection per chunk (page methods: fewer
        pages read before the first token; every interface carries it).
        """
        req = GenerateRequest(prefix_id=self._prefix_id(prefix), query=query, method=method, raw=raw,
                              decode=DecodeConfig(budget=budget, budget_tokens=budget_tokens, ratio=ratio,
                                                  gen_len=gen_len, query_pages=query_pages),
                              sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                                      top_p=top_p, seed=seed, stop=tuple(stop)))
        if budget is not None and method == FULL_METHOD:  # after validation: an invalid budget is an error only
            warnings.warn(f"method {FULL_METHOD!r} reads the whole prefix: the budget {budget:g} is ignored "
                          "(pick a sparse method to apply it)", UsageWarning, stacklevel=2)
        stats = GenerationStats()
        return Generation(self.backend.generate(req, stats), stats)

    def _prefix_id(self, prefix: PrefixHandle | str | None) -> str:
        if isinstance(prefix, PrefixHandle):
            return prefix.prefix_id
        if isinstance(prefix, str):
            return prefix
        if self.last_prefix is None:
            raise InvalidInput("no prefix given and this client has not prefilled one yet")
        return self.last_prefix.prefix_id

    def ls(self) -> list[Manifest]:
        """Stored prefixes of this client's tenant, newest first."""
        return self.backend.list()

    def info(self, prefix_id: str) -> Manifest:
        """The manifest of a stored prefix."""
        return self.backend.manifest(prefix_id)

    def rm(self, prefix_id: str, *, force: bool = False, wait_s: float = 0.0) -> None:
        """Delete a stored prefix and every file of it. Embedded: PrefixInUse while a generation reads it (after
        waiting up to ``wait_s`` seconds for it to end), unless ``force``."""
        if isinstance(self.backend, EmbeddedBackend):
            self.backend.remove(prefix_id, force=force, wait_s=wait_s)
        elif force or wait_s:
            raise InvalidInput("force and wait_s apply to an embedded store (the server decides for a remote one)")
        else:
            self.backend.remove(prefix_id)

    def health(self, prefix_id: str, *, verify: bool = False, summaries: bool = True) -> PrefixHealth:
        """Whether a stored prefix is intact (embedded only): page file sizes, summaries (unless told not to), and
        with ``verify`` every page's bytes."""
        if not isinstance(self.backend, EmbeddedBackend):
            raise InvalidInput("health checks read the store's files: they need an embedded client")
        return self.backend.health(prefix_id, verify=verify, summaries=summaries)
