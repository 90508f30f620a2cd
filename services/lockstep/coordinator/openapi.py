"""The OpenAPI 3.1 document of the HTTP API, served at GET /openapi.json.

Written by hand, but from the code's own tables: the accepted fields of each endpoint are
openai_fields.py's (implemented, or accepted at their no-op value), their ranges are generation.py's
constants, and the served model's name, context length and vocabulary fill in the limits that depend on
it. tests/test_openapi.py checks that every route the server has is here and nothing else, and fuzzes a
running server against this document with schemathesis.
"""

from __future__ import annotations

from typing import Any

from lockstep.coordinator import generation as g
from lockstep.coordinator.openai_fields import (
    IMPLEMENTED,
    MAX_BODY_BYTES,
    MAX_USER_CHARS,
    NOOP,
    STREAM_OPTIONS,
)

# Paths that need no API key (probes, scrapers, discovery); everything else does when keys are set.
OPEN_PATHS = ("/health", "/metrics", "/openapi.json", "/version")
# The query parameters each route takes; any other is a 400 naming it.
GROUP = {"type": "string", "minLength": 1, "x-required": True}  # a group's name, as /health lists them
QUERY_PARAMS = {"/admin/reset_prefix_cache": ("rank",), "/admin/steps": ("group", "since"),
                "/admin/drain": ("group", "migrate"), "/admin/resume": ("group",)}
QUERY_INT_MAX = 10**18 - 1
NULL = {"type": "null"}
BOOL = {"type": "boolean"}
INT = {"type": "integer"}
STR = {"type": "string"}
_ERR = "#/components/responses/"


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, NULL]}


def _field_schemas(model: str, max_model_len: int, vocab: int, max_logprobs: int) -> dict[str, dict]:
    """The schema of every implemented field (each also takes null: "not sent")."""
    stop = {"type": "string", "minLength": 1, "maxLength": g.MAX_STOP_CHARS}
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}}
    part = {"type": "object", "required": ["type", "text"], "additionalProperties": NULL,  # other keys: null only
            "properties": {"type": {"const": "text"}, "text": STR}}
    content = {"anyOf": [STR, NULL, {"type": "array", "items": part}],
               "description": "text, null (empty) or text parts (joined by newlines); other part types are a 400"}
    message = {"type": "object", "required": ["role"], "additionalProperties": NULL,  # other keys: null only
               "properties": {"role": STR, "content": content, "name": _nullable(STR)}}
    options = {name: _nullable(BOOL) if noop is None else {"enum": [None, *noop]}
               for name, noop in STREAM_OPTIONS.items()}
    return {
        "model": {"type": "string", "enum": [model], "description": "the served model (any other is a 404)"},
        "prompt": {"anyOf": [STR, ids, {"type": "array", "minItems": 1, "maxItems": 1, "items": STR},
                             {"type": "array", "minItems": 1, "maxItems": 1, "items": ids}],
                   "description": "text, or token ids; prompt tokens + max_tokens <= the context length "
                                  f"({max_model_len})"},
        "messages": {"type": "array", "minItems": 1, "items": message,
                     "description": "rendered by the model's chat template; content is text only"},
        "echo": {**BOOL, "description": "put the prompt's text before each choice's text; with logprobs, the prompt's "
                                        "tokens are scored too (the first one's logprob null)"},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": max_logprobs,
                     "description": "each generated token's logprob (of the raw logits) and the k most likely "
                                    "tokens' (top_logprobs also holds the sampled token: up to k + 1)"},
        "prompt_logprobs": {"type": "integer", "minimum": 0, "maximum": max_logprobs,
                            "description": "vLLM's: choices[].prompt_logprobs, per prompt position (the first "
                                           "null) the prompt token and the k most likely, by token id: logprob, "
                                           "rank, decoded_token"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": max_logprobs,
                         "description": "the k most likely tokens at each position (needs logprobs: true)"},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": max_model_len - 1,
                       "description": "default: up to the context length"},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": max_model_len - 1,
                                  "description": "max_tokens under its newer name (max_tokens wins)"},
        "temperature": {"type": "number", "minimum": 0, "maximum": g.TEMPERATURE_MAX, "description": "0: greedy"},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1, "maximum": g.TOP_K_MAX, "description": "-1 or 0: off"},
        "n": {"type": "integer", "minimum": 1, "maximum": g.MAX_N,
              "description": "choices, each sampled on its own (with a seed, choice i draws with seed + i)"},
        "seed": {"type": "integer", "minimum": g.SEED_MIN, "maximum": g.SEED_MAX},
        "stop": {"anyOf": [stop, {"type": "array", "maxItems": g.MAX_STOP_STRINGS, "items": stop}]},
        "stop_token_ids": {"type": "array", "maxItems": g.MAX_STOP_TOKEN_IDS, "items": {
            "type": "integer", "minimum": 0, "maximum": vocab - 1},
            "description": "end at any of these tokens (finish_reason stop); its id is in token_ids, not its text"},
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0,
                               "description": "vLLM's: the logit of a token in the prompt or the output is divided "
                                              "by it when positive, multiplied when not (1: off)"},
        "frequency_penalty": {"type": "number", "minimum": -g.PENALTY_MAX, "maximum": g.PENALTY_MAX,
                              "description": "minus this times the token's count in the output so far"},
        "presence_penalty": {"type": "number", "minimum": -g.PENALTY_MAX, "maximum": g.PENALTY_MAX,
                             "description": "minus this for a token already in the output"},
        "logit_bias": {"type": "object", "maxProperties": g.MAX_LOGIT_BIAS,
                       "propertyNames": {"pattern": f"^({_ids_below(vocab)})$"},
                       "additionalProperties": {"type": "number", "minimum": -g.LOGIT_BIAS_MAX,
                                                "maximum": g.LOGIT_BIAS_MAX},
                       "description": "token id (a string) -> bias added to its logit before sampling"},
        "min_tokens": {"type": "integer", "minimum": 0,
                       "description": "no stop token or stop string ends the output before this many tokens; "
                                      "at most max_tokens"},
        "include_stop_str_in_output": {**BOOL, "description": "keep the stop string or stop token in the text"},
        "ignore_eos": {**BOOL, "description": "do not end at the end-of-sequence token"},
        "stream": {**BOOL, "description": "server-sent events, ending with data: [DONE]"},
        "stream_options": {"type": "object", "additionalProperties": False, "properties": options},
        "return_token_ids": {**BOOL, "description": "add prompt_token_ids and choices[].token_ids (vLLM)"},
        "user": {"type": "string", "maxLength": MAX_USER_CHARS, "description": "the caller's id; no effect"},
        "rank": {"type": "integer", "minimum": 0, "description": "one rank of every group (default: all ranks)"},
        "add_special_tokens": {**BOOL, "description": "default: true for a prompt, false for messages (vLLM)"},
        "add_generation_prompt": {**BOOL, "description": "end the chat with the assistant's turn (default: true)"},
        "return_token_strs": {**BOOL, "description": "add token_strs, each token's text"},
        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}},
    }


def _ids_below(vocab: int) -> str:
    """A regular expression of the decimal numbers 0 .. vocab - 1 without leading zeros (logit_bias' keys)."""
    top = str(max(vocab - 1, 0))
    n = len(top)
    alts = ["0"] if n > 1 or top == "0" else [f"[0-{top}]"]
    if n > 1:
        alts.append(f"[1-9][0-9]{{0,{n - 2}}}")  # every shorter number
        for i, digit in enumerate(top):
            low = 1 if i == 0 else 0
            if int(digit) > low:
                alts.append(f"{top[:i]}[{low}-{int(digit) - 1}][0-9]{{{n - i - 1}}}")
        alts.append(top)
    return "|".join(alts)


def request_schema(endpoint: str, model: str, max_model_len: int, vocab: int,
                   max_logprobs: int = g.MAX_LOGPROBS) -> dict:
    """The body of an endpoint: its implemented fields and its no-op fields (an enum of the no-op values)."""
    known = _field_schemas(model, max_model_len, vocab, max_logprobs)
    if endpoint == "tokenize":
        known["prompt"] = {**STR, "description": "the text to tokenize"}
    if endpoint == "chat":
        known["logprobs"] = {**BOOL, "description": "each generated token's logprob (of the raw logits)"}
    if endpoint == "completions":  # vLLM's echo without generation: max_tokens 0 (with echo: true, see _TOGETHER)
        for name in ("max_tokens", "max_completion_tokens"):
            known[name] = {**known[name], "minimum": 0, "description": known[name]["description"] + "; 0 (with echo"
                           ": true) returns the prompt, scored with logprobs if asked, and generates nothing"}
    props = {name: _nullable(known[name]) for name in IMPLEMENTED[endpoint]}
    for name, values in NOOP[endpoint].items():
        props[name] = {"enum": [None, *values], "description": "not implemented: accepted only at this value"}
    required = {"completions": ["prompt"], "chat": ["messages"], "tokenize": ["prompt"], "tokenize_chat": ["messages"],
                "detokenize": ["tokens"]}.get(endpoint, [])
    for name in required:
        props[name] = known[name]
    schema = {"type": "object", "additionalProperties": False, "required": required, "properties": props}
    if endpoint in _TOGETHER:
        schema["allOf"] = [{"anyOf": rule} for rule in _TOGETHER[endpoint]]
    return schema


# What one field allows only with another (each rule: one of its alternatives holds): top_logprobs > 0 needs
# logprobs: true (vLLM's rule), a completion's max_tokens 0 needs echo: true, and stream_options needs stream:
# true (OpenAI's and vLLM's).
_STREAM_OPTIONS = [{"properties": {"stream_options": {"anyOf": [NULL, {"type": "object", "maxProperties": 0}]}}},
                   {"required": ["stream"], "properties": {"stream": {"const": True}}}]
_TOGETHER = {
    "chat": [[{"properties": {"top_logprobs": {"enum": [None, 0]}}},
              {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}], _STREAM_OPTIONS],
    "completions": [[{"properties": {name: {"not": {"const": 0}} for name in ("max_tokens", "max_completion_tokens")}},
                     {"required": ["echo"], "properties": {"echo": {"const": True}}}], _STREAM_OPTIONS],
}


def _responses() -> dict[str, dict]:
    error = {"description": "OpenAI's error body", "content": {"application/json": {"schema": {
        "$ref": "#/components/schemas/Error"}}}}
    return {
        "BadRequest": {**error, "description": "a field is invalid, unsupported or out of range (it is named)"},
        "Unauthorized": {**error, "description": "API keys are set and the request has none of them",
                         "headers": {"WWW-Authenticate": {"schema": STR}}},
        "NotFound": {**error, "description": "no such model or group"},
        "TooLarge": {**error, "description": f"the body is over the limit ({MAX_BODY_BYTES} bytes by default)"},
        "Unavailable": {**error, "description": "no group can serve now; retry later",
                        "headers": {"Retry-After": {"schema": STR}}},
    }


def _schemas() -> dict[str, dict]:
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
        "prompt_tokens": INT, "completion_tokens": INT, "total_tokens": INT,
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": INT}}}}
    reason = {"enum": [None, "stop", "length", "abort", "error"]}
    stop_reason = {"type": ["string", "integer", "null"],
                   "description": "vLLM's: the stop string or stop token id that ended the choice; null for EOS or "
                                  "length"}
    ids = {"type": "array", "items": INT}
    message = {"type": "object", "required": ["role", "content"], "properties": {"role": STR, "content": STR}}
    common = {"id": STR, "created": INT, "model": STR, "usage": usage, "prompt_token_ids": ids}
    logprob = {"type": ["number", "null"]}
    legacy = _nullable({"type": "object", "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
                        "properties": {"tokens": {"type": "array", "items": STR},
                                       "token_logprobs": {"type": "array", "items": logprob},
                                       "top_logprobs": {"type": "array", "items": {  # null: echo's first
                                           "type": ["object", "null"], "additionalProperties": logprob}},
                                       "text_offset": ids}})
    alt = {"type": "object", "required": ["token", "logprob", "bytes"], "properties": {
        "token": STR, "logprob": logprob, "bytes": ids}}
    content = {"type": "array", "items": {**alt, "required": [*alt["required"], "top_logprobs"], "properties": {
        **alt["properties"], "top_logprobs": {"type": "array", "items": alt}}}}
    chat_lps = _nullable({"type": "object", "required": ["content"], "properties": {"content": content}})
    return {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type"], "properties": {
                "message": STR, "type": STR, "param": _nullable(STR), "code": _nullable(STR)}}}},
        "Completion": {"type": "object", "required": ["id", "object", "choices", "usage"], "properties": {
            **common, "object": {"const": "text_completion"}, "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", "text", "finish_reason"], "properties": {
                    "index": INT, "text": STR, "finish_reason": reason, "stop_reason": stop_reason, "logprobs": legacy,
                    "token_ids": ids,
                    "prompt_logprobs": {"type": "array", "items": {"type": ["object", "null"], "additionalProperties": {
                        "type": "object", "required": ["logprob", "rank", "decoded_token"], "properties": {
                            "logprob": logprob, "rank": INT, "decoded_token": STR}}}}}}}}},
        "ChatCompletion": {"type": "object", "required": ["id", "object", "choices", "usage"], "properties": {
            **common, "object": {"const": "chat.completion"}, "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", "message", "finish_reason"], "properties": {
                    "index": INT, "message": message, "finish_reason": reason, "stop_reason": stop_reason,
                    "logprobs": chat_lps, "token_ids": ids}}}}},
        "Models": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": {"$ref": "#/components/schemas/Model"}}}},
        "Model": {"type": "object", "required": ["id", "object"], "properties": {
            "id": STR, "object": {"const": "model"}, "created": INT, "owned_by": STR, "max_model_len": INT}},
        "Tokenize": {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
            "count": INT, "max_model_len": INT, "tokens": ids, "token_strs": {"type": "array", "items": STR}}},
        "Detokenize": {"type": "object", "required": ["prompt"], "properties": {"prompt": STR}},
        "Steps": {"type": "object", "required": ["group", "steps", "next"], "properties": {
            "group": STR, "next": INT, "steps": {"type": "array", "items": {"type": "array", "items": {
                "type": "number"}}}}},
    }


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _operation(summary: str, ok: dict, errors: tuple[str, ...], body: dict | None = None,
               query: tuple[tuple[str, dict], ...] = (), secured: bool = True) -> dict:
    statuses = {"400": "BadRequest", "401": "Unauthorized", "404": "NotFound", "413": "TooLarge",
                "503": "Unavailable"}
    responses = {"200": ok, **{code: {"$ref": _ERR + name} for code, name in statuses.items() if code in errors}}
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if secured:
        op["security"] = [{"bearerAuth": []}]
    if body is not None:
        # a body none of whose fields is required may be left out altogether
        op["requestBody"] = {"required": body.get("required") != [], "content": {"application/json": {
            "schema": body}}}
    if query:
        op["parameters"] = [{"name": n, "in": "query", "required": bool(s.get("x-required")),
                             "schema": {k: v for k, v in s.items() if k != "x-required"}} for n, s in query]
    return op


def _paths(model: str, max_model_len: int, vocab: int, max_logprobs: int) -> dict[str, dict]:
    body = lambda endpoint: request_schema(endpoint, model, max_model_len, vocab, max_logprobs)  # noqa: E731
    ref = lambda name: {"$ref": "#/components/schemas/" + name}  # noqa: E731
    gen_errors = ("400", "401", "404", "413", "503")
    events = {"text/event-stream": {"schema": {  # one server-sent event (before OpenAPI 3.2 the schema is per event)
        "type": "object", "required": ["data"], "properties": {"event": STR, "data": {
            **STR, "description": "a chunk as JSON (an error body if the request failed mid-stream), then [DONE]"}}}}}
    query_int = {"type": "integer", "minimum": 0, "maximum": QUERY_INT_MAX}
    text = {"description": "Prometheus text", "content": {"text/plain": {"schema": STR}}}
    return {
        "/v1/completions": {"post": _operation(
            "a completion of a prompt", {"description": "the completion, or its event stream with stream: true",
                                         "content": {"application/json": {"schema": ref("Completion")}, **events}},
            gen_errors, body("completions"))},
        "/v1/chat/completions": {"post": _operation(
            "the next message of a chat", {"description": "the message, or its event stream with stream: true",
                                           "content": {"application/json": {"schema": ref("ChatCompletion")},
                                                       **events}}, gen_errors, body("chat"))},
        "/v1/models": {"get": _operation("the served model", _json(ref("Models"), "the one model"), ("400", "401"))},
        "/v1/models/{model}": {"get": {**_operation("a model by its name: the served one", _json(
            ref("Model"), "the served model"), ("400", "401", "404")), "parameters": [
                {"name": "model", "in": "path", "required": True, "schema": STR}]}},
        "/tokenize": {"post": _operation(
            "the token ids of a prompt or of a chat (vLLM)", _json(ref("Tokenize"), "the tokens"),
            ("400", "401", "404", "413"), {"oneOf": [body("tokenize"), body("tokenize_chat")]})},
        "/detokenize": {"post": _operation(
            "the text of token ids (vLLM)", _json(ref("Detokenize"), "the text"), ("400", "401", "404", "413"),
            body("detokenize"))},
        "/admin/reset_prefix_cache": {"post": _operation(
            "drop the prefix cache of every rank, or of one", _json({"type": "object"}, "done on every group up"),
            ("400", "401", "413", "503"), body("reset_prefix_cache"),
            (("rank", query_int),))},
        "/admin/steps": {"get": _operation(
            "a group's step timings", _json(ref("Steps"), "one array per step"), ("400", "401", "404"),
            query=(("group", STR), ("since", query_int)))},
        "/admin/drain": {"post": _operation(
            "stop routing to a group; answered once it holds nothing", _json({"type": "object"}, "drained"),
            ("400", "401", "404"),
            query=(("group", GROUP), ("migrate", {"type": "string", "enum": ["true", "false"]})))},
        "/admin/resume": {"post": _operation(
            "route to a drained group again", _json({"type": "object"}, "resumed"), ("400", "401", "404"),
            query=(("group", GROUP),))},
        "/health": {"get": _operation("200 while some group can serve", _json(
            {"type": "object"}, "every group: up, reason, step"), ("400", "503"), secured=False)},
        "/metrics": {"get": _operation("Prometheus metrics", text, ("400",), secured=False)},
        "/openapi.json": {"get": _operation("this document", _json({"type": "object"}, "OpenAPI 3.1"), ("400",),
                                            secured=False)},
        "/version": {"get": _operation("the Lockstep version", _json(
            {"type": "object", "required": ["version"], "properties": {"version": STR}}, "vLLM's shape"), ("400",),
            secured=False)},
    }


def openapi_document(model: str, max_model_len: int, vocab: int, version: str,
                     max_logprobs: int = g.MAX_LOGPROBS) -> dict:
    """The whole document for a server of `model` (its context length and tokenizer vocabulary) and of the
    coordinator's --max-logprobs."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "Lockstep", "version": version,
                 "description": "OpenAI-compatible API of a Lockstep coordinator. A field not listed for an endpoint "
                                "is a 400 naming it; null means not sent."},
        "paths": _paths(model, max_model_len, vocab, max_logprobs),
        "components": {"schemas": _schemas(), "responses": _responses(),
                       "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}}},
    }
