"""One client request on its way through the router, as nano-vllm's `Sequence` is through its engine: the
`PdRequest` made once the body is checked (router/service.py, from the `Checked` of router/checks/checked.py), read by
pairing (router/pd/pairing.py) and its attempts (router/pd/attempt.py). Each attempt sets the fields of the attempt:
its number, its rids (the PD fields, below), its start. The policies never see it: they read a RoutingView of it
(router/routing/policy.py), and what they choose is given to the attempt as its `Choice`.

Lean on purpose, for it is made for every request: it holds only what every request has (a fan-out's choices get
their options apart: router/pd/fan_out_options.py), and the body is parsed once and kept as the one dict that is sent
(each attempt replaces its PD fields whole, so no copy is needed between attempts).
"""

from __future__ import annotations

import random
import time
from typing import Any

from router.checks.checked import Checked
from router.fleet.workers import Worker


def wants_logprobs(body: dict[str, Any]) -> bool:
    """Whether a native request asked for logprobs (`return_logprob`, one flag or one per batch item): then the
    prefill's input logprobs are merged into the decode's answer (router/pd/logprobs.py), which no other request
    needs."""
    flag = body.get("return_logprob")
    return any(flag) if isinstance(flag, list) else bool(flag)


class PdRequest:
    __slots__ = ("attempt", "attempt_started", "body", "checked", "deadline", "headers", "merge_logprobs",
                 "request_id", "rids", "route", "started", "tried")

    def __init__(self, route: str, request_id: str, body: dict[str, Any], checked: Checked, started: float,
                 total_timeout: float):
        self.route, self.request_id, self.body, self.checked = route, request_id, body, checked
        self.started = started  # time.monotonic() when the request came in
        self.deadline = started + total_timeout  # by which the whole answer must be over, streamed or not
        # The prefill's input logprobs merged into the answer: by router/pd/logprobs.py, or router/pd/echo.py for a
        # completion's echoed prompt.
        self.merge_logprobs = (route == "/generate" and wants_logprobs(body)) or checked.prompt_logprobs is not None
        self.headers = {"x-request-id": request_id, "content-type": "application/json"}  # sent to both halves
        self.attempt = -1  # the current attempt, from 0
        self.tried: set[str] = set()  # workers that failed this request: the next attempt avoids them
        self.rids: list[str] = []  # the current attempt's, the ids its halves are aborted by
        self.attempt_started = started

    @property
    def stream(self) -> bool:
        return self.checked.stream

    def start_attempt(self, prefill: Worker) -> None:
        """A new attempt on a pair whose prefill is `prefill`: its PD fields and fresh rids go into the body, and the
        reasoning_effort if the pair parses reasoning."""
        self.attempt += 1
        self.rids = add_pd_fields(self.body, prefill, self.checked.batch_size)
        if (effort := self.reasoning_effort_for(prefill)) is not None:
            self.body["reasoning_effort"] = effort
        else:
            self.body.pop("reasoning_effort", None)
        self.attempt_started = time.monotonic()

    def reasoning_effort_for(self, worker: Worker) -> str | None:
        """The reasoning_effort sent to a pair with `worker` (its two workers run the same reasoning parser:
        check_for_pair): the client's where it runs one, else none (SGLang would make it the thinking switches, which
        nothing there parses: no effect)."""
        return self.checked.reasoning_effort if worker.capabilities.reasoning_parser is not None else None


# --- the PD fields --------------------------------------------------------------------------------------------------
#
# The fields a PD pair needs in every request: where the prefill's KV bootstrap server is, a room number that both
# halves key their transfer state by, and the request ids (rids) the router aborts either half by.
#
# Every rid SGLang sees is made here, fresh for every attempt and every batch item, and all of the same length:
# SGLang aborts every request whose rid *starts with* the given one, so a rid chosen by a client, or one that is a
# prefix of another, could abort other clients' requests. A client's own id is only logged and echoed back.

_ROOM_BITS = 63  # SGLang keys transfers by a non-negative 63-bit room
# Rooms and rids must be unique, not secret (SGLang's own router draws rooms from `random` too); seeded from
# os.urandom per process, without a system call per request as `secrets` and uuid4 make.
_rng = random.Random()


def new_room() -> int:
    return _rng.getrandbits(_ROOM_BITS)


def new_rid() -> str:
    """32 hex digits: fixed length, so no rid is a prefix of another; 128 random bits, so none repeats."""
    return f"{_rng.getrandbits(128):032x}"


def add_pd_fields(body: dict[str, Any], prefill: Worker, batch_size: int | None) -> list[str]:
    """Set SGLang's bootstrap_host/port/room (lists for a batch: one room per item) and fresh rids (replacing any the
    client sent, and those of an earlier attempt); return the rids to abort by."""
    if batch_size is None:
        body["bootstrap_host"] = prefill.kv_bootstrap_host
        body["bootstrap_port"] = prefill.kv_bootstrap_port
        body["bootstrap_room"] = new_room()
        body["rid"] = rid = new_rid()
        return [rid]
    body["bootstrap_host"] = [prefill.kv_bootstrap_host] * batch_size
    body["bootstrap_port"] = [prefill.kv_bootstrap_port] * batch_size
    body["bootstrap_room"] = [new_room() for _ in range(batch_size)]
    body["rid"] = rids = [new_rid() for _ in range(batch_size)]
    return list(rids)
