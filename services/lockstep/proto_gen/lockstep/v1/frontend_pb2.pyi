from lockstep.proto_gen.lockstep.v1 import rank_pb2 as _rank_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LinkHello(_message.Message):
    __slots__ = ("link_id", "pid")
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    link_id: str
    pid: int
    def __init__(self, link_id: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class SubmitMsg(_message.Message):
    __slots__ = ("link_id", "request_id", "prompt_ids", "sampling", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "max_tokens_given", "include_stop_str", "echo_only", "choice")
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_GIVEN_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_FIELD_NUMBER: _ClassVar[int]
    ECHO_ONLY_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    link_id: str
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _rank_pb2.SamplingParamsMsg
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    max_tokens_given: bool
    include_stop_str: bool
    echo_only: bool
    choice: int
    def __init__(self, link_id: _Optional[str] = ..., request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_rank_pb2.SamplingParamsMsg, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., max_tokens_given: _Optional[bool] = ..., include_stop_str: _Optional[bool] = ..., echo_only: _Optional[bool] = ..., choice: _Optional[int] = ...) -> None: ...

class SubmitAnswer(_message.Message):
    __slots__ = ("ok", "status", "message", "param", "code", "type", "retry_after")
    OK_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    status: int
    message: str
    param: str
    code: str
    type: str
    retry_after: float
    def __init__(self, ok: _Optional[bool] = ..., status: _Optional[int] = ..., message: _Optional[str] = ..., param: _Optional[str] = ..., code: _Optional[str] = ..., type: _Optional[str] = ..., retry_after: _Optional[float] = ...) -> None: ...

class CancelMsg(_message.Message):
    __slots__ = ("link_id", "request_id", "stopped")
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    link_id: str
    request_id: str
    stopped: bool
    def __init__(self, link_id: _Optional[str] = ..., request_id: _Optional[str] = ..., stopped: _Optional[bool] = ...) -> None: ...

class Description(_message.Message):
    __slots__ = ("model_name", "max_model_len", "max_logprobs")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_model_len: int
    max_logprobs: int
    def __init__(self, model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., max_logprobs: _Optional[int] = ...) -> None: ...

class JsonAnswer(_message.Message):
    __slots__ = ("status", "json", "error")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    status: int
    json: str
    error: SubmitAnswer
    def __init__(self, status: _Optional[int] = ..., json: _Optional[str] = ..., error: _Optional[_Union[SubmitAnswer, _Mapping]] = ...) -> None: ...

class MetricsAnswer(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: bytes
    def __init__(self, text: _Optional[bytes] = ...) -> None: ...

class AdminCall(_message.Message):
    __slots__ = ("name", "group", "rank", "since", "migrate")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    MIGRATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    group: str
    rank: int
    since: int
    migrate: bool
    def __init__(self, name: _Optional[str] = ..., group: _Optional[str] = ..., rank: _Optional[int] = ..., since: _Optional[int] = ..., migrate: _Optional[bool] = ...) -> None: ...

class StepEventsMsg(_message.Message):
    __slots__ = ("request_ids", "token_ids", "cached_tokens", "extras")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    extras: _containers.RepeatedCompositeFieldContainer[EventExtrasMsg]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., cached_tokens: _Optional[_Iterable[int]] = ..., extras: _Optional[_Iterable[_Union[EventExtrasMsg, _Mapping]]] = ...) -> None: ...

class EventExtrasMsg(_message.Message):
    __slots__ = ("index", "finish_reason", "error", "status", "logprobs", "has_prompt_logprobs", "prompt_logprobs", "prompt_ranks")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_RANKS_FIELD_NUMBER: _ClassVar[int]
    index: int
    finish_reason: str
    error: str
    status: int
    logprobs: _rank_pb2.TokenLogprobsMsg
    has_prompt_logprobs: bool
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_rank_pb2.TokenLogprobsMsg]
    prompt_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[int] = ..., finish_reason: _Optional[str] = ..., error: _Optional[str] = ..., status: _Optional[int] = ..., logprobs: _Optional[_Union[_rank_pb2.TokenLogprobsMsg, _Mapping]] = ..., has_prompt_logprobs: _Optional[bool] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_rank_pb2.TokenLogprobsMsg, _Mapping]]] = ..., prompt_ranks: _Optional[_Iterable[int]] = ...) -> None: ...
