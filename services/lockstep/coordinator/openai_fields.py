"""What an HTTP request body may hold: a strict JSON reader and the accepted fields of each endpoint.

The policy (README, docs/commands.md and /openapi.json say the same): a field is accepted if Lockstep
implements it, or if its value is the one that asks for nothing (`frequency_penalty: 0`, `logprobs: null`,
`echo: false`, ...); `null` always means "not sent". Anything else is a 400 that names the field, so a
client never believes it got something it did not. The reader refuses what Python's `json` would let
through: NaN and Infinity, numbers too large for a float, 4300-digit integers, bodies nested deeper than
any request needs, and unpaired UTF-16 surrogates (no tokenizer takes them).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from lockstep.coordinator.generation import MAX_LOGPROBS, ApiError, json_field

MAX_BODY_BYTES = 4 << 20  # aiohttp's client_max_size: a bigger body is a 413
# the deepest accepted request is 5 levels (a content part); a 10000-level body is a 400, not a RecursionError
MAX_JSON_DEPTH = 32
MAX_USER_CHARS = 256
MESSAGE_FIELDS = ("role", "content", "name")
CONTENT_PART_FIELDS = ("type", "text")
STREAM_OPTIONS = {"include_usage": None, "continuous_usage_stats": (False,)}  # None: implemented
_SURROGATE = re.compile("[\ud800-\udfff]")

# Implemented on both endpoints (generation.py checks their ranges), then each endpoint's own.
SAMPLING = ("model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
            "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "stream", "stream_options",
            "return_token_ids", "user", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
            "min_tokens")
IMPLEMENTED = {"completions": ("prompt", "echo", "logprobs", "prompt_logprobs", *SAMPLING),
               "chat": ("messages", "logprobs", "top_logprobs", *SAMPLING),
               "reset_prefix_cache": ("rank",),
               # vLLM's /tokenize takes a prompt or a chat (two request kinds), /detokenize token ids
               "tokenize": ("model", "prompt", "add_special_tokens", "return_token_strs"),
               "tokenize_chat": ("model", "messages", "add_generation_prompt", "add_special_tokens",
                                 "return_token_strs"),
               "detokenize": ("model", "tokens")}

# Not implemented: accepted only at the value that asks for nothing (or null).
_NOOP_COMMON: dict[str, tuple] = {
    "min_p": (0,), "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "use_beam_search": (False,),  # vLLM's; best_of (completions) likewise only 1: every choice is returned
}
NOOP: dict[str, dict[str, tuple]] = {
    "completions": {**_NOOP_COMMON, "best_of": (1,), "suffix": ("",)},
    "chat": {**_NOOP_COMMON, "tools": ([],), "tool_choice": ("none",),
             "parallel_tool_calls": (True, False), "response_format": ({"type": "text"},), "store": (False,)},
    "reset_prefix_cache": {}, "tokenize": {}, "tokenize_chat": {}, "detokenize": {},
}


def load_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or a 400 that says what is wrong with it."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise ApiError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_tree(body)
    return body


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} does not fit a 64-bit float")
    return value


def _check_tree(body: dict) -> None:
    """Depth and text of every value, without recursion (a deep body must not exhaust the stack)."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise ApiError(400, "the request body holds an unpaired UTF-16 surrogate, which is not text")
            continue
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels")
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        stack.extend((v, depth + 1) for v in items if isinstance(v, (str, list, dict)))


def same(a: Any, b: Any) -> bool:
    """JSON equality: false is not 0, 1.0 is 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def max_logprobs_of(frontend: object) -> int:
    """The coordinator's --max-logprobs (a frontend without one: vLLM's default of 20)."""
    return getattr(frontend, "max_logprobs", MAX_LOGPROBS)


def check_fields(body: Mapping[str, Any], endpoint: str, max_logprobs: int = MAX_LOGPROBS) -> None:
    """Every field of the body is implemented, or sent at its no-op value; else a 400 naming it. `max_logprobs`
    is the coordinator's --max-logprobs."""
    noop = NOOP[endpoint]
    for name, value in body.items():
        if name in IMPLEMENTED[endpoint]:
            continue
        if name not in noop:
            raise ApiError(400, f"unsupported field '{name}': Lockstep does not implement it "
                                f"(see /openapi.json for the accepted fields)", name, "unsupported_field")
        if value is not None and not any(same(value, v) for v in noop[name]):
            allowed = " or ".join(json.dumps(v) for v in (None, *noop[name]))
            raise ApiError(400, f"'{name}' is not supported: it is accepted only as {allowed}", name,
                           "unsupported_value")
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise ApiError(400, f"'user' must be a string of at most {MAX_USER_CHARS} characters", "user")
    if endpoint in ("completions", "chat"):
        # their rules, before any work (respond reads them again)
        logprobs_asked(body, endpoint == "chat", max_logprobs)
        if endpoint == "completions":
            prompt_logprobs_asked(body, max_logprobs)


def check_shadowed_max_tokens(body: Mapping[str, Any], max_model_len: int) -> None:
    """`max_completion_tokens` sent beside `max_tokens` (which wins) still has its documented range (from 0
    with a completion's echo, as max_tokens), so a bad value is never silently ignored."""
    if body.get("max_tokens") is None:
        return  # then it is the limit, and generation.py checks it as one
    value = json_field(body, "max_completion_tokens", (int,))
    low = 0 if json_field(body, "echo", (bool,), False) else 1
    if value is not None and not low <= value < max_model_len:
        raise ApiError(400, f"'max_completion_tokens' must be between {low} and {max_model_len - 1}",
                       "max_completion_tokens")


def stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    """Whether the client asked for a usage chunk at the end of its stream (`stream_options.include_usage`).
    Options without a stream are refused, as OpenAI and vLLM refuse them: the usage chunk they ask for never
    comes."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    if options and not stream:  # vLLM's rule: an empty object asks for nothing
        raise ApiError(400, "'stream_options' may be set only when 'stream' is true", "stream_options")
    for name, value in options.items():
        noop = STREAM_OPTIONS.get(name, ())
        param = f"stream_options.{name}"
        if name not in STREAM_OPTIONS:
            raise ApiError(400, f"unsupported field '{param}'", param, "unsupported_field")
        if value is not None and noop is not None and not any(same(value, v) for v in noop):
            raise ApiError(400, f"'{param}' is not supported: it is accepted only as null or false", param,
                           "unsupported_value")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise ApiError(400, "'stream_options.include_usage' must be a boolean", "stream_options.include_usage")
    return bool(include)


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """A chat's messages as the chat template takes them: {role, content, name?} with text content. Content
    may be text, null (read as "", as vLLM does: an assistant turn with no text) or an array of text parts,
    joined by newlines (vLLM's rule); any other part type, or field, is a 400 naming it."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"{where} must be an object with a string 'role' and 'content'", "messages")
        extra = [k for k in m if k not in MESSAGE_FIELDS and m[k] is not None]
        if extra:
            raise ApiError(400, f"unsupported field '{where}.{extra[0]}' (a message has {', '.join(MESSAGE_FIELDS)})",
                           "messages", "unsupported_field")
        if not isinstance(m.get("name"), (str, type(None))):
            raise ApiError(400, f"{where}.name must be a string", "messages")
        message = {"role": m["role"], "content": _content(m.get("content"), where)}
        if m.get("name") is not None:
            message["name"] = m["name"]
        out.append(message)
    return out


def _content(content: Any, where: str) -> str:
    """A message's content as text: a string, null, or text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or an array of content parts", "messages")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ApiError(400, f"{at} must be an object with a string 'type'", "messages")
        if part["type"] != "text":
            raise ApiError(400, f"unsupported content part type '{part['type'][:40]}' at {at}: Lockstep serves "
                                "text only (parts of type 'text')", "messages", "unsupported_content_part")
        extra = [k for k in part if k not in CONTENT_PART_FIELDS and part[k] is not None]
        if extra:
            raise ApiError(400, f"unsupported field '{at}.{extra[0]}' (a text part has type, text)", "messages",
                           "unsupported_field")
        if not isinstance(part.get("text"), str):
            raise ApiError(400, f"{at}.text must be a string", "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def check_echo(body: Mapping[str, Any]) -> bool:
    """Whether a completion echoes its prompt. With `logprobs` too, the choice's logprobs cover the prompt's
    tokens before the generated ones (the first prompt token's null: nothing predicts it), which is how
    evaluation harnesses score a text (lm-eval's loglikelihood: echo, logprobs, max_tokens 1)."""
    return json_field(body, "echo", (bool,), False)


def _over(name: str, k: int, max_logprobs: int) -> ApiError:
    return ApiError(400, f"'{name}' must be between 0 and {max_logprobs}, got {str(k)[:40]} (the server's "
                         "--max-logprobs)", name)


def prompt_logprobs_asked(body: Mapping[str, Any], max_logprobs: int = MAX_LOGPROBS) -> int:
    """vLLM's `prompt_logprobs` of a completion: 0..max_logprobs most likely tokens at each prompt position, with the
    prompt token's own logprob and rank (null: off, -1)."""
    k = json_field(body, "prompt_logprobs", (int,))
    if k is not None and not 0 <= k <= max_logprobs:
        raise _over("prompt_logprobs", k, max_logprobs)
    return -1 if k is None else k


def logprobs_asked(body: Mapping[str, Any], chat: bool, max_logprobs: int = MAX_LOGPROBS) -> int:
    """How many top logprobs each generated token carries, -1 for none (vLLM's rules): completions' `logprobs`
    is 0..max_logprobs (null: off); chat's `logprobs: true` turns them on with `top_logprobs` 0..max_logprobs
    alternatives, and `top_logprobs` > 0 without `logprobs: true` is a 400, as it would silently give nothing."""
    if not chat:
        k = json_field(body, "logprobs", (int,))
        if k is not None and not 0 <= k <= max_logprobs:
            raise _over("logprobs", k, max_logprobs)
        return -1 if k is None else k
    on = json_field(body, "logprobs", (bool,), False)
    top = json_field(body, "top_logprobs", (int,))
    if top is not None and not 0 <= top <= max_logprobs:
        raise _over("top_logprobs", top, max_logprobs)
    if top and not on:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if on else -1
