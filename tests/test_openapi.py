"""GET /openapi.json is true to the code: every route the server has is in it and nothing else, its request
schemas accept what the server accepts and refuse what it refuses, and schemathesis, fuzzing a real served
group against it, finds no 5xx, no response that breaks the document, and no group restart."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from jsonschema import Draft202012Validator
from schemathesis.specs.openapi.checks import positive_data_acceptance

import lockstep
from checkpoints import VOCAB
from lockstep.coordinator.openai_api import OpenAIServer
from lockstep.coordinator.openai_fields import IMPLEMENTED, NOOP
from lockstep.coordinator.openapi import OPEN_PATHS, QUERY_PARAMS, openapi_document, request_schema
from test_generation import TOK, FakeFrontend, _http
from test_request_edge import ACCEPTED, REFUSED

KEY = "fuzz-key"
CONTEXT = 64  # the fuzzed group's context: a request runs at most 63 steps
FUZZ_EXAMPLES = 20  # random cases per operation, on top of the explicit and coverage ones
SCHEMA = schemathesis.openapi.from_dict(openapi_document("tiny", CONTEXT, VOCAB, lockstep.__version__))
SCHEMA.config.seed = 8  # the same cases every run: a failure here is a change, not luck
STATUSES: Counter = Counter()
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def _document() -> dict:
    async def get(c):
        resp = await c.get("/openapi.json")
        return await resp.json()

    return _http(FakeFrontend([]), [get])[0]


def test_every_route_is_documented_and_every_documented_route_exists():
    app = OpenAIServer(FakeFrontend([])).app()
    served = {(r.method.lower(), r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    doc = _document()
    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert served == documented
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert ("security" not in op) == (path in OPEN_PATHS), path
            params = {p["name"] for p in op.get("parameters", ()) if p["in"] == "query"}
            assert params == set(QUERY_PARAMS.get(path, ())), path


def test_the_document_has_the_served_models_limits_and_valid_schemas():
    doc = _document()
    assert doc["openapi"] == "3.1.0" and doc == openapi_document("tiny", 64, TOK.vocab_size, doc["info"]["version"])
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["properties"]["max_tokens"]["anyOf"][0]["maximum"] == 63
    assert body["properties"]["model"]["anyOf"][0]["enum"] == ["tiny"]
    for endpoint in ("completions", "chat", "reset_prefix_cache"):
        schema = request_schema(endpoint, "tiny", 64, TOK.vocab_size)
        assert set(schema["properties"]) == set(IMPLEMENTED[endpoint]) | set(NOOP[endpoint])
        Draft202012Validator.check_schema(schema)
    Draft202012Validator.check_schema({"$defs": doc["components"]["schemas"]})


@pytest.mark.parametrize("path, body", ACCEPTED)
def test_what_the_server_accepts_the_document_accepts(path, body):
    schema = request_schema(ENDPOINTS[path], "tiny", 64, TOK.vocab_size)
    assert not list(Draft202012Validator(schema).iter_errors(body))


@pytest.mark.parametrize("path, body, status, param, words", [r for r in REFUSED if isinstance(r[1], dict)])
def test_what_the_server_refuses_the_document_refuses(path, body, status, param, words):
    schema = request_schema(ENDPOINTS[path], "tiny", 64, TOK.vocab_size)
    assert list(Draft202012Validator(schema).iter_errors(body)), body


# ----- schemathesis against a real served group


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    """One rank serving the tiny Llama with a 64-token context (so a fuzzed request is at most 63 steps),
    behind an API key."""
    from cluster import Cluster, http

    model = tmp_path_factory.mktemp("short") / "tiny"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    c = Cluster(model, tp=1, kv_pages=64, log_dir=tmp_path_factory.mktemp("logs"), coordinator_args=[
        "--api-key", KEY, "--served-model-name", "tiny"])
    status, served_document = http("GET", c.url + "/openapi.json")
    assert status == 200 and served_document == SCHEMA.raw_schema  # what is fuzzed is what the server serves
    yield c
    c.close()


@SCHEMA.parametrize()
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_schemathesis(case, served):
    """Every phase schemathesis has (explicit examples, coverage of every boundary, random fuzzing), positive
    and negative: no 5xx, every answer true to the document."""
    auth = {"Authorization": f"Bearer {KEY}"}
    response = case.call(base_url=served.url, headers=auth, timeout=60)
    STATUSES[(case.operation.label, response.status_code)] += 1
    case.validate_response(response, headers=auth, excluded_checks=[positive_data_acceptance])
    if case.meta is not None and case.meta.generation.mode == "positive" and response.status_code == 400:
        assert _beyond_the_schema(response.json()), (response.text, case.body)


def _beyond_the_schema(answer: dict) -> bool:
    """A 400 for a request the document calls valid is right only for a limit no JSON schema states: the
    prompt's length in tokens (with max_tokens) against the context, a rank past the group's size (or two
    different ranks in the query and the body), a conversation the model's chat template refuses, or
    min_tokens above max_tokens (a comparison of two fields)."""
    code, param, message = answer["error"]["code"], answer["error"]["param"], answer["error"]["message"]
    return any((code == "context_length_exceeded",
                param == "rank" and ("has ranks" in message or "given twice" in message),
                message.startswith("the chat template"), message == "the prompt is empty",
                param == "min_tokens" and "must not exceed" in message))


def test_the_group_survived_the_fuzzing(served):
    """After every fuzzed request: the same processes, the group up without a restart, no page held."""
    from cluster import http

    cases = sum(STATUSES.values())
    if not cases:
        pytest.skip("runs after test_schemathesis, on the same group")
    print(f"schemathesis: {cases} cases; statuses {dict(sorted(Counter(s for _, s in STATUSES.elements()).items()))}")
    assert not [k for k in STATUSES if k[1] >= 500], STATUSES
    assert all(p.poll() is None for p in [served.coordinator, *served.ranks])
    status, health = http("GET", served.url + "/health")
    assert status == 200 and health["g0"]["up"], health
    assert served.metric("lockstep_rank_up") == [1.0]
    assert sum(served.metric("lockstep_requests_dropped_total")) == 0
    assert sum(served.metric("lockstep_requests_migrated_total")) == 0  # no request was replayed: no restart
    served.assert_no_leak()
    served.assert_request_table_empty()
