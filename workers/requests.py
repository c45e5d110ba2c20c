"""What a prefill or a generation asks for, the bounds of every field, and what a generation reports.

One vocabulary for every front door (CLI, ``KVClient``, gateway, gRPC servers, worker); it imports no
torch. Values check themselves when built (``InvalidInput``, messages that never echo long input).
JSON conversion for the REST wire is here; protobuf conversion is in ``services/convert.py``.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from store.errors import InvalidInput
from workers.methods.compressed_names import PREFILL_SCORERS

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


@dataclass(frozen=True, kw_only=True)
class RequestLimits:
    """Bounds and defaults of every request field, declared once for the CLI, gateway, servers and worker."""

    method_default: str = "full"
    """Exact attention over the whole prefix."""
    budget_max: float = 1.0
    """A read budget is a fraction of the prefix in (0, budget_max]."""
    ratio_max: float = 1.0
    """A compressed cache keeps a fraction in (0, ratio_max] of the prefix's KV pairs."""
    sink_default: int = 4
    """Leading prefix tokens always attended exactly."""
    tail_default: int = 16
    """Trailing prefix tokens always attended exactly."""
    anchor_max: int = 1 << 24
    """Largest sink or tail (anchors longer than the prefix just cover all of it)."""
    budget_tokens_max: int = 1 << 20
    """Most prefix KV entries per KV head a query-time cache (snapkv, lookahead) may keep."""
    gen_len_default: int = 1
    """1: a one-time summary fetch is charged to a single step (the conservative worst case)."""
    gen_len_max: int = INT32_MAX
    """The wire carries gen_len as int32."""
    max_new_tokens_default: int = 64
    max_new_tokens_cap: int = 1 << 16
    """Most tokens one request may ask for (a worker may be configured with a lower cap)."""
    temperature_default: float = 0.0
    """Greedy."""
    temperature_max: float = 100.0
    temperature_floor: float = 1e-6
    """Temperatures under this are greedy: dividing logits by a denormal overflows to inf."""
    top_p_default: float = 1.0
    """No nucleus cut."""
    seed_max: int = INT64_MAX
    """Seeds are in [0, seed_max] (the wire carries them as int64)."""
    stop_max_count: int = 16
    stop_max_chars: int = 256
    query_max_chars: int = 1 << 20
    method_max_chars: int = 64
    prefix_id_max_chars: int = 128
    compress_max_count: int = len(PREFILL_SCORERS)
    """Most methods one prefill may score up front (each at most once)."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_new_tokens_default <= self.max_new_tokens_cap <= INT32_MAX:
            raise ValueError("need 1 <= max_new_tokens_default <= max_new_tokens_cap <= 2**31 - 1")
        if not 1 <= self.gen_len_default <= self.gen_len_max <= INT32_MAX:
            raise ValueError("need 1 <= gen_len_default <= gen_len_max <= 2**31 - 1")
        if not 0 <= max(self.sink_default, self.tail_default) <= self.anchor_max:
            raise ValueError("need 0 <= sink_default, tail_default <= anchor_max")


LIMITS = RequestLimits()
"""The bounds every request is checked against."""
QUERY_PAGES = ("token", "shared")
"""``DecodeConfig.query_pages`` values, the default first."""


def _show(value: object) -> str:
    """A value for an error message, cut short so hostile input is never echoed whole."""
    try:
        r = repr(value)
    except ValueError:  # an int past Python's digit limit
        return f"<{type(value).__name__}>"
    return r if len(r) <= 40 else r[:37] + "..."


def _int(name: str, value: object, lo: int, hi: int) -> int:
    """``value`` as an int in [lo, hi] (bools and floats are not ints)."""
    if isinstance(value, bool):
        raise InvalidInput(f"{name} must be an integer, got {_show(value)}")
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidInput(f"{name} must be an integer, got {_show(value)}") from None
    if not lo <= n <= hi:
        raise InvalidInput(f"{name} must be in [{lo}, {hi}], got {_show(n)}")
    return n


def _real(name: str, value: object) -> float:
    """``value`` as a finite float (NaN and infinities are errors)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidInput(f"{name} must be a number, got {_show(value)}")
    try:
        x = float(value)
    except OverflowError:
        raise InvalidInput(f"{name} must be finite") from None
    if not math.isfinite(x):
        raise InvalidInput(f"{name} must be finite, got {x}")
    return x


def _text(name: str, value: object, max_chars: int) -> str:
    """``value`` as a string of at most ``max_chars`` characters."""
    if not isinstance(value, str):
        raise InvalidInput(f"{name} must be a string, got {type(value).__name__}")
    if len(value) > max_chars:
        raise InvalidInput(f"{name} is longer than {max_chars} characters")
    return value


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # normalizing a frozen dataclass's own field in __post_init__


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick tokens and when to stop."""

    max_new_tokens: int = LIMITS.max_new_tokens_default
    temperature: float = LIMITS.temperature_default
    """0 means greedy."""
    top_p: float = LIMITS.top_p_default
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _set(self, "max_new_tokens", _int("max_new_tokens", self.max_new_tokens, 1, LIMITS.max_new_tokens_cap))
        t = _real("temperature", self.temperature)
        if not 0 <= t <= LIMITS.temperature_max:
            raise InvalidInput(f"temperature must be in [0, {LIMITS.temperature_max}], got {t}")
        _set(self, "temperature", 0.0 if t < LIMITS.temperature_floor else t)
        p = _real("top_p", self.top_p)
        if not 0 < p <= 1:
            raise InvalidInput(f"top_p must be in (0, 1], got {p}")
        _set(self, "top_p", p)
        if self.seed is not None:
            _set(self, "seed", _int("seed", self.seed, 0, LIMITS.seed_max))
        _set(self, "stop", _stops(self.stop))


def _stops(stop: object) -> tuple[str, ...]:
    """Stop strings as a tuple: a bounded number of non-empty, bounded strings."""
    if isinstance(stop, str) or not isinstance(stop, (list, tuple)):
        raise InvalidInput("stop must be a list of strings")
    if len(stop) > LIMITS.stop_max_count:
        raise InvalidInput(f"at most {LIMITS.stop_max_count} stop strings")
    for s in stop:
        if not _text("a stop string", s, LIMITS.stop_max_chars):
            raise InvalidInput("stop strings must be non-empty")
    return tuple(stop)


@dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """Per-request decode settings shared by every method."""

    budget: float | None = None
    """Token-equivalent reads per step as a fraction of the prefix (None: the method's default)."""
    sink: int = LIMITS.sink_default
    """Leading prefix tokens always attended exactly."""
    tail: int = LIMITS.tail_default
    """Trailing prefix tokens always attended exactly."""
    budget_tokens: int | None = None
    """Prefix KV entries per KV head a query-time cache (snapkv, lookahead) keeps (None: the method's default)."""
    ratio: float | None = None
    """Compression methods (kvzip, hybridkv, streamingllm): the fraction of the prefix's KV pairs the
    compressed cache keeps (None: the method's default)."""
    gen_len: int = LIMITS.gen_len_default
    """L_gen: decode steps a one-time summary fetch (the φ cache) is amortized over when the budget
    is matched (appendix D); 1 is the paper's conservative worst case."""
    query_pages: str = QUERY_PAGES[0]
    """How the query's own forward picks prefix pages (the whole-page steps of quest, topk and their +phi forms;
    methods that pick tokens or blocks, such as moba, doublep, topk-token, ignore it): ``token``, each query
    token its own (the decode rule); ``shared``, one set per query chunk, the pages with the most mass for any of
    its tokens (fewer pages read before the first token; what the query's tokens attend changes)."""

    def __post_init__(self) -> None:
        if self.budget is not None:
            b = _real("budget", self.budget)
            if not 0 < b <= LIMITS.budget_max:
                raise InvalidInput(f"budget must be in (0, {LIMITS.budget_max}], got {b}")
            _set(self, "budget", b)
        if self.budget_tokens is not None:
            _set(self, "budget_tokens", _int("budget_tokens", self.budget_tokens, 1, LIMITS.budget_tokens_max))
        if self.ratio is not None:
            r = _real("ratio", self.ratio)
            if not 0 < r <= LIMITS.ratio_max:
                raise InvalidInput(f"ratio must be in (0, {LIMITS.ratio_max}], got {r}")
            if round(r, 4) <= 0:
                raise InvalidInput(f"ratio must be at least 0.0001, got {r}")
            _set(self, "ratio", r)
        _set(self, "sink", _int("sink", self.sink, 0, LIMITS.anchor_max))
        _set(self, "tail", _int("tail", self.tail, 0, LIMITS.anchor_max))
        _set(self, "gen_len", _int("gen_len", self.gen_len, 1, LIMITS.gen_len_max))
        if self.query_pages not in QUERY_PAGES:
            raise InvalidInput(f"query_pages must be one of {QUERY_PAGES}, got {_show(self.query_pages)}")

    def check_wire_settings(self) -> None:
        """Refuse sink and tail other than the defaults: the wire does not carry them (remote decode uses those)."""
        if (self.sink, self.tail) != (LIMITS.sink_default, LIMITS.tail_default):
            raise InvalidInput(f"sink and tail are not sent to remote workers (they use {LIMITS.sink_default} "
                               f"and {LIMITS.tail_default})")


@dataclass(frozen=True, kw_only=True)
class PrefillRequest:
    """A document to prefill, as text: servers read no files for a caller (clients read them, e.g.
    ``KVClient.prefill_file``)."""

    document: str
    compress: tuple[str, ...] = ()
    """Compression methods whose scores to compute right after the prefix is stored (``PREFILL_SCORERS``): a
    later generation with one of them at any ratio then builds only its compact cache."""

    def __post_init__(self) -> None:
        if not isinstance(self.document, str):
            raise InvalidInput("document must be a string")
        _set(self, "compress", compress_names(self.compress))

    def to_json(self) -> dict[str, Any]:
        """The REST body (POST /v1/prefixes)."""
        return {"document": self.document, **({"compress": list(self.compress)} if self.compress else {})}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> PrefillRequest:
        """The request a REST body describes (unknown fields are errors; ``file_path`` is refused by name)."""
        if isinstance(body, Mapping) and "file_path" in body:
            raise InvalidInput(FILE_PATH_REFUSED)
        _known_keys(body, ("document", "compress"))
        if body.get("document") is None:
            raise InvalidInput("document is required")
        return cls(document=body["document"], compress=body.get("compress") or ())


def compress_names(names: object) -> tuple[str, ...]:
    """The methods a prefill scores up front, checked (each one of ``PREFILL_SCORERS``, duplicates dropped)."""
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        raise InvalidInput("compress must be a list of method names")
    if len(names) > LIMITS.compress_max_count:
        raise InvalidInput(f"compress names at most {LIMITS.compress_max_count} methods")
    for name in names:
        if name not in PREFILL_SCORERS:
            hint = " (it needs no scores)" if name == "streamingllm" else ""
            raise InvalidInput(f"compress: cannot score {_show(name)} at prefill{hint}; "
                               f"choose from {', '.join(PREFILL_SCORERS)}")
    return tuple(dict.fromkeys(names))


FILE_PATH_REFUSED = ("file_path is not accepted: servers read no files for a caller; send the file's text as "
                     "document (KVClient.prefill_file and `kvstash prefill FILE` read it on the client)")
"""Why a body naming a server-side file is refused (the gateway says the same)."""


GENERATE_JSON_FIELDS = ("query", "method", "budget", "budget_tokens", "ratio", "gen_len", "query_pages",
                        "max_new_tokens", "temperature", "top_p", "seed", "stop", "raw")
"""The fields of a generation's REST body (the prefix id travels in the URL)."""


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """One question over a stored prefix: how to decode it and how to sample the answer."""

    prefix_id: str
    query: str
    method: str = LIMITS.method_default
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    raw: bool = False
    """Send the query as-is instead of through the model's query template."""

    def __post_init__(self) -> None:
        _text("prefix_id", self.prefix_id, LIMITS.prefix_id_max_chars)
        _text("query", self.query, LIMITS.query_max_chars)
        if not _text("method", self.method, LIMITS.method_max_chars):
            raise InvalidInput("method is empty")
        if not isinstance(self.decode, DecodeConfig) or not isinstance(self.sampling, SamplingParams):
            raise InvalidInput("decode and sampling must be DecodeConfig and SamplingParams")
        if not isinstance(self.raw, bool):
            raise InvalidInput("raw must be true or false")

    def to_json(self) -> dict[str, Any]:
        """The REST body of this request (without the prefix id, which is in the URL)."""
        d, s = self.decode, self.sampling
        d.check_wire_settings()
        return {"query": self.query, "method": self.method, "budget": d.budget, "budget_tokens": d.budget_tokens,
                "ratio": d.ratio, "gen_len": d.gen_len, "query_pages": d.query_pages,
                "max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed,
                "stop": list(s.stop), "raw": self.raw}

    @classmethod
    def from_json(cls, prefix_id: str, body: Mapping[str, Any]) -> GenerateRequest:
        """The request a REST body describes: absent or null fields take their defaults, unknown ones are errors."""
        _known_keys(body, GENERATE_JSON_FIELDS)
        b = {k: v for k, v in body.items() if v is not None}
        if "query" not in b:
            raise InvalidInput("query is required")
        return cls(prefix_id=prefix_id, query=b["query"], method=b.get("method", LIMITS.method_default),
                   decode=DecodeConfig(budget=b.get("budget"), budget_tokens=b.get("budget_tokens"),
                                       ratio=b.get("ratio"),
                                       gen_len=b.get("gen_len", LIMITS.gen_len_default),
                                       query_pages=b.get("query_pages", QUERY_PAGES[0])),
                   sampling=SamplingParams(max_new_tokens=b.get("max_new_tokens", LIMITS.max_new_tokens_default),
                                           temperature=b.get("temperature", LIMITS.temperature_default),
                                           top_p=b.get("top_p", LIMITS.top_p_default),
                                           seed=b.get("seed"), stop=b.get("stop", ())),
                   raw=b.get("raw", False))


def _known_keys(body: Mapping[str, Any], known: tuple[str, ...]) -> None:
    if not isinstance(body, Mapping):
        raise InvalidInput("the body must be a JSON object")
    if unknown := set(body) - set(known):
        raise InvalidInput(f"unknown fields: {_show(sorted(unknown))}")


STATS_WIRE_FIELDS = ("steps", "prompt_tokens", "new_tokens", "bytes_fetched", "bytes_full", "seconds", "finish_reason")
"""The counters both wires carry; ``extra`` rides beside them (flattened into the JSON object)."""


@dataclass(kw_only=True)
class GenerationStats:
    """Counters of one generation (filled in while it runs)."""

    steps: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    bytes_fetched: int = 0
    """Every byte of the stored prefix the generation read, all tiers together (GPU page cache, pinned
    host, SSD): per step the tokens attended and the keys selection re-scored (whole pages when
    offloaded), plus the one-time reads, summaries and indexes included (``extra["bytes_summaries"]``)
    and K/V a selector holds (``topk-exact``'s keys). ``workers/methods/reads.py`` is the definition."""
    bytes_full: int = 0
    """What exact attention over the prefix would read over the same steps."""
    seconds: float = 0.0
    finish_reason: str = ""
    token_ids: list[int] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    """Wall time of each decode step (forward + sampling; the sampled token syncs the device). A step launched
    ahead of the host (``workers.step_ahead``) counts from the previous step's tokens to its own: the time
    between tokens, not its launch-to-sync time, part of which overlapped the step before."""
    prefix_tokens_per_step: list[int] = field(default_factory=list)
    """Exact prefix tokens each step attended, summed over layers and KV heads (all of them for "full")."""
    extra: dict[str, float] = field(default_factory=dict)
    """Named counters every interface carries: ``ttft_s`` (from the worker's ``generate`` call, opening the prefix
    included), ``open_s`` (its part before the first step: the prefix's summaries, ``summaries_s``, and the
    generation's setup; summaries that stream in are only started there, and the query's step waits for the
    layers it reaches and for their digest), ``ms_per_token``, ``batch_*``, the tiers' ``offload_*``, and
    ``device_bytes`` (device memory the generation held at its peak; its parts ``device_bytes_<part>``, defined in
    ``workers/device_bytes.py``), among others."""

    def to_json(self) -> dict[str, Any]:
        """The wire counters as one flat JSON object (``extra`` merged in)."""
        return {"steps": self.steps, "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "bytes_fetched": self.bytes_fetched, "bytes_full": self.bytes_full, "seconds": self.seconds,
                "finish_reason": self.finish_reason, **self.extra}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> GenerationStats:
        """Counters from ``to_json``'s object (keys it does not name go to ``extra``)."""
        return cls(steps=int(d.get("steps", 0)), prompt_tokens=int(d.get("prompt_tokens", 0)),
                   new_tokens=int(d.get("new_tokens", 0)), bytes_fetched=int(d.get("bytes_fetched", 0)),
                   bytes_full=int(d.get("bytes_full", 0)), seconds=float(d.get("seconds", 0.0)),
                   finish_reason=str(d.get("finish_reason", "")),
                   extra={k: float(v) for k, v in d.items() if k not in STATS_WIRE_FIELDS})

    def copy_from(self, other: GenerationStats) -> None:
        """Take every counter of ``other`` (a remote generation fills the object its caller holds)."""
        for f in fields(self):
            setattr(self, f.name, getattr(other, f.name))
