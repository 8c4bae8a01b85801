"""The router's /openapi.json is the contract: every route a client calls, every field as the router decides it, and
the router keeps to it (schemathesis against the router with fake workers; the real workers: tests/e2e_smollm2/
test_schema_fuzz.py)."""

from __future__ import annotations

import os
from contextlib import ExitStack

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from jsonschema import Draft202012Validator
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from router.app import create_app
from router.checks.inventory import TABLES, Decision
from router.config import RouterConfig
from tests.fakes import FakeWorker, ServerThread

PD_ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses"]
CONVERSATION_POSTS = ["/v1/conversations", "/v1/conversations/{conversation_id}/items"]  # the router's store
EXAMPLES = int(os.environ.get("PDCLUSTER_OPENAPI_EXAMPLES", "60"))  # per route and mode: seconds against fakes; more
# to hunt (the real fuzz run, tests/e2e_smollm2/test_schema_fuzz.py, has its own budget)


@pytest.fixture(scope="module")
def router_url():
    with ExitStack() as stack:
        p = stack.enter_context(ServerThread(FakeWorker().app()))
        d = stack.enter_context(ServerThread(FakeWorker().app()))
        model = {"vocab_size": 1000, "context_length": 2048}
        config = RouterConfig(bootstrap_url=None, prefill=[{"url": p.url, "kv_bootstrap_port": 8999, **model}],
                              decode=[{"url": d.url, **model}], health_interval=0.2)
        yield stack.enter_context(ServerThread(create_app(config))).url


@pytest.fixture(scope="module")
def contract(router_url) -> dict:
    return httpx.get(f"{router_url}/openapi.json").json()


def test_every_route_a_client_calls_is_described(contract):
    assert set(PD_ROUTES) | {"/v1/models", "/get_model_info", "/metrics", "/health", "/ready"} <= set(
        contract["paths"])
    for route in PD_ROUTES:
        post = contract["paths"][route]["post"]
        assert {"200", "400", "502", "503", "504"} <= set(post["responses"])
        assert set(post["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(contract["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}


def test_the_stored_responses_and_conversations_routes_are_described_as_the_router_answers(contract):
    stored = {path: item for path, item in contract["paths"].items()
              if path.startswith(("/v1/responses/", "/v1/conversations"))}
    assert {"/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items", "/v1/conversations",
            "/v1/conversations/{conversation_id}/items"} <= set(stored)
    for item in stored.values():
        for operation in item.values():
            assert {"200", "400", "401", "404"} == set(operation["responses"]), operation  # never FastAPI's 422


def test_every_schema_is_valid_json_schema(contract):
    for name, schema in contract["components"]["schemas"].items():
        Draft202012Validator.check_schema(schema), name


@pytest.mark.parametrize(("table", "schema"), [("/generate", "Generate"), ("/generate sampling_params",
                                                                         "SamplingParams"),
                                               ("/v1/chat/completions", "ChatCompletion"),
                                               ("/v1/chat/completions messages[]", "Message"),
                                               ("/v1/completions", "Completion"),
                                               ("/v1/responses", "Responses"),
                                               ("/v1/responses input[]", "ResponsesInputItem")])
def test_the_request_schemas_are_the_inventory(contract, table, schema):
    """Every field of the table and no other; a refused field takes only null or SGLang's default."""
    properties = contract["components"]["schemas"][schema]["properties"]
    rules = TABLES[table]
    assert set(properties) == set(rules)
    assert contract["components"]["schemas"][schema]["additionalProperties"] is False
    for key, rule in rules.items():
        accepts = Draft202012Validator({**properties[key], "$defs": {}}).is_valid
        if rule.decision is Decision.REFUSED:
            assert accepts(None) and not accepts("x") and not accepts(12345), key
            if rule.default is not None:
                assert accepts(rule.default), key


def test_a_prompt_item_that_is_empty_is_outside_the_contract(contract):
    prompt = Draft202012Validator(contract["components"]["schemas"]["Completion"]["properties"]["prompt"])
    assert prompt.is_valid(["a", "b"]) and prompt.is_valid([[1, 2], [3]]) and prompt.is_valid("a")
    assert not prompt.is_valid(["a", ""]) and not prompt.is_valid([[1], []]) and not prompt.is_valid("")


@pytest.mark.parametrize("route", [*PD_ROUTES, *CONVERSATION_POSTS])
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_the_router_keeps_to_its_contract(router_url, contract, route, mode):
    """Schema-invalid bodies are 4xx JSON errors, valid ones are never a 5xx, and every answer is documented."""
    operation = schemathesis.openapi.from_dict(contract)[route]["POST"]
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, negative_data_rejection]

    @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def send(case) -> None:
        response = case.call(base_url=router_url, timeout=30)
        case.validate_response(response, checks=checks)
        if response.status_code >= 400:
            assert set(response.json()["error"]) >= {"message", "type", "code"}

    send()


STREAMED = {"/generate": {"text": "Hello", "stream": True},
            "/v1/completions": {"model": "m", "prompt": "Hello", "stream": True},
            "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "stream": True},
            "/v1/responses": {"model": "m", "input": "Hello", "stream": True}}


@pytest.mark.parametrize("route", PD_ROUTES)
def test_a_streamed_answer_keeps_to_its_event_schema(router_url, contract, route):
    """schemathesis reads a `text/event-stream` schema as one event's ({data, event, id, retry}): a schema of the
    whole stream as a string failed the real fuzzer on the first streamed answer it checked."""
    operation = schemathesis.openapi.from_dict(contract)[route]["POST"]
    case = operation.Case(body=STREAMED[route])
    response = case.call(base_url=router_url, timeout=30)
    assert response.status_code == 200 and response.headers["content-type"][0].startswith("text/event-stream")
    case.validate_response(response, checks=[response_schema_conformance, content_type_conformance])


@pytest.mark.parametrize("route", [*PD_ROUTES, "/ready"])
@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH"])
def test_a_wrong_method_is_405_with_allow(router_url, route, method):
    response = httpx.request(method, f"{router_url}{route}")
    assert response.status_code == 405
    assert response.headers["allow"] == ("POST" if route in PD_ROUTES else "GET")
    assert response.json()["error"]["code"] == 405
