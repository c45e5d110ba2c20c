from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(_message.Message):
    __slots__ = ("n_layers", "n_kv_heads", "head_dim", "dtype", "page_size")
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    N_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    def __init__(self, n_layers: _Optional[int] = ..., n_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., page_size: _Optional[int] = ...) -> None: ...

class FileInfo(_message.Message):
    __slots__ = ("name", "size", "blake2b")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    BLAKE2B_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    blake2b: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., blake2b: _Optional[str] = ...) -> None: ...

class ArtifactInfo(_message.Message):
    __slots__ = ("name", "size", "blake2b")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    BLAKE2B_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    blake2b: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., blake2b: _Optional[str] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("prefix_id", "model_name", "model_fingerprint", "n_tokens", "layout", "files", "artifacts", "state", "created_at", "kv_bytes", "manifest_json")
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    prefix_id: str
    model_name: str
    model_fingerprint: str
    n_tokens: int
    layout: KVLayout
    files: _containers.RepeatedCompositeFieldContainer[FileInfo]
    artifacts: _containers.RepeatedCompositeFieldContainer[ArtifactInfo]
    state: str
    created_at: float
    kv_bytes: int
    manifest_json: str
    def __init__(self, prefix_id: _Optional[str] = ..., model_name: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., n_tokens: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., files: _Optional[_Iterable[_Union[FileInfo, _Mapping]]] = ..., artifacts: _Optional[_Iterable[_Union[ArtifactInfo, _Mapping]]] = ..., state: _Optional[str] = ..., created_at: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., manifest_json: _Optional[str] = ...) -> None: ...

class PrefixRef(_message.Message):
    __slots__ = ("prefix_id",)
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    prefix_id: str
    def __init__(self, prefix_id: _Optional[str] = ...) -> None: ...

class WriteHeader(_message.Message):
    __slots__ = ("model_fingerprint", "model_name", "token_hash", "n_tokens", "layout", "summarizers")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_HASH_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SUMMARIZERS_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    model_name: str
    token_hash: str
    n_tokens: int
    layout: KVLayout
    summarizers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_fingerprint: _Optional[str] = ..., model_name: _Optional[str] = ..., token_hash: _Optional[str] = ..., n_tokens: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., summarizers: _Optional[_Iterable[str]] = ...) -> None: ...

class LayerChunk(_message.Message):
    __slots__ = ("layer", "offset", "data")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    layer: int
    offset: int
    data: bytes
    def __init__(self, layer: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class NamedBytes(_message.Message):
    __slots__ = ("name", "data", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    data: bytes
    offset: int
    def __init__(self, name: _Optional[str] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ...) -> None: ...

class WriteChunk(_message.Message):
    __slots__ = ("header", "layer", "artifact", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: WriteHeader
    layer: LayerChunk
    artifact: NamedBytes
    commit: bool
    def __init__(self, header: _Optional[_Union[WriteHeader, _Mapping]] = ..., layer: _Optional[_Union[LayerChunk, _Mapping]] = ..., artifact: _Optional[_Union[NamedBytes, _Mapping]] = ..., commit: _Optional[bool] = ...) -> None: ...

class ListPrefixesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPrefixesResponse(_message.Message):
    __slots__ = ("prefixes",)
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    prefixes: _containers.RepeatedCompositeFieldContainer[Manifest]
    def __init__(self, prefixes: _Optional[_Iterable[_Union[Manifest, _Mapping]]] = ...) -> None: ...

class DeletePrefixResponse(_message.Message):
    __slots__ = ("prefix_id",)
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    prefix_id: str
    def __init__(self, prefix_id: _Optional[str] = ...) -> None: ...

class AcquireLeaseRequest(_message.Message):
    __slots__ = ("prefix_id", "holder", "ttl_s")
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    prefix_id: str
    holder: str
    ttl_s: float
    def __init__(self, prefix_id: _Optional[str] = ..., holder: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("prefix_id", "lease_id", "ttl_s")
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    prefix_id: str
    lease_id: str
    ttl_s: float
    def __init__(self, prefix_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("prefix_id", "pinned")
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    prefix_id: str
    pinned: bool
    def __init__(self, prefix_id: _Optional[str] = ..., pinned: _Optional[bool] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("prefix_id", "pinned")
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    prefix_id: str
    pinned: bool
    def __init__(self, prefix_id: _Optional[str] = ..., pinned: _Optional[bool] = ...) -> None: ...

class ReadPagesRequest(_message.Message):
    __slots__ = ("prefix_id", "layer", "kv_head", "pages", "verify")
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    prefix_id: str
    layer: int
    kv_head: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    verify: bool
    def __init__(self, prefix_id: _Optional[str] = ..., layer: _Optional[int] = ..., kv_head: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ..., verify: _Optional[bool] = ...) -> None: ...

class PageChunk(_message.Message):
    __slots__ = ("first_index", "n_pages", "data")
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    N_PAGES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    first_index: int
    n_pages: int
    data: bytes
    def __init__(self, first_index: _Optional[int] = ..., n_pages: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreStats(_message.Message):
    __slots__ = ("n_prefixes", "kv_bytes", "artifact_bytes")
    N_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_BYTES_FIELD_NUMBER: _ClassVar[int]
    n_prefixes: int
    kv_bytes: int
    artifact_bytes: int
    def __init__(self, n_prefixes: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., artifact_bytes: _Optional[int] = ...) -> None: ...

class PrefillChunk(_message.Message):
    __slots__ = ("text", "compress")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_FIELD_NUMBER: _ClassVar[int]
    text: str
    compress: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, text: _Optional[str] = ..., compress: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("prefix_id", "n_tokens", "cached")
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    prefix_id: str
    n_tokens: int
    cached: bool
    def __init__(self, prefix_id: _Optional[str] = ..., n_tokens: _Optional[int] = ..., cached: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prefix_id", "query", "method", "budget", "max_new_tokens", "temperature", "top_p", "seed", "stop", "raw", "gen_len", "budget_tokens", "ratio", "query_pages")
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    GEN_LEN_FIELD_NUMBER: _ClassVar[int]
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    QUERY_PAGES_FIELD_NUMBER: _ClassVar[int]
    prefix_id: str
    query: str
    method: str
    budget: float
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    raw: bool
    gen_len: int
    budget_tokens: int
    ratio: float
    query_pages: str
    def __init__(self, prefix_id: _Optional[str] = ..., query: _Optional[str] = ..., method: _Optional[str] = ..., budget: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., raw: _Optional[bool] = ..., gen_len: _Optional[int] = ..., budget_tokens: _Optional[int] = ..., ratio: _Optional[float] = ..., query_pages: _Optional[str] = ...) -> None: ...

class TokenStats(_message.Message):
    __slots__ = ("step", "bytes_fetched", "seconds")
    STEP_FIELD_NUMBER: _ClassVar[int]
    BYTES_FETCHED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    bytes_fetched: int
    seconds: float
    def __init__(self, step: _Optional[int] = ..., bytes_fetched: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("steps", "prompt_tokens", "new_tokens", "bytes_fetched", "bytes_full", "seconds", "finish_reason", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FETCHED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FULL_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    steps: int
    prompt_tokens: int
    new_tokens: int
    bytes_fetched: int
    bytes_full: int
    seconds: float
    finish_reason: str
    extra: _containers.ScalarMap[str, float]
    def __init__(self, steps: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., new_tokens: _Optional[int] = ..., bytes_fetched: _Optional[int] = ..., bytes_full: _Optional[int] = ..., seconds: _Optional[float] = ..., finish_reason: _Optional[str] = ..., extra: _Optional[_Mapping[str, float]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("text", "done", "token")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    text: str
    done: GenerationStats
    token: TokenStats
    def __init__(self, text: _Optional[str] = ..., done: _Optional[_Union[GenerationStats, _Mapping]] = ..., token: _Optional[_Union[TokenStats, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model_name", "model_fingerprint", "max_context", "methods", "device")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    METHODS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_fingerprint: str
    max_context: int
    methods: _containers.RepeatedScalarFieldContainer[str]
    device: str
    def __init__(self, model_name: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., max_context: _Optional[int] = ..., methods: _Optional[_Iterable[str]] = ..., device: _Optional[str] = ...) -> None: ...
