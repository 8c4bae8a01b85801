"""A fake SGLang worker for hermetic router tests: answers /generate (plain or SSE) in SGLang's native shape and the
OpenAI routes in OpenAI's (one choice, its usage), records what it was sent.

This is a test double, not SGLang: it checks the router's plumbing (fields injected, streams relayed, aborts sent),
never the generated tokens. The end-to-end tests use real SGLang processes for that.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdcluster.common.http_server import JsonErrorHttpTools
from tests.helpers import free_port, until


@dataclass
class Behaviour:
    status: int = 200
    chunks: int = 3
    chunk_delay: float = 0.0
    delay: float = 0.0  # before answering at all
    drop_after_chunks: int | None = None  # close the connection mid-stream, like a crashed server
    hang: bool = False  # never answer (until aborted)
    fail_first: int = 0  # answer the first N requests with 503, then behave
    first_chunk_delay: float = 0.0  # a stream's head goes out at once (as SGLang's does), its first event this late
    stall_after_chunks: int | None = None  # send nothing more mid-stream (a stuck scheduler) until aborted
    error_message: str | None = None  # what a failing answer says (SGLang's OpenAI shape), instead of the default
    error_event: str | None = None  # a stream's last event: SGLang's error event with this message
    done_lingers: float = 0.0  # a stream stays open this long after its [DONE] (the worker's close comes later)
    answer_fields: dict = field(default_factory=dict)  # more fields of a whole answer (SGLang's `metadata`, ...)
    # OpenAI routes: the completion's tokens (one per streamed chunk; default "x" per chunk), a whole answer's text if
    # not their concatenation (a trimmed stop string, a space a token's own string lacks), the usage's prompt and
    # cached tokens.
    tokens: list[str] | None = None
    text: str | None = None
    reasoning: list[str] | None = None  # chat: what a reasoning parser split off, streamed before the tokens
    # chat: the (name, arguments) of each call a tool-call parser read out of the answer, as SGLang answers them (then
    # no tokens, finish_reason tool_calls); streamed as SGLang streams them, each call's arguments in two pieces.
    tool_calls: list[tuple[str, str]] | None = None
    prompt_tokens: int = 5
    cached_tokens: int | None = None
    per_request: dict[int, Behaviour] = field(default_factory=dict)  # the Nth request (from 1) behaves so instead


@dataclass
class FakeWorker:
    behaviour: Behaviour = field(default_factory=Behaviour)
    received: list[dict] = field(default_factory=list)
    received_at: list[float] = field(default_factory=list)  # time.monotonic() of each
    received_headers: list[dict[str, str]] = field(default_factory=list)  # each request's headers, lower-cased
    aborted: list[str] = field(default_factory=list)
    healthy: bool = True
    canary_ids: list[int] = field(default_factory=lambda: [1, 2, 3])  # what it answers a router's admission canary
    canaries: int = 0
    canary_failures: int = 0  # answer this many canaries with 503 first
    canary_stalls: int = 0  # then leave this many unanswered for a minute (a worker stopped mid-canary)
    tokenized: list[dict] = field(default_factory=list)  # what /tokenize was asked (its ids: fake_ids)
    tokenize_status: int = 200

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.healthy else 503)

        @app.post("/abort_request")
        async def abort(request: Request) -> Response:
            self.aborted.append((await request.json())["rid"])
            return Response(status_code=200)

        @app.post("/tokenize")
        async def tokenize(request: Request) -> Response:
            body = await request.json()
            self.tokenized.append(body)
            if self.tokenize_status != 200:
                return JSONResponse({"message": "fake tokenizer failure"}, status_code=self.tokenize_status)
            tokens: list[int] | list[list[int]]
            if "messages" in body:
                tokens = [t for m in body["messages"] for t in [0, 1, 2, 3, *fake_ids(str(m.get("content") or ""))]]
            elif isinstance(body["prompt"], list):
                tokens = [fake_ids(p) for p in body["prompt"]]
            else:
                tokens = fake_ids(body["prompt"])
            count = [len(t) for t in tokens] if isinstance(body.get("prompt"), list) else len(tokens)
            return JSONResponse({"tokens": tokens, "count": count, "max_model_len": 2048})

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

        async def generate(request: Request) -> Response:
            body = await request.json()
            if request.headers.get("x-request-id", "").startswith("canary-"):  # a router's admission check
                self.canaries += 1
                if self.canaries <= self.canary_failures:
                    return JSONResponse({"error": {"message": "fake failure 503"}}, status_code=503)
                if self.canaries <= self.canary_failures + self.canary_stalls:
                    await asyncio.sleep(60)
                return JSONResponse({"text": "canary", "output_ids": self.canary_ids, "meta_info": {"id": body["rid"]}})
            self.received.append(body)
            self.received_at.append(time.monotonic())
            self.received_headers.append(dict(request.headers))
            b = self.behaviour.per_request.get(len(self.received), self.behaviour)
            if b.delay:
                await asyncio.sleep(b.delay)
            if b.hang:
                rid = body.get("rid")
                while rid not in self.aborted:
                    await asyncio.sleep(0.01)
                return JSONResponse({"error": {"message": "aborted"}}, status_code=500)
            if b.status != 200 or len(self.received) <= b.fail_first:
                status = b.status if b.status != 200 else 503
                if b.error_message is not None:
                    return JSONResponse({"object": "error", "message": b.error_message, "type": "BadRequestError",
                                         "param": None, "code": status}, status_code=status)
                return JSONResponse({"error": {"message": f"fake failure {status}"}}, status_code=status)
            path = request.url.path
            if not body.get("stream"):
                if path != "/generate":
                    return JSONResponse({**openai_answer(b, body, path), **b.answer_fields})
                return JSONResponse({"text": "x" * b.chunks, "output_ids": list(range(b.chunks)),
                                     "meta_info": {"id": body.get("rid")}, **b.answer_fields})
            return StreamingResponse(self._stream(b, body, path), media_type="text/event-stream")

        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.post(path)(generate)
        return app

    async def _stream(self, b: Behaviour, body: dict, path: str):
        rid = body.get("rid")
        if b.first_chunk_delay:
            await asyncio.sleep(b.first_chunk_delay)
        tokens = b.tokens or ["x"] * b.chunks
        if b.tool_calls and path == "/v1/chat/completions":
            for event in tool_call_chunks(b, body):
                yield f"data: {json.dumps(event)}\n\n".encode()
            yield b"data: [DONE]\n\n"
            return
        for piece in b.reasoning if path == "/v1/chat/completions" and b.reasoning else []:
            event = {**_head(body, path, chunk=True), "choices": [{"index": 0, "delta": {
                "role": "assistant", "content": None, "reasoning_content": piece}, "finish_reason": None}]}
            yield f"data: {json.dumps(event)}\n\n".encode()
        for i in range(len(tokens)):
            if b.drop_after_chunks is not None and i == b.drop_after_chunks:
                raise RuntimeError("fake worker crashed mid-stream")  # uvicorn drops the connection
            if b.stall_after_chunks is not None and i == b.stall_after_chunks:
                while rid not in self.aborted:
                    await asyncio.sleep(0.01)
                return
            if path == "/generate":
                event = {"text": "x" * (i + 1), "output_ids": list(range(i + 1))}
            else:
                event = openai_chunk(b, body, path, tokens, i)
            yield f"data: {json.dumps(event)}\n\n".encode()
            if b.chunk_delay:
                await asyncio.sleep(b.chunk_delay)
        if b.error_event is not None:
            error = {"object": "error", "message": b.error_event, "type": "BadRequestError", "param": None, "code": 400}
            yield f"data: {json.dumps({'error': error})}\n\n".encode()
        elif path != "/generate" and (body.get("stream_options") or {}).get("include_usage"):
            usage = {**_head(body, path, chunk=True), "choices": [], "usage": _usage(b, len(tokens))}
            yield f"data: {json.dumps(usage)}\n\n".encode()
        yield b"data: [DONE]\n\n"
        if b.done_lingers:
            await asyncio.sleep(b.done_lingers)


def fake_ids(text: str) -> list[int]:
    """The fake's tokenizer: a token per two characters, each pair its own id (a prefix of a text, a prefix of ids)."""
    return [ord(text[i]) * 1024 + ord(text[i + 1]) for i in range(0, len(text) - 1, 2)]


def _head(body: dict, path: str, chunk: bool = False) -> dict:
    chat = path == "/v1/chat/completions"
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": body.get("rid"), "object": kind, "created": int(time.time()), "model": body.get("model", "fake")}


def _usage(b: Behaviour, completion: int) -> dict:
    details = {"cached_tokens": b.cached_tokens} if b.cached_tokens is not None else None
    return {"prompt_tokens": b.prompt_tokens, "total_tokens": b.prompt_tokens + completion,
            "completion_tokens": completion, "prompt_tokens_details": details, "reasoning_tokens": 0}


def _logprobs(body: dict, path: str, tokens: list[str]) -> dict | None:
    """As SGLang 0.5.23 writes them: a completion's with every text_offset -1."""
    if path == "/v1/chat/completions":
        return {"content": [{"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []}
                            for t in tokens]} if body.get("logprobs") else None
    if body.get("logprobs") is None:
        return None
    return {"text_offset": [-1] * len(tokens), "token_logprobs": [-0.5] * len(tokens), "tokens": tokens,
            "top_logprobs": [{t: -0.5} for t in tokens]}


def openai_answer(b: Behaviour, body: dict, path: str) -> dict:
    """One choice per prompt (a completions prompt may be a list of k), as SGLang answers n = 1."""
    tokens = b.tokens or ["x"] * b.chunks
    text = b.text if b.text is not None else "".join(tokens)
    prompt = body.get("prompt")
    k = len(prompt) if isinstance(prompt, list) and isinstance(prompt[0], str | list) else 1
    choices: list[dict] = []
    for index in range(k):
        choice: dict = {"index": index, "logprobs": _logprobs(body, path, tokens), "finish_reason": "length"}
        if path == "/v1/chat/completions":
            choice["message"] = {"role": "assistant", "content": text}
            if b.reasoning:
                choice["message"]["reasoning_content"] = "".join(b.reasoning)
            if b.tool_calls:
                choice["message"] = {"role": "assistant", "content": None, "reasoning_content": None, "tool_calls": [
                    {"id": f"call_{i}", "index": i, "type": "function", "function": {"name": name, "arguments": args}}
                    for i, (name, args) in enumerate(b.tool_calls)]}
                choice["finish_reason"] = "tool_calls"
        else:
            choice["text"] = text
        choices.append(choice)
    usage = _usage(b, len(tokens) * k)
    usage["prompt_tokens"] *= k
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return {**_head(body, path), "choices": choices, "usage": usage}


def openai_chunk(b: Behaviour, body: dict, path: str, tokens: list[str], i: int) -> dict:
    """The event of token `i`, whose text is the token's."""
    text = tokens[i]
    choice: dict = {"index": 0, "logprobs": _logprobs(body, path, tokens[i:i + 1]),
                    "finish_reason": "length" if i == len(tokens) - 1 else None}
    if path == "/v1/chat/completions":
        choice["delta"] = {"role": "assistant", "content": text} if i == 0 else {"content": text}
    else:
        choice["text"] = text
    return {**_head(body, path, chunk=True), "choices": [choice]}


def tool_call_chunks(b: Behaviour, body: dict) -> list[dict]:
    """A stream of tool calls as SGLang 0.5.23 writes it: every delta has all four fields (null where unset); a call's
    first delta its id and name, the next ones its arguments; a last event with finish_reason tool_calls, then usage."""
    def event(finish_reason: str | None = None, **delta) -> dict:
        return {**_head(body, "/v1/chat/completions", chunk=True), "choices": [{"index": 0, "logprobs": None, "delta": {
            "role": None, "content": None, "reasoning_content": None, "tool_calls": None, **delta},
            "finish_reason": finish_reason}]}

    events = [event(role="assistant", content="")]
    for i, (name, args) in enumerate(b.tool_calls or []):
        half = len(args) // 2
        events.append(event(tool_calls=[{"id": f"call_{i}", "index": i, "type": "function",
                                         "function": {"name": name, "arguments": ""}}]))
        events += [event(tool_calls=[{"id": None, "index": i, "type": "function",
                                      "function": {"name": None, "arguments": piece}}]) for piece in (
            args[:half], args[half:])]
    events.append(event("tool_calls"))
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append({**_head(body, "/v1/chat/completions", chunk=True), "choices": [],
                       "usage": _usage(b, 2 * len(b.tool_calls or []))})
    return events


class ServerThread:
    """Run an ASGI app with uvicorn on a loopback port in a background thread, with the HTTP protocol our servers run
    (router/processes.py): a request its parser refuses is a JSON 400 there too, as the contract tests expect."""

    def __init__(self, app, port: int | None = None):
        self.port = port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                    lifespan="on", http=JsonErrorHttpTools))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        if not until(lambda: self.server.started, 10, 0.01):
            raise TimeoutError("server did not start")
        return self

    def __exit__(self, *_exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
