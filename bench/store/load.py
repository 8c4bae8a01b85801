"""The store benchmark's load: Responses turns sent by httpx in a closed loop (each of `concurrency` clients keeps one
turn in flight), timed by the client from sending the request to the last byte of its answer.

Two workloads. `plain`: one-message turns, nothing read from the store. `chain`: each client continues its own
conversation for CHAIN_TURNS turns, then starts a new one. With the store, a turn names the previous one
(`previous_response_id`): the router reads the chain back and writes the new turn. With `store: false` the client
sends the whole history itself (its earlier inputs and the outputs it got), as a client without a store would: the
worker then gets the same prompt either way, and only the store's part differs.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.harness.fake_worker import MODEL

CHAIN_TURNS = 8  # a chain is this many turns long (so a turn reads back 0-7 earlier ones, 3.5 on average)
OUTPUT_TOKENS = 16
WORKLOADS = ("plain", "chain")


@dataclass
class Conversation:
    """One client's chain so far: the last response's id (store) or the items sent and answered (no store)."""
    store: bool
    turns: int = 0
    previous_id: str | None = None
    history: list[dict[str, Any]] = field(default_factory=list)

    def body(self, text: str) -> dict[str, Any]:
        message = {"role": "user", "content": text}
        body: dict[str, Any] = {"model": MODEL, "max_output_tokens": OUTPUT_TOKENS, "store": self.store}
        if self.store:
            body["input"] = [message]
            if self.previous_id is not None:
                body["previous_response_id"] = self.previous_id
        else:
            body["input"] = [*self.history, message]
        return body

    def answered(self, body: dict[str, Any], response: dict[str, Any]) -> None:
        """The turn's answer taken in; a chain CHAIN_TURNS long starts over."""
        self.turns += 1
        if self.turns >= CHAIN_TURNS:
            self.turns, self.previous_id, self.history = 0, None, []
        elif self.store:
            self.previous_id = response["id"]
        else:
            self.history = [*body["input"], *response["output"]]


@dataclass
class Cell:
    latencies_ms: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


async def _client(http: httpx.AsyncClient, store: bool, workload: str, until: float, cell: Cell) -> None:
    conversation = Conversation(store)
    turn = 0
    while time.perf_counter() < until:
        turn += 1
        body = conversation.body(f"Turn {turn}: tell me one more thing about Paris.")
        started = time.perf_counter()
        try:
            answer = await http.post("/v1/responses", json=body)
            payload = answer.json()
        except (httpx.HTTPError, ValueError) as exc:
            cell.error(type(exc).__name__)
            continue
        elapsed = time.perf_counter() - started
        if answer.status_code != 200 or not payload.get("output"):
            cell.error(f"status {answer.status_code}")
            continue
        cell.latencies_ms.append(elapsed * 1000)
        if workload == "chain":
            conversation.answered(body, payload)


async def run_cell(url: str, store: bool, workload: str, concurrency: int, seconds: float) -> Cell:
    """`concurrency` clients each sending turns one after the other for `seconds`; every turn started is awaited."""
    cell = Cell()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30.0) as http:
        until = time.perf_counter() + seconds
        await asyncio.gather(*(_client(http, store, workload, until, cell) for _ in range(concurrency)))
    return cell
