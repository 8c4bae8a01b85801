"""`POST /v1/responses`: a Responses request served as the chat request of its conversation, through the chat path
(router/service.py's `serve`: the same pairing, retries, aborts, checks and tracing), and its answer as a Response
object, whole or streamed (router/openai/responses_render.py, responses_stream.py). The store (router/store/): a
response is kept with this turn's input items unless `store` is false (OpenAI's default keeps it), before the client
gets it (streamed: before response.completed), so that the next turn's `previous_response_id` always finds it. That
chain is rebuilt from the store, the caller's own turns only (`owner_of`: router/service.py): another owner's id is not
found. The stored turns' routes: router/openai/responses_routes.py.
"""

from __future__ import annotations

import json  # as SGLang wrote the answer: logprobs may be -Infinity, which json reads and writes back, orjson not
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import Any

import orjson

from pdcluster.common.http import ApiError
from router.checks.checked import Checked
from router.checks.responses_checks import check_responses
from router.checks.validation import check_chat
from router.openai import responses_render as render
from router.openai.responses_stream import ResponseEvents
from router.pd.request import PdRequest
from router.store import NewResponse, NotFound, Store, StoredResponse, new_id
from router.transport.edge import Answer, StreamAnswer, error_answer

log = logging.getLogger("pdcluster.router")

RESPONSES_ROUTE = "/v1/responses"
# The chat request of a response as the service makes a PdRequest of it, and the service's `serve`.
MakeRequest = Callable[[dict[str, Any], Checked], PdRequest]
Serve = Callable[[PdRequest], Awaitable[Answer | StreamAnswer]]
NO_STORE = "this router keeps no store (store.backend: none)"


class ResponsesApi:
    def __init__(self) -> None:
        self.store: Store | None = None  # opened at start-up (router/app.py's lifespan); None: `store.backend: none`

    async def answer(self, body: dict[str, Any], owner: str, make_request: MakeRequest,
                     serve: Serve) -> Answer | StreamAnswer:
        """`owner`: who owns what this turn reads and stores (router/service.py's `owner_of`)."""
        metadata = body.get("metadata")  # ignored by the checks (left out of the body), but echoed
        check_responses(body)
        if metadata is not None:
            body["metadata"] = metadata
        keep = self._keeps(body)
        body["store"] = keep  # as the answer says it
        items = render.input_items(body["input"])
        conversation = body.get("conversation")
        if isinstance(conversation, dict):
            conversation = body["conversation"] = conversation["id"]
        if keep or conversation is not None:
            self._fits(items, render.settings(body) if keep else {})
        history = await self._history(owner, body.get("previous_response_id"), conversation)
        chat = render.chat_body(body, history + items)
        try:
            checked = check_chat(chat)
        except ApiError as exc:  # named as the client named it
            raise _renamed(exc) from None
        checked = replace(checked, prompt_field="input", counts=tuple(
            (render.client_field(field) or field, value, limit) for field, value, limit in checked.counts))
        response_id = new_id("resp")
        answer = await serve(make_request(chat, checked))
        finished = partial(self._finished, owner, keep, body, items, conversation)
        if isinstance(answer, StreamAnswer):
            answer.chunks = ResponseEvents(response_id, body, finished).relay(answer.chunks)
            return answer
        if answer.status != 200:
            return answer  # the chat's error, in the same (OpenAI's) envelope
        try:
            response = render.from_chat(response_id, body, json.loads(answer.body))
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            log.warning("chat answer not shaped", extra={"response_id": response_id, "error": repr(exc)})
            return error_answer(502, "a decode answered with no chat choice to make a response of")
        await finished(response)
        return Answer(200, orjson.dumps(response), answer.headers)

    def _keeps(self, body: dict[str, Any]) -> bool:
        if self.store is None:
            if body.get("store") is True:
                raise ApiError(400, f"store: {NO_STORE}", "store")
            return False
        return body.get("store") is not False

    def _fits(self, items: list[dict[str, Any]], settings: dict[str, Any]) -> None:
        """400 naming the input item (or the settings) over the store's bound, before any worker runs the request."""
        if self.store is None:
            return  # nothing is kept (a conversation is then refused, by `_history`)
        limit = self.store.db.max_item_bytes
        if (size := len(orjson.dumps(settings))) > limit:
            raise ApiError(400, f"store: the request's settings (tools, instructions, ...) are {size} bytes as JSON; a "
                                f"stored response keeps at most {limit} (send store: false)", "store")
        for i, item in enumerate(items):
            if (size := len(orjson.dumps(item))) > limit:
                raise ApiError(400, f"input[{i}] is {size} bytes as JSON; a stored item is at most {limit} bytes",
                               f"input[{i}]")

    async def _history(self, owner: str, previous: str | None, conversation: str | None) -> list[dict[str, Any]]:
        """The earlier turns' items: of the chain `previous` ends, or the conversation's (instructions are not among
        them)."""
        field = "conversation" if conversation is not None else "previous_response_id"
        if previous is None and conversation is None:
            return []
        if self.store is None:
            raise ApiError(400, f"{field}: {NO_STORE}", field)
        try:
            if conversation is not None:
                return [stored.item for stored in await self.store.conversations.list_items(owner, conversation)]
            assert previous is not None
            return await self.store.responses.rebuild_input(owner, previous)
        except NotFound as missing:
            raise ApiError(404, f"{field}: {missing}", field) from None

    async def _finished(self, owner: str, keep: bool, body: dict[str, Any], items: list[dict[str, Any]],
                        conversation: str | None, response: dict[str, Any]) -> None:
        """The response kept (if it is to be), and its input and output added to its conversation, before the client
        gets it."""
        if not keep and conversation is None:
            return
        assert self.store is not None
        field = "conversation" if conversation is not None else "previous_response_id"
        try:
            if keep:
                await self.store.responses.put(owner, NewResponse(
                    model=response["model"], status=response["status"], input_items=items,
                    output_items=response["output"], usage=response["usage"],
                    previous_response_id=response["previous_response_id"], conversation_id=conversation,
                    id=response["id"], settings=render.settings(body)))
            if conversation is not None:
                await self.store.conversations.add_items(owner, conversation, [*items, *response["output"]])
        except NotFound as missing:  # deleted (or expired) while this turn ran
            raise ApiError(404, f"{field}: {missing}", field) from None
        except Exception as exc:
            log.warning("store: a response was not stored", extra={"response_id": response["id"], "error": repr(exc)})
            raise ApiError(503, "the response was made but could not be stored (the router's log has the "
                                "details)") from None

    async def stored(self, owner: str, response_id: str) -> StoredResponse:
        """The owner's stored response; 404 for none (absent, expired, deleted, or another owner's)."""
        found = await self.store.responses.get(owner, response_id) if self.store is not None else None
        if found is None:
            raise ApiError(404, f"response with id '{response_id}' not found", "response_id")
        return found


def _renamed(exc: ApiError) -> ApiError:
    """A chat check's refusal, its field named as the Responses request has it."""
    field = render.client_field(exc.param)
    message = exc.message
    if exc.param and field != exc.param and message.startswith(exc.param):
        message = field + message[len(exc.param):] if field else message
    return ApiError(exc.status, message, field)


def stored_object(stored: StoredResponse) -> dict[str, Any]:
    """A stored response as GET /v1/responses/{id} answers it: as it was created (a row stored without its settings
    shows OpenAI's defaults)."""
    incomplete = {"reason": "max_output_tokens"} if stored.status == "incomplete" else None
    body = {**(stored.settings or {}), "previous_response_id": stored.previous_response_id,
            "conversation": stored.conversation_id}
    return render.response_object(stored.id, body,
                                  status=stored.status, output=stored.output_items, usage_=stored.usage,
                                  incomplete=incomplete, created=stored.created, model=stored.model)
