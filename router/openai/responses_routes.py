"""The stored responses' routes: GET and DELETE /v1/responses/{id}, its cancel and its input items, as OpenAI answers
them. FastAPI's routes (not the edge's: no PD pair serves them), each behind the caller's authentication; every read is
the caller's own (`owner_of`: router/service.py): another owner's response is not found, as an absent one.

Cancel: only a background response can be cancelled at OpenAI, and this router makes none (`background` is refused):
a stored response is finished, and cancelling it is a 400 saying so, as OpenAI's is for a response not made in the
background."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

from fastapi import FastAPI, Query, Request

from pdcluster.common.http import ApiError
from router.openai.responses_api import RESPONSES_ROUTE, ResponsesApi, stored_object

MAX_PAGE = 100


def install(app: FastAPI, api: ResponsesApi, owner_of: Callable[[Request], str]) -> None:
    """`owner_of`: the caller let in (401 otherwise) and who owns what it reads."""

    @app.get(RESPONSES_ROUTE + "/{response_id}")
    async def retrieve(request: Request, response_id: str) -> dict:
        return stored_object(await api.stored(owner_of(request), response_id))

    @app.delete(RESPONSES_ROUTE + "/{response_id}")
    async def delete(request: Request, response_id: str) -> dict:
        owner, store = owner_of(request), api.store
        if store is None or not await store.responses.delete(owner, response_id):
            raise ApiError(404, f"response with id '{response_id}' not found", "response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post(RESPONSES_ROUTE + "/{response_id}/cancel")
    async def cancel(request: Request, response_id: str) -> dict:
        stored = await api.stored(owner_of(request), response_id)
        raise ApiError(400, f"only a background response can be cancelled; response {stored.id} was not made in the "
                            f"background (it is {stored.status})", "response_id")

    @app.get(RESPONSES_ROUTE + "/{response_id}/input_items")
    async def input_items(request: Request, response_id: str, after: str | None = None,
                          limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 20,
                          order: Literal["asc", "desc"] = "desc") -> dict:
        """This turn's input items (not the earlier turns'), newest first unless `order` is asc."""
        items = (await api.stored(owner_of(request), response_id)).input_items
        if order == "desc":
            items = items[::-1]
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise ApiError(404, f"after: item with id '{after}' not found in response {response_id}", "after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
