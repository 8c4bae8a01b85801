"""A streamed chat answer as the Responses API's events (OpenAI's types, as SGLang's serving_responses.py sends them):
response.created and response.in_progress first; the text as one message item (response.output_item.added,
response.content_part.added, response.output_text.delta..., then each one's .done), each tool call as a function_call
item (its arguments as response.function_call_arguments.delta/.done); then response.completed (or
response.incomplete, max_output_tokens) with the whole response, once `finished` (the store's write) is done. A chat
stream that fails ends with one `error` event, and nothing is stored."""

from __future__ import annotations

import json  # as SGLang wrote the answer: logprobs may be -Infinity, which json reads and writes back, orjson not
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from pdcluster.common.http import ApiError
from router.openai import responses_render as render
from router.transport.upstream_response import sse_events

# Called with the finished Response object before response.completed is sent (the store's write).
Finished = Callable[[dict[str, Any]], Awaitable[None]]


def sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: ".encode() + json.dumps(
        event, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class ResponseEvents:
    """The state of one response's stream: its items as they grow, in output order."""

    def __init__(self, response_id: str, body: dict[str, Any], finished: Finished) -> None:
        self.response_id, self.body, self.finished = response_id, body, finished
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the items, in_progress until closed
        self.text: dict[str, Any] | None = None  # the open message item
        self.calls: dict[Any, dict[str, Any]] = {}  # the open function_call items, by the chat's call index
        self.finish_reason: Any = None
        self.usage: dict[str, Any] | None = None
        self.model: str | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        out = sse({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return out

    def snapshot(self, status: str, usage: dict[str, Any] | None = None,
                 incomplete: dict[str, str] | None = None) -> dict[str, Any]:
        return render.response_object(self.response_id, self.body, status=status, output=self.output,
                                      usage_=usage, incomplete=incomplete, model=self.model)

    async def relay(self, chunks: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        events = sse_events(chunks)
        try:
            yield self.event("response.created", response=self.snapshot("in_progress"))
            yield self.event("response.in_progress", response=self.snapshot("in_progress"))
            async for raw in events:
                if not raw.startswith(b"data: {"):
                    continue  # [DONE], comments
                try:
                    data = json.loads(raw[6:])
                except ValueError:
                    continue  # not an event of a chat answer: nothing of the response
                if not isinstance(data, dict):
                    continue
                if "error" in data:
                    error = data["error"] if isinstance(data["error"], dict) else {"message": str(data["error"])}
                    yield self.event("error", code=str(error.get("code")), message=error.get("message", ""),
                                     param=error.get("param"))
                    return
                for out in self.chunk(data):
                    yield out
            for out in self.close_items():
                yield out
            status, incomplete = render.status_of(self.finish_reason)
            response = self.snapshot(status, self.usage, incomplete)
            try:
                await self.finished(response)
            except ApiError as exc:  # not stored: the client is told, as a whole answer's would be
                yield self.event("error", code=str(exc.status), message=exc.message, param=exc.param)
                return
            yield self.event(f"response.{status}", response=response)
        finally:  # closed early (the client left): the relay runs its own clean-up
            await events.aclose()
            await chunks.aclose()

    def chunk(self, data: dict[str, Any]) -> list[bytes]:
        """The events of one chat chunk."""
        self.model = data.get("model") or self.model
        if isinstance(data.get("usage"), dict):
            self.usage = render.usage(data["usage"])
        out: list[bytes] = []
        for choice in data.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self.text_delta(delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self.call_delta(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return out

    def _added(self, item: dict[str, Any]) -> bytes:
        self.output.append(item)
        return self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))

    def text_delta(self, text: str) -> list[bytes]:
        out = []
        if self.text is None:
            self.text = render.message_item("", status="in_progress")
            out.append(self._added(self.text))
            out.append(self.event("response.content_part.added", item_id=self.text["id"],
                                  output_index=self.output.index(self.text), content_index=0,
                                  part={"type": "output_text", "text": "", "annotations": []}))
        self.text["content"][0]["text"] += text
        out.append(self.event("response.output_text.delta", item_id=self.text["id"],
                              output_index=self.output.index(self.text), content_index=0, delta=text, logprobs=[]))
        return out

    def call_delta(self, call: dict[str, Any]) -> list[bytes]:
        out = []
        function = call.get("function") or {}
        item = self.calls.get(call.get("index"))
        if item is None:
            item = render.call_item(call.get("id") or render.item_id("call"), function.get("name") or "", "",
                                    status="in_progress")
            self.calls[call.get("index")] = item
            out.append(self._added(item))
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=self.output.index(item), delta=function["arguments"]))
        return out

    def close_items(self) -> list[bytes]:
        """Each item's .done events, in output order."""
        out = []
        for index, item in enumerate(self.output):
            item["status"] = "completed"
            if item["type"] == "message":
                part = item["content"][0]
                out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=[]))
                out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
            else:
                out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
            out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out
