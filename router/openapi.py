"""The router's OpenAPI document: the contract a schema-driven client, gateway or fuzzer reads.

The PD routes are served by the edge, not FastAPI (router/transport/edge.py), so FastAPI cannot describe them:
their request schemas are made here from the same inventory the router checks with (router/checks/inventory/), field by
field. A refused field appears as what the router takes of it (null, or SGLang's own default, both "not given"); a field
in no table is not there, and `additionalProperties: false` says the router refuses it. What depends on the pair that
serves a request (token ids < its vocabulary, counts <= its context length) is said in the field's description: no
static schema can hold it. Exactly one of text and input_ids is in the schema; other rules across fields (one
sampling_params per batch item, as many rids as items) are the router's 400s. An integer is one as JSON writes it (5,
not 5.0): the router's types are strict, as SGLang's are. The rest of the document is FastAPI's (the GET routes), with
/metrics declared as what it serves, Prometheus text.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter

from router.checks.inventory import CHAT, COMPLETION, GENERATE, INPUT_ITEM, MESSAGE, RESPONSES, SAMPLING, Decision, Rule
from router.checks.inventory.openai_types import Metadata
from router.checks.inventory.responses import MAX_NEW_ITEMS
from router.checks.inventory.rules import INT32, MAX_BATCH, MAX_MESSAGES
from router.checks.responses_checks import ITEM_FIELDS
from router.checks.validation import REQUIRED, REQUIRED_IN

_REF = "#/components/schemas/{model}"
_NULL = {"type": "null"}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": INT32}}
_ID_BATCH = {"type": "array", "minItems": 1, "maxItems": MAX_BATCH, "items": _TOKEN_IDS}
_TEXT = {"type": "string", "minLength": 1}
_TEXTS = {"type": "array", "minItems": 1, "maxItems": MAX_BATCH, "items": _TEXT}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


# Fields whose inventory type is looser than the contract, because the router decides them in code (for speed, or
# item by item): their schemas, as the router's checks in router/checks/validation.py decide.
_SCHEMA_OF: dict[tuple[str, str], dict[str, Any]] = {
    ("Generate", "input_ids"): {"anyOf": [_TOKEN_IDS, _ID_BATCH]},
    ("Generate", "sampling_params"): {"anyOf": [_ref("SamplingParams"), {
        "type": "array", "minItems": 1, "maxItems": MAX_BATCH, "items": _ref("SamplingParams")}]},
    ("Completion", "prompt"): {"anyOf": [_TEXT, _TEXTS, _TOKEN_IDS, _ID_BATCH]},
    ("ChatCompletion", "messages"): {"type": "array", "minItems": 1, "maxItems": 1024, "items": _ref("Message")},
    ("Responses", "input"): {"anyOf": [_TEXT, {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES,
                                               "items": _ref("ResponsesInputItem")}]},
    ("SamplingParams", "top_k"): {"type": "integer", "minimum": -1, "maximum": 2**30, "not": {"const": 0}},
    # Empty (`""`) too: an assistant's with calls or a refusal, a tool's or function's may be
    # (router/checks/chat_checks.py).
    ("Message", "content"): {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {
        "type": "object", "additionalProperties": False, "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
}

_TABLES = {"Generate": GENERATE, "SamplingParams": SAMPLING, "ChatCompletion": CHAT, "Message": MESSAGE,
           "Completion": COMPLETION, "Responses": RESPONSES, "ResponsesInputItem": INPUT_ITEM}
# The tables whose required fields are their own (router/checks/validation.py's REQUIRED_IN), by their check's name.
_REQUIRED_OF = {"Responses": REQUIRED_IN["responses"], "ResponsesInputItem": REQUIRED_IN["input item"]}


def _field_schema(table: str, key: str, rule: Rule, components: dict[str, Any]) -> dict[str, Any]:
    if rule.decision is Decision.REFUSED:
        taken = [{"const": rule.default}, _NULL] if rule.default is not None else [_NULL]
        return {"anyOf": taken, "description": f"refused: {rule.reason} (only null or SGLang's default, which ask "
                                                f"for nothing, are taken)"}
    schema = _SCHEMA_OF.get((table, key))
    if schema is None:
        schema = TypeAdapter(rule.type).json_schema(ref_template=_REF)
        components.update(schema.pop("$defs", {}))
    description = rule.reason + (f"; {rule.pair.value}" if rule.pair else "")
    if key not in _REQUIRED_OF.get(table, REQUIRED) and not _allows_null(schema):
        schema = {"anyOf": [schema, _NULL]}  # the router takes a null as "not given"
    return {**schema, "description": description} if description else schema


def _allows_null(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "null" or any(_allows_null(s) for s in schema.get("anyOf", []))


def _given(key: str) -> dict[str, Any]:
    return {"required": [key], "properties": {key: {"not": _NULL}}}


def _item_of(kind: str) -> dict[str, Any]:
    """An input item of one type: its fields given (a message may leave its type out)."""
    required = list(ITEM_FIELDS[kind]) if kind == "message" else ["type", *ITEM_FIELDS[kind]]
    return {"required": required, "properties": {"type": {"const": kind}}}


# Rules across fields that a schema can hold (the rest are the router's 400s, as the module's docstring says).
_ACROSS: dict[str, dict[str, Any]] = {"Generate": {"oneOf": [_given("text"), _given("input_ids")]},
                                      "ResponsesInputItem": {"anyOf": [_item_of(kind) for kind in ITEM_FIELDS]}}


def _object(table: str, components: dict[str, Any]) -> dict[str, Any]:
    rules = _TABLES[table]
    return {"type": "object", "additionalProperties": False,
            "properties": {key: _field_schema(table, key, rule, components) for key, rule in rules.items()},
            "required": [key for key in rules if key in _REQUIRED_OF.get(table, REQUIRED)], **_ACROSS.get(table, {})}


_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": "integer"}}}}}
# One server-sent event, as schemathesis and OpenAPI 3.2 read a `text/event-stream` schema: the event's fields.
_STREAM = {"type": "object", "required": ["data"], "description": (
    "One server-sent event: `data: <JSON>` (the route's answer object, in pieces), a final `data: [DONE]` on the "
    "OpenAI routes; a failure after the first event is one last `data: {\"error\": ...}`."),
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                   "retry": {"type": "integer"}}}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
_GENERATED = {"type": "object", "required": ["meta_info"], "properties": {
    "text": {"type": "string"}, "output_ids": {"type": "array", "items": {"type": "integer"}},
    "meta_info": {"type": "object", "required": ["id", "prompt_tokens", "completion_tokens", "finish_reason"]}}}
_ANSWERS = {
    "GenerateAnswer": {"anyOf": [_GENERATED, {"type": "array", "items": _GENERATED}]},
    "CompletionAnswer": {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
        "object": {"const": "text_completion"}, "usage": _USAGE, "choices": {"type": "array", "items": {
            "type": "object", "required": ["index", "text", "finish_reason"],
            "properties": {"index": {"type": "integer"}, "text": {"type": "string"}}}}}},
    "ChatCompletionAnswer": {"type": "object", "required": ["id", "object", "created", "model", "choices"],
                             "properties": {"object": {"const": "chat.completion"}, "usage": _USAGE, "choices": {
                                 "type": "array", "items": {"type": "object", "required": [
                                     "index", "message", "finish_reason"], "properties": {
                                     "index": {"type": "integer"}, "message": {"type": "object", "required": [
                                         "role"], "properties": {"role": {"const": "assistant"}}}}}}}},
    "ResponseAnswer": {"type": "object", "required": ["id", "object", "created_at", "status", "output"],
                       "properties": {"object": {"const": "response"}, "output": {"type": "array", "items": {
                           "type": "object", "required": ["type"]}}}},
    "Error": _ERROR,
}
# What each PD route may answer besides 200: the request's fault, the router's limits, a failed or missing worker.
_ERRORS = {"400": "a field the router refuses, named in `param`; or a worker's own refusal, with its reason",
           "401": "a missing or wrong bearer token (when the router is configured with one)",
           "404": "a model no worker serves (`model_not_found`)",
           "413": "a body over the router's max_body_bytes", "415": "a body that is not JSON",
           "429": "a tenant over its quota, or a prefill wait over its bound (`Retry-After`, seconds)",
           "502": "a worker failed the request", "503": "no usable prefill/decode pair",
           "504": "a worker or the whole request ran out of time"}
_PD_ROUTES = {"/generate": ("Generate", "GenerateAnswer", "SGLang's native generation, through a PD pair"),
              "/v1/completions": ("Completion", "CompletionAnswer", "OpenAI completions, through a PD pair"),
              "/v1/chat/completions": ("ChatCompletion", "ChatCompletionAnswer",
                                       "OpenAI chat completions, through a PD pair"),
              "/v1/responses": ("Responses", "ResponseAnswer",
                                "OpenAI responses, as the chat completion of the conversation, through a PD pair")}
# What a route may answer besides the PD routes' errors.
_MORE_ERRORS = {"/v1/responses": {"404": "a previous_response_id that is not one of the caller's stored responses"}}


def _pd_operation(request: str, answer: str, summary: str, errors: dict[str, str]) -> dict[str, Any]:
    error = {"application/json": {"schema": _ref("Error")}}
    return {"post": {
        "summary": summary, "operationId": request[0].lower() + request[1:],
        "parameters": [{"name": "X-Request-ID", "in": "header", "required": False, "schema": {
            "type": "string", "pattern": "^[A-Za-z0-9._:@/+=-]{1,128}$"}}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": {"description": "the answer (a stream when `stream` is true)", "content": {
            "application/json": {"schema": _ref(answer)}, "text/event-stream": {"schema": _STREAM}}},
            **{status: {"description": why, "content": error} for status, why in {**_ERRORS, **errors}.items()}}}}


def _stored_routes(paths: dict[str, Any]) -> None:
    """FastAPI's routes of stored responses and conversations, with the answers the router gives: a refused parameter
    is its 400 (not FastAPI's 422), another owner's or an absent id a 404, a missing bearer token a 401."""
    error = {"application/json": {"schema": _ref("Error")}}
    for path, item in paths.items():
        if not path.startswith(("/v1/responses/", "/v1/conversations")):
            continue
        for method, operation in item.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            responses.update({status: {"description": _STORED_ERRORS[status], "content": error}
                              for status in _STORED_ERRORS})
            if method == "post" and path in _CONVERSATION_BODIES:
                body, answer = _CONVERSATION_BODIES[path]
                operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(body)}}}
                responses["200"] = {"description": "the conversation, or the items added",
                                    "content": {"application/json": {"schema": _ref(answer)}}}


# The conversations' POST bodies (read by the route itself, router/openai/conversations_routes.py), as
# router/checks/responses_checks.py's check_conversation_body decides them, and their answers.
_CONVERSATION_BODIES = {"/v1/conversations": ("ConversationCreate", "Conversation"),
                        "/v1/conversations/{conversation_id}/items": ("ConversationItems", "ConversationItemList")}
_NEW_ITEMS = {"type": "array", "maxItems": MAX_NEW_ITEMS, "items": _ref("ResponsesInputItem")}
_CONVERSATION_SCHEMAS = {
    "ConversationCreate": {"type": "object", "additionalProperties": False, "properties": {
        "items": {"anyOf": [_NEW_ITEMS, _NULL]},
        "metadata": {"anyOf": [TypeAdapter(Metadata).json_schema(), _NULL]}}},
    "ConversationItems": {"type": "object", "additionalProperties": False, "required": ["items"],
                          "properties": {"items": _NEW_ITEMS}},
    "Conversation": {"type": "object", "required": ["id", "object", "created_at", "metadata"],
                     "properties": {"object": {"const": "conversation"}, "metadata": {"type": "object"}}},
    "ConversationItemList": {"type": "object", "required": ["object", "data", "first_id", "last_id", "has_more"],
                             "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
                                 "type": "object", "required": ["id", "type"]}}}},
}
_STORED_ERRORS = {"400": "a field or parameter the router refuses, named in `param`", "401": _ERRORS["401"],
                  "404": "no such id among the caller's (another owner's is not found either)"}


def document(fastapi_document: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's document for the GET routes, with the PD routes and their schemas added."""
    doc = {**fastapi_document}
    components: dict[str, Any] = {}
    schemas = {name: _object(name, components) for name in _TABLES}
    doc["components"] = {**doc.get("components", {}),
                         "schemas": {**doc.get("components", {}).get("schemas", {}), **components, **schemas,
                                     **_ANSWERS, **_CONVERSATION_SCHEMAS}}
    doc["paths"] = {**{path: _pd_operation(*spec, _MORE_ERRORS.get(path, {})) for path, spec in _PD_ROUTES.items()},
                    **doc["paths"]}
    _stored_routes(doc["paths"])
    metrics = doc["paths"].get("/metrics", {}).get("get")
    if metrics is not None:
        metrics["responses"] = {"200": {"description": "Prometheus text exposition format", "content": {
            "text/plain": {"schema": {"type": "string"}}}}}
    return doc
