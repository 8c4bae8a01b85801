"""OpenAI's Conversations API on the router's store (router/store/conversations.py): create, get and delete a
conversation; list, add, get and delete its items. A response given a `conversation` reads its items as the turns before
its input, and adds its input and output to it (router/openai/responses_api.py). FastAPI's routes, each behind the
caller's authentication; every conversation is its owner's (`owner_of`: router/service.py): another owner's is not found
(404). Items are checked as a response's input items are (router/checks/responses_checks.py), at most 20 per request."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request

from pdcluster.common.http import ApiError, read_json_object
from router.checks.responses_checks import check_conversation_body
from router.openai.responses_api import NO_STORE, ResponsesApi
from router.openai.responses_render import input_items
from router.store import Conversation, ConversationItem, ItemTooLarge, NotFound, Store

ROUTE = "/v1/conversations"
MAX_PAGE = 100


def _object(conversation: Conversation) -> dict[str, Any]:
    return {"id": conversation.id, "object": "conversation", "created_at": int(conversation.created),
            "metadata": conversation.metadata}


def _item(stored: ConversationItem) -> dict[str, Any]:
    """An item as it was given, under the id the store gave it."""
    return {**stored.item, "id": stored.id}


def _page(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


def _missing(conversation_id: str) -> ApiError:
    return ApiError(404, f"conversation with id '{conversation_id}' not found", "conversation_id")


def _missing_item(conversation_id: str, item_id: str) -> ApiError:
    return ApiError(404, f"item with id '{item_id}' not found in conversation {conversation_id}", "item_id")


class ConversationRoutes:
    def __init__(self, api: ResponsesApi, owner_of: Callable[[Request], str], max_body_bytes: int) -> None:
        self.api, self.owner_of, self.max_body_bytes = api, owner_of, max_body_bytes

    def install(self, app: FastAPI) -> None:
        item = ROUTE + "/{conversation_id}/items/{item_id}"
        routes: list[tuple[str, str, Callable[..., Awaitable[dict]]]] = [
            (ROUTE, "POST", self.create), (ROUTE + "/{conversation_id}", "GET", self.retrieve),
            (ROUTE + "/{conversation_id}", "DELETE", self.delete),
            (ROUTE + "/{conversation_id}/items", "GET", self.list_items),
            (ROUTE + "/{conversation_id}/items", "POST", self.add_items), (item, "GET", self.get_item),
            (item, "DELETE", self.delete_item)]
        for path, method, serve in routes:
            app.add_api_route(path, serve, methods=[method])

    async def _opened(self, request: Request) -> tuple[Store, str]:
        """The store and the caller's owner string, once the caller is let in."""
        owner = self.owner_of(request)
        if self.api.store is None:
            raise ApiError(404, f"no conversations: {NO_STORE}")
        return self.api.store, owner

    async def _new_items(self, request: Request,
                         fields: tuple[str, ...]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        body = await read_json_object(request, self.max_body_bytes)
        return body, input_items(check_conversation_body(body, fields))

    async def create(self, request: Request) -> dict:
        store, owner = await self._opened(request)
        body, items = await self._new_items(request, ("items", "metadata"))
        try:
            conversation, _ = await store.conversations.create(owner, body.get("metadata") or {}, items)
        except ItemTooLarge as large:
            raise ApiError(400, str(large), large.field) from None
        return _object(conversation)

    async def retrieve(self, request: Request, conversation_id: str) -> dict:
        store, owner = await self._opened(request)
        conversation = await store.conversations.get(owner, conversation_id)
        if conversation is None:
            raise _missing(conversation_id)
        return _object(conversation)

    async def delete(self, request: Request, conversation_id: str) -> dict:
        store, owner = await self._opened(request)
        if not await store.conversations.delete(owner, conversation_id):
            raise _missing(conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    async def list_items(self, request: Request, conversation_id: str, after: str | None = None,
                         limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 20,
                         order: Literal["asc", "desc"] = "desc") -> dict:
        store, owner = await self._opened(request)
        try:
            found = await store.conversations.list_items(owner, conversation_id, after=after, limit=limit + 1,
                                                         newest_first=order == "desc")
        except NotFound as missing:
            raise (_missing(conversation_id) if missing.kind == "conversation" else
                   ApiError(404, f"after: {missing}", "after")) from None
        return _page([_item(stored) for stored in found[:limit]], len(found) > limit)

    async def add_items(self, request: Request, conversation_id: str) -> dict:
        store, owner = await self._opened(request)
        _, items = await self._new_items(request, ("items",))
        try:
            added = await store.conversations.add_items(owner, conversation_id, items)
        except NotFound:
            raise _missing(conversation_id) from None
        except ItemTooLarge as large:
            raise ApiError(400, str(large), large.field) from None
        return _page([_item(stored) for stored in added], False)

    async def get_item(self, request: Request, conversation_id: str, item_id: str) -> dict:
        store, owner = await self._opened(request)
        found = await store.conversations.get_item(owner, conversation_id, item_id)
        if found is None:
            raise _missing_item(conversation_id, item_id)
        return _item(found)

    async def delete_item(self, request: Request, conversation_id: str, item_id: str) -> dict:
        """OpenAI answers with the conversation the item was deleted from."""
        store, owner = await self._opened(request)
        try:
            deleted = await store.conversations.delete_item(owner, conversation_id, item_id)
        except NotFound:
            raise _missing(conversation_id) from None
        conversation = await store.conversations.get(owner, conversation_id)
        if not deleted or conversation is None:
            raise _missing_item(conversation_id, item_id)
        return _object(conversation)


def install(app: FastAPI, api: ResponsesApi, owner_of: Callable[[Request], str], max_body_bytes: int) -> None:
    """`owner_of`: the caller let in (401 otherwise) and who owns what it reads and writes."""
    ConversationRoutes(api, owner_of, max_body_bytes).install(app)
