"""What a generation request is, whichever protocol it came in on.

The HTTP API (openai_api.py) and the gRPC API (grpc_api.py) each fill the same typed `SamplingFields`
from their own input; the fields are validated here, once, into a `GenerateSpec` that the coordinator
queues. Its `TokenEvent`s come back through `text_stream`, which decodes them incrementally and cuts
the output at a stop string. Nothing here imports aiohttp or grpc: the core depends on no transport,
and every rule here is tested without a server.
"""

from __future__ import annotations

import math
import re
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Protocol

from lockstep.coordinator.endings import StopReason, prompt_only, stop_after, stop_reason
from lockstep.coordinator.request import FinishReason
from lockstep.model.config import json_integer
from lockstep.steps import SamplingParams, TokenLogprobs
from lockstep.tokenizer import IncrementalDecoder, Tokenizer

# The documented range of every request field (docs/commands.md and /openapi.json quote these).
MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 128
MAX_N = 16  # choices of one request: each is a request of its own in the queue and the batch
MAX_LOGPROBS = 20  # completions' `logprobs` and chat's `top_logprobs` (vLLM's default --max-logprobs, OpenAI's cap)
DEFAULT_RETRY_AFTER_S = 5  # a 503 that names no better time
MAX_STOP_CHARS = 256  # a longer stop string would hold all output back until the end
TEMPERATURE_MAX = 2.0
TOP_K_MAX = (1 << 31) - 1
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
PENALTY_MAX = 2.0  # |frequency_penalty| and |presence_penalty| (OpenAI's and vLLM's range)
LOGIT_BIAS_MAX = 100.0  # |bias| of a logit_bias entry (OpenAI's range)
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
_TOKEN_KEY = re.compile(r"0|[1-9][0-9]{0,18}")  # a logit_bias key: a token id in decimal (OpenAI's shape)
_KIND_NAMES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


class ApiError(Exception):
    """An error the client caused or can retry; both APIs render it (OpenAI's error body, a gRPC status)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 err_type: str = "invalid_request_error", retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.err_type = status, message, param, code, err_type
        # seconds a client should wait before it retries (the HTTP API sends it as Retry-After on a 503)
        self.retry_after = DEFAULT_RETRY_AFTER_S if retry_after is None and status == 503 else retry_after

    def headers(self) -> dict[str, str]:
        """HTTP headers of the error: Retry-After when a retry makes sense."""
        return {} if self.retry_after is None else {"Retry-After": str(max(1, math.ceil(self.retry_after)))}

    def body(self) -> dict:
        """OpenAI's error body, so OpenAI clients show the message and the offending field."""
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}


@dataclass(slots=True)  # not frozen: one per token per request, and frozen init costs 6x
class TokenEvent:
    """One step of a request's output: a token (or none), and why it ended when it did."""

    token_id: int | None
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0
    error: str = ""
    status: int = 503  # of an error: < 500 means the request itself can never be served
    logprobs: TokenLogprobs | None = None  # the token's, when the request asked for logprobs
    # with the first token of a request that asked for prompt logprobs: entry i is prompt token i + 1's
    prompt_logprobs: Sequence[TokenLogprobs] | None = None  # request_events.token_out builds it by position


@dataclass(frozen=True)
class GenerateSpec:
    """A validated request, as the coordinator queues it."""

    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # EOS (unless ignore_eos) and the client's
    ignore_eos: bool = False
    max_tokens_given: bool = True  # False: max_tokens is "up to the context", which the group may lower
    n: int = 1  # choices; `choice_specs` fans a spec out into n specs of one choice each
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output: the stop string or token stays in the text
    echo_only: bool = False  # max_tokens 0 with echo: run with max_tokens 1, the token dropped (endings.prompt_only)
    choice: int = 0  # which of its request's n choices: only choice 0 is counted against --max-waiting-requests


class ServedModel(Protocol):
    """What validating a request needs to know about the model."""

    model_name: str
    tokenizer: Tokenizer
    max_model_len: int


class Frontend(ServedModel, Protocol):
    """What both APIs need from the coordinator. In process (service.Coordinator) every answer is at hand; an
    API frontend process's (remote.RemoteCoordinator) comes over the link, so any of them may be awaitable
    (`settled`), except `healthy`, which a frontend answers from its last `health_detail`."""

    def generate(self, request_id: str, spec: GenerateSpec) -> AsyncGenerator[TokenEvent, None]:
        """Queue the request at once (raising ApiError if it cannot be) and return its events; closing
        them early aborts the request."""
    def healthy(self) -> bool: ...
    def health_detail(self) -> dict: ...
    def metrics_text(self) -> bytes: ...
    async def reset_prefix_cache(self, rank: int | None) -> None: ...
    def step_log(self, group: str | None, since: int) -> dict:
        """{"group", "steps", "next"}: the group's step timings from entry `since` (KeyError: no such group)."""

    async def drain(self, group: str, migrate: bool = False) -> dict:
        """Route nothing new to the group; return once it holds nothing, its requests finished or (migrate)
        moved to other groups (KeyError: no such group)."""

    def resume(self, group: str) -> dict:
        """Route to the group again (KeyError: no such group)."""


# ----- request fields


def json_field(body: Mapping[str, Any], name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    """body[name] if it has one of `kinds` (a bool is not a number), `default` if absent or null."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise ApiError(400, f"'{name}' must be of type {_kind_names(kinds)}, got a boolean", name)
    if isinstance(value, float) and int in kinds and float not in kinds and value.is_integer():
        return int(value)  # JSON has one number type: 8.0 is the integer 8 (as JSON Schema and OpenAI read it)
    if not isinstance(value, kinds):
        raise ApiError(400, f"'{name}' must be of type {_kind_names(kinds)}, got {type(value).__name__}", name)
    return value


def _kind_names(kinds: tuple[type, ...]) -> str:
    return " or ".join(dict.fromkeys(_KIND_NAMES.get(k, k.__name__) for k in kinds))


@dataclass(frozen=True)
class SamplingFields:
    """A request's sampling fields as the client sent them (None: not sent): of the right types, not
    yet checked for range. HTTP fills it from JSON (`from_json`), gRPC from the proto's optional fields."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    n: int | None = None
    max_tokens: int | None = None
    stop: Sequence[str] = ()
    ignore_eos: bool | None = None
    stop_token_ids: Sequence[int] = ()
    include_stop_str_in_output: bool | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: Mapping[int, float] | None = None  # token id -> bias
    echo: bool | None = None  # completions' echo, which alone allows max_tokens 0

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> SamplingFields:
        """The fields of an OpenAI request body; a field of the wrong JSON type is a 400 naming it."""
        temperature = json_field(body, "temperature", (int, float))
        top_p = json_field(body, "top_p", (int, float))
        top_k = json_field(body, "top_k", (int,))
        seed = json_field(body, "seed", (int,))
        n = json_field(body, "n", (int,))
        max_tokens = json_field(body, "max_tokens", (int,))
        if max_tokens is None:
            max_tokens = json_field(body, "max_completion_tokens", (int,))
        stop = json_field(body, "stop", (str, list), [])
        stop_ids = json_field(body, "stop_token_ids", (list,), [])[:MAX_STOP_TOKEN_IDS + 1]  # more: refused by count
        if not all(is_json_integer(t) for t in stop_ids):
            raise ApiError(400, "'stop_token_ids' must be an array of token ids", "stop_token_ids")
        return cls(temperature, top_p, top_k, seed, n, max_tokens, [stop] if isinstance(stop, str) else stop,
                   json_field(body, "ignore_eos", (bool,)), [int(t) for t in stop_ids],
                   json_field(body, "include_stop_str_in_output", (bool,)),
                   *(json_field(body, name, (int, float)) for name in ("repetition_penalty", "frequency_penalty",
                                                                      "presence_penalty")),
                   json_field(body, "min_tokens", (int,)), _logit_bias_json(body), json_field(body, "echo", (bool,)))


def _logit_bias_json(body: Mapping[str, Any]) -> dict[int, float] | None:
    """OpenAI's `logit_bias`: an object from token ids (decimal strings) to numbers; a 400 naming it otherwise."""
    bias = json_field(body, "logit_bias", (dict,))
    if bias is None or len(bias) > MAX_LOGIT_BIAS:  # too many: stand-ins, whose count _penalties refuses at once
        return None if bias is None else dict.fromkeys(range(len(bias)), 0.0)
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not _TOKEN_KEY.fullmatch(key):
            raise ApiError(400, f"'logit_bias' keys must be token ids in decimal, got {_shown(key)}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ApiError(400, f"'logit_bias' values must be numbers, got {type(value).__name__}", "logit_bias")
        out[int(key)] = _real(value, 0.0, "logit_bias")
    return out


def is_json_integer(value: object) -> bool:
    return json_integer(value) is not None  # 8.0 is one, as JSON Schema reads it; true is not


@dataclass(frozen=True)
class Sampling:
    """Validated sampling fields: what `GenerateSpec` is built from."""

    params: SamplingParams
    max_tokens: int | None
    stop: list[str]
    ignore_eos: bool
    n: int = 1
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str: bool = False


def parse_sampling(fields: SamplingFields) -> Sampling:
    """Check every field's range (OpenAI's where it has one); a bad one is a 400 naming it."""
    params = _sampling_params(fields)
    n = 1 if fields.n is None else fields.n
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"'n' must be between 1 and {MAX_N}, got {_shown(n)}", "n")
    max_tokens = fields.max_tokens
    if max_tokens is not None and max_tokens < (0 if fields.echo else 1):
        raise ApiError(400, f"'max_tokens' must be at least 1 (0 only with echo), got {_shown(max_tokens)}",
                       "max_tokens")
    stop = list(fields.stop)
    if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"'stop' must be a non-empty string or up to {MAX_STOP_STRINGS} of them, each of at "
                            f"most {MAX_STOP_CHARS} characters", "stop")
    stop_ids = list(fields.stop_token_ids)
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(400, f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} token ids", "stop_token_ids")
    return Sampling(params, max_tokens, stop, bool(fields.ignore_eos), n, stop_ids,
                    bool(fields.include_stop_str_in_output))


def _sampling_params(fields: SamplingFields) -> SamplingParams:
    temperature = _real(fields.temperature, 1.0, "temperature")
    if not 0.0 <= temperature <= TEMPERATURE_MAX:  # also refuses NaN
        raise ApiError(400, f"'temperature' must be between 0 and {TEMPERATURE_MAX:g}, got {_shown(temperature)}",
                       "temperature")
    top_p = _real(fields.top_p, 1.0, "top_p")
    if not 0.0 < top_p <= 1.0:
        raise ApiError(400, f"'top_p' must be in (0, 1], got {_shown(top_p)}", "top_p")
    top_k = 0 if fields.top_k is None else fields.top_k
    if not -1 <= top_k <= TOP_K_MAX:
        raise ApiError(400, f"'top_k' must be -1, 0 (off) or a positive number of tokens up to {TOP_K_MAX}, "
                            f"got {_shown(top_k)}", "top_k")
    seed = fields.seed
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise ApiError(400, f"'seed' must be a 64-bit signed integer, got {_shown(seed)}", "seed")
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=seed, **_penalties(fields))


def _penalties(fields: SamplingFields) -> dict[str, Any]:
    """The penalty fields of SamplingParams, range-checked (NaN is out of every range)."""
    repetition = _real(fields.repetition_penalty, 1.0, "repetition_penalty")
    if not 0.0 < repetition < math.inf:
        raise ApiError(400, f"'repetition_penalty' must be > 0, got {_shown(repetition)}", "repetition_penalty")
    out: dict[str, Any] = {"repetition_penalty": repetition}
    for name in ("frequency_penalty", "presence_penalty"):
        value = _real(getattr(fields, name), 0.0, name)
        if not -PENALTY_MAX <= value <= PENALTY_MAX:
            raise ApiError(400, f"'{name}' must be in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}], got {_shown(value)}", name)
        out[name] = value
    min_tokens = 0 if fields.min_tokens is None else fields.min_tokens
    if min_tokens < 0:
        raise ApiError(400, f"'min_tokens' must be at least 0, got {_shown(min_tokens)}", "min_tokens")
    bias = dict(fields.logit_bias or {})
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}", "logit_bias")
    for token, value in bias.items():
        if not -LOGIT_BIAS_MAX <= value <= LOGIT_BIAS_MAX:
            raise ApiError(400, f"'logit_bias' values must be between -{LOGIT_BIAS_MAX:g} and {LOGIT_BIAS_MAX:g}, "
                                f"got {_shown(value)} for token {_shown(token)}", "logit_bias")
    return {**out, "min_tokens": min_tokens, "logit_bias": tuple(bias.items())}


def _real(value: float | None, default: float, name: str) -> float:
    """A JSON number as a float; an integer too large for one is out of every range (a 400, not a crash)."""
    if value is None:
        return default
    try:
        return float(value)
    except OverflowError:
        raise ApiError(400, f"'{name}' is out of range, got {_shown(value)}", name) from None


def _shown(value: object, limit: int = 40) -> str:
    """A value for an error message, cut short: a client can send a 4000-digit number."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_model(model: ServedModel, requested: str | None) -> None:
    """A request may name the served model, and no other (None: the served one)."""
    if requested is not None and requested != model.model_name:
        raise ApiError(404, f"The model {_shown(requested, 256)} does not exist; this server serves "  # cut short: gRPC
                            f"'{model.model_name}'", "model", "model_not_found", "NotFoundError")  # sends it as header


def build_spec(model: ServedModel, fields: SamplingFields, prompt_ids: list[int]) -> GenerateSpec:
    """Validate the sampling fields and the prompt against the model: what the coordinator can queue."""
    sampling = parse_sampling(fields)
    limit = model.max_model_len
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", "prompt")
    room = limit - len(prompt_ids)
    if room < 1:  # before each id's range: a prompt of millions of ids is refused at once
        raise ApiError(400, f"This model's maximum context length is {limit} tokens, but the prompt has "
                            f"{len(prompt_ids)} tokens", "prompt", "context_length_exceeded")
    vocab = model.tokenizer.vocab_size
    if any(t < 0 or t >= vocab for t in prompt_ids):
        raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
    if any(t < 0 or t >= vocab for t in sampling.stop_token_ids):
        raise ApiError(400, f"'stop_token_ids' must be token ids in [0, {vocab})", "stop_token_ids")
    if any(not 0 <= t < vocab for t, _ in sampling.params.logit_bias):
        raise ApiError(400, f"'logit_bias' keys must be token ids in [0, {vocab})", "logit_bias")
    max_tokens = sampling.max_tokens
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens; the prompt has "
                            f"{len(prompt_ids)} tokens and max_tokens is {_shown(max_tokens)}", "max_tokens",
                       "context_length_exceeded")
    params = sampling.params
    if params.min_tokens > max_tokens and sampling.max_tokens is not None:  # vLLM's 400
        raise ApiError(400, f"'min_tokens' ({_shown(params.min_tokens)}) must not exceed 'max_tokens' "
                            f"({max_tokens})", "min_tokens")
    params = replace(params, min_tokens=min(params.min_tokens, max_tokens))  # else the context ends it
    eos = set() if sampling.ignore_eos else set(model.tokenizer.eos_token_ids)
    stop_ids = sorted(eos | set(sampling.stop_token_ids))
    return GenerateSpec(list(prompt_ids), params, max(max_tokens, 1), sampling.stop, stop_ids, sampling.ignore_eos,
                        sampling.max_tokens is not None, sampling.n, sampling.include_stop_str, max_tokens == 0)


# ----- output


class TextPiece(NamedTuple):
    """New output text with the token ids it came from; finish_reason is set on the last piece. With logprobs
    asked for, `logprobs[i]` is token_ids[i]'s (None where the rank sent none). The first piece of a request
    that asked for prompt logprobs carries them (`prompt_logprobs[i]` is prompt token i + 1's)."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    logprobs: Sequence[TokenLogprobs | None] = ()
    prompt_logprobs: Sequence[TokenLogprobs] | None = None
    stop_reason: StopReason = None  # with finish_reason: vLLM's (the stop string or token id; endings.py)


class Completion(NamedTuple):
    """A whole answer (of a non-streaming request)."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    cached_tokens: int
    logprobs: Sequence[TokenLogprobs | None] = ()
    prompt_logprobs: Sequence[TokenLogprobs] | None = None
    stop_reason: StopReason = None


def generate_text(frontend: Frontend, request_id: str, spec: GenerateSpec) -> AsyncGenerator[TextPiece, None]:
    """Queue the request now, so a refusal raises ApiError before any output, and return its text."""
    return text_stream(frontend.tokenizer, spec, frontend.generate(request_id, spec))


async def text_stream(tokenizer: Tokenizer, spec: GenerateSpec, events: AsyncGenerator[TokenEvent, None]
                      ) -> AsyncGenerator[TextPiece, None]:
    """Text pieces of the request's tokens, holding back what could still become a stop string.

    The output ends at the first stop string (finish reason "stop"), which is not sent; a stop token (EOS or
    one of stop_token_ids) ends it too and has no text, though its id is in token_ids (vLLM's convention);
    with include_stop_str both are kept in the text. An error event raises ApiError. Closing the pieces
    early closes the events, which aborts the request.
    """
    decoder = IncrementalDecoder(tokenizer, spec.prompt_ids)  # the text the tokens add to the prompt's
    vocab = tokenizer.vocab_size
    hidden = frozenset(() if spec.include_stop_str else spec.stop_token_ids)
    hold = max((len(s) for s in spec.stop), default=1) - 1
    # `count`: tokens out; `guard`: where the text of the min_tokens-th ends (see stop_after)
    text, sent, ids, lps, count, guard, last = "", 0, [], [], 0, 0, None
    prompt_lps = None  # the prompt's logprobs, until a piece carries them
    source, events = events, prompt_only(events) if spec.echo_only else events
    async with aclosing(events):
        async for ev in events:
            _raise_error(ev)
            if ev.prompt_logprobs is not None:
                prompt_lps = ev.prompt_logprobs
            if ev.token_id is not None:
                count, last = count + 1, ev.token_id
                ids.append(ev.token_id)
                if spec.sampling.logprobs >= 0:  # else pieces carry none: ()
                    lps.append(ev.logprobs)
                # a model whose embedding is padded past the tokenizer can sample an id with no text: it reads as ""
                if 0 <= ev.token_id < vocab and ev.token_id not in hidden:
                    text += decoder.add(ev.token_id)
            reason = ev.finish_reason
            if reason is not None:
                text += decoder.flush()  # before the stop check: the held-back text may hold a stop string
            cut, guard = stop_after(text, spec.stop, spec.sampling.min_tokens, spec.include_stop_str, sent, count,
                                    guard)
            if cut is not None:
                text, reason = text[:cut[0]], FinishReason.STOP
                _stopped_early(source, ev)
            if reason is not None:
                yield TextPiece(text[sent:], ids, reason, ev.cached_tokens, lps or (), prompt_lps,
                                stop_reason(tokenizer, spec, reason, cut, last))
                return
            safe = len(text) - hold
            if safe > sent:  # the prompt's logprobs go out with the first piece
                yield TextPiece(text[sent:safe], ids, None, ev.cached_tokens, lps or (), prompt_lps)
                sent, ids, lps, prompt_lps = safe, [], [], None


def _stopped_early(events: object, ev: TokenEvent) -> None:
    """A stop string ended the text early: closing its events (RequestEvents) aborts it, as a finished request."""
    mark = getattr(events, "stopped", None)
    if ev.finish_reason is None and mark is not None:
        mark()


def _raise_error(ev: TokenEvent) -> None:
    if ev.error and ev.status < 500:
        raise ApiError(ev.status, ev.error, "max_tokens", "request_too_large")
    if ev.error:
        raise ApiError(503, ev.error, code="group_unavailable", err_type="service_unavailable")


async def collect(pieces: AsyncGenerator[TextPiece, None]) -> Completion:
    """The whole answer of a non-streaming request (cancelled, it closes the pieces: the request aborts)."""
    text, ids, reason, cached, lps, prompt_lps, why = [], [], None, 0, [], None, None
    async with aclosing(pieces):
        async for piece in pieces:
            text.append(piece.text)
            ids.extend(piece.token_ids)
            lps.extend(piece.logprobs)
            reason, cached = piece.finish_reason or reason, piece.cached_tokens
            prompt_lps = piece.prompt_logprobs if prompt_lps is None else prompt_lps
            why = piece.stop_reason if piece.finish_reason is not None else why
    return Completion("".join(text), ids, reason, cached, lps or (), prompt_lps, why)

