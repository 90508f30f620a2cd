from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParamsMsg(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "logprobs", "prompt_logprobs", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "min_tokens", "stop_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    logprobs: int
    prompt_logprobs: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenHistory(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AdmitMsg(_message.Message):
    __slots__ = ("request_id", "prefix_keys")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_KEYS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefix_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_id: _Optional[str] = ..., prefix_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BatchMsg(_message.Message):
    __slots__ = ("request_ids", "token_counts", "token_ids", "starts", "sample", "sample_index", "sampling", "extras")
    class ExtrasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: ChunkExtrasMsg
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[ChunkExtrasMsg, _Mapping]] = ...) -> None: ...
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    starts: _containers.RepeatedScalarFieldContainer[int]
    sample: _containers.RepeatedScalarFieldContainer[bool]
    sample_index: _containers.RepeatedScalarFieldContainer[int]
    sampling: _containers.RepeatedScalarFieldContainer[int]
    extras: _containers.MessageMap[int, ChunkExtrasMsg]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., token_counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., starts: _Optional[_Iterable[int]] = ..., sample: _Optional[_Iterable[bool]] = ..., sample_index: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Iterable[int]] = ..., extras: _Optional[_Mapping[int, ChunkExtrasMsg]] = ...) -> None: ...

class ChunkExtrasMsg(_message.Message):
    __slots__ = ("prompt_logprobs", "next_token_id", "history")
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    prompt_logprobs: int
    next_token_id: int
    history: TokenHistory
    def __init__(self, prompt_logprobs: _Optional[int] = ..., next_token_id: _Optional[int] = ..., history: _Optional[_Union[TokenHistory, _Mapping]] = ...) -> None: ...

class ProbeMsg(_message.Message):
    __slots__ = ("request_id", "keys")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PlanMsg(_message.Message):
    __slots__ = ("step", "releases", "admits", "batch", "samplings", "probes", "flush_prefix_cache", "release_all", "abstain", "pool_split", "pool_fence")
    class PoolSplitEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PoolFenceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    ADMITS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLINGS_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    FLUSH_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_ALL_FIELD_NUMBER: _ClassVar[int]
    ABSTAIN_FIELD_NUMBER: _ClassVar[int]
    POOL_SPLIT_FIELD_NUMBER: _ClassVar[int]
    POOL_FENCE_FIELD_NUMBER: _ClassVar[int]
    step: int
    releases: _containers.RepeatedScalarFieldContainer[str]
    admits: _containers.RepeatedCompositeFieldContainer[AdmitMsg]
    batch: BatchMsg
    samplings: _containers.RepeatedScalarFieldContainer[bytes]
    probes: _containers.RepeatedCompositeFieldContainer[ProbeMsg]
    flush_prefix_cache: bool
    release_all: bool
    abstain: bool
    pool_split: _containers.ScalarMap[str, int]
    pool_fence: _containers.ScalarMap[str, int]
    def __init__(self, step: _Optional[int] = ..., releases: _Optional[_Iterable[str]] = ..., admits: _Optional[_Iterable[_Union[AdmitMsg, _Mapping]]] = ..., batch: _Optional[_Union[BatchMsg, _Mapping]] = ..., samplings: _Optional[_Iterable[bytes]] = ..., probes: _Optional[_Iterable[_Union[ProbeMsg, _Mapping]]] = ..., flush_prefix_cache: _Optional[bool] = ..., release_all: _Optional[bool] = ..., abstain: _Optional[bool] = ..., pool_split: _Optional[_Mapping[str, int]] = ..., pool_fence: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ProbeAnswerMsg(_message.Message):
    __slots__ = ("request_id", "matched_pages", "pinned_pages", "sliding_runs", "sliding_pinned")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MATCHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PINNED_PAGES_FIELD_NUMBER: _ClassVar[int]
    SLIDING_RUNS_FIELD_NUMBER: _ClassVar[int]
    SLIDING_PINNED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    matched_pages: int
    pinned_pages: int
    sliding_runs: _containers.RepeatedScalarFieldContainer[int]
    sliding_pinned: int
    def __init__(self, request_id: _Optional[str] = ..., matched_pages: _Optional[int] = ..., pinned_pages: _Optional[int] = ..., sliding_runs: _Optional[_Iterable[int]] = ..., sliding_pinned: _Optional[int] = ...) -> None: ...

class PoolStateMsg(_message.Message):
    __slots__ = ("pool", "total", "free", "evictable", "used", "pinned", "movable", "fenced")
    POOL_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    MOVABLE_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    pool: str
    total: int
    free: int
    evictable: int
    used: int
    pinned: int
    movable: int
    fenced: int
    def __init__(self, pool: _Optional[str] = ..., total: _Optional[int] = ..., free: _Optional[int] = ..., evictable: _Optional[int] = ..., used: _Optional[int] = ..., pinned: _Optional[int] = ..., movable: _Optional[int] = ..., fenced: _Optional[int] = ...) -> None: ...

class TokenLogprobsMsg(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PromptLogprobsMsg(_message.Message):
    __slots__ = ("request_id", "start", "logprobs", "top_counts", "top_ids", "top_logprobs", "ranks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_counts: _containers.RepeatedScalarFieldContainer[int]
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., start: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_counts: _Optional[_Iterable[int]] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class ReportMsg(_message.Message):
    __slots__ = ("step", "rank", "sampled_ids", "sampled_tokens", "sampled_logprobs", "probes", "pools", "error", "timings", "prompt_logprobs")
    class SampledLogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: TokenLogprobsMsg
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[TokenLogprobsMsg, _Mapping]] = ...) -> None: ...
    class TimingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step: int
    rank: int
    sampled_ids: _containers.RepeatedScalarFieldContainer[str]
    sampled_tokens: _containers.RepeatedScalarFieldContainer[int]
    sampled_logprobs: _containers.MessageMap[int, TokenLogprobsMsg]
    probes: _containers.RepeatedCompositeFieldContainer[ProbeAnswerMsg]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStateMsg]
    error: str
    timings: _containers.ScalarMap[str, float]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobsMsg]
    def __init__(self, step: _Optional[int] = ..., rank: _Optional[int] = ..., sampled_ids: _Optional[_Iterable[str]] = ..., sampled_tokens: _Optional[_Iterable[int]] = ..., sampled_logprobs: _Optional[_Mapping[int, TokenLogprobsMsg]] = ..., probes: _Optional[_Iterable[_Union[ProbeAnswerMsg, _Mapping]]] = ..., pools: _Optional[_Iterable[_Union[PoolStateMsg, _Mapping]]] = ..., error: _Optional[str] = ..., timings: _Optional[_Mapping[str, float]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobsMsg, _Mapping]]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankInfo(_message.Message):
    __slots__ = ("rank", "world_size", "model_id", "page_size", "pool_totals", "max_model_len", "vocab_size", "last_step", "sliding_window", "pool_page_bytes")
    class PoolTotalsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PoolPageBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    POOL_TOTALS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    POOL_PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    model_id: str
    page_size: int
    pool_totals: _containers.ScalarMap[str, int]
    max_model_len: int
    vocab_size: int
    last_step: int
    sliding_window: int
    pool_page_bytes: _containers.ScalarMap[str, int]
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., model_id: _Optional[str] = ..., page_size: _Optional[int] = ..., pool_totals: _Optional[_Mapping[str, int]] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., last_step: _Optional[int] = ..., sliding_window: _Optional[int] = ..., pool_page_bytes: _Optional[_Mapping[str, int]] = ...) -> None: ...
