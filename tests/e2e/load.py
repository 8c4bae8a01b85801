"""A steady load that judges every answer: two clients asking without pause through the router (one streams
/generate, one asks /v1/completions), each answer checked for its status, the whole number of tokens asked for and
no error event. For the planned-event tests (local and compose): what a restart may not lose."""

from __future__ import annotations

import json
import threading

import httpx


class Load:
    """Two clients asking without pause (one streams /generate, one asks /v1/completions), judging every answer."""

    def __init__(self, url: str, model: str = "tiny-llama"):
        self.url, self.model, self.stop, self.answers, self.problems = url, model, threading.Event(), 0, []
        self.threads = [threading.Thread(target=self._streams), threading.Thread(target=self._plain)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)

    def _streams(self) -> None:
        body = {"text": "Count with me", "stream": True,
                "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop.is_set():
                self._judge(lambda: client.stream("POST", "/generate", json=body), stream=True)

    def _plain(self) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop.is_set():
                self._judge(lambda: client.stream("POST", "/v1/completions", json=body), stream=False)

    def _judge(self, send, stream: bool) -> None:
        try:
            with send() as response:
                text = response.read().decode()
        except httpx.HTTPError as exc:
            self.problems.append(f"{type(exc).__name__}: {exc}")
            return
        self.answers += 1
        if response.status_code != 200:
            self.problems.append(f"{response.status_code}: {text[:200]}")
        elif stream:
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            if events[-1] != "[DONE]" or any('"error"' in e for e in events) or \
                    json.loads(events[-2])["meta_info"]["completion_tokens"] != 24:
                self.problems.append(f"stream: {events[-2:]}")
        elif json.loads(text)["usage"]["completion_tokens"] != 8:
            self.problems.append(f"plain: {text[:200]}")
