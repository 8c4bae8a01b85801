"""One client request on its way through the router, as nano-vllm's `Sequence` is through its engine: made once the
body is checked (router/service.py), then read by pairing (router/pairing.py), dispatch and the relay
(router/dispatch.py). Each attempt sets the fields of the attempt: its number, its rids, its start.

Lean on purpose, for it is made for every request: the body is parsed once and kept as the one dict that is sent
(each attempt replaces its PD fields whole, so no copy is needed between attempts), and the prompt is made into
text for a policy only when one asks for it (`hint`).
"""

from __future__ import annotations

import time
from typing import Any

from router.logprobs import wants_logprobs
from router.pd_fields import add_pd_fields
from router.validation import Checked
from router.workers import Worker


class PdRequest:
    __slots__ = ("_hint", "attempt", "attempt_started", "body", "checked", "deadline", "headers", "merge_logprobs",
                 "request_id", "rids", "route", "started", "tried")

    def __init__(self, route: str, request_id: str, body: dict[str, Any], checked: Checked, started: float,
                 total_timeout: float):
        self.route, self.request_id, self.body, self.checked = route, request_id, body, checked
        self.started = started  # time.monotonic() when the request came in
        self.deadline = started + total_timeout  # by which the whole answer must be over, streamed or not
        self.merge_logprobs = route == "/generate" and wants_logprobs(body)  # router/logprobs.py
        self.headers = {"x-request-id": request_id, "content-type": "application/json"}  # sent to both halves
        self.attempt = -1  # the current attempt, from 0
        self.tried: set[str] = set()  # workers that failed this request: the next attempt avoids them
        self.rids: list[str] = []  # the current attempt's, the ids its halves are aborted by
        self.attempt_started = started
        self._hint: str | None = None

    @property
    def stream(self) -> bool:
        return self.checked.stream

    @property
    def hint(self) -> str:
        """At most HINT_CHARS of the prompt as text, for policies that need the prompt (made once, when asked)."""
        if self._hint is None:
            self._hint = self.checked.hint
        return self._hint

    def start_attempt(self, prefill: Worker) -> None:
        """A new attempt on a pair whose prefill is `prefill`: its PD fields and fresh rids go into the body."""
        self.attempt += 1
        self.rids = add_pd_fields(self.body, prefill, self.checked.batch_size)
        self.attempt_started = time.monotonic()
