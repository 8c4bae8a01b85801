"""tests.chaos: the load. Client threads send one request at a time through the router and judge every answer
against plain `transformers` greedy decoding: ok, a clear error, refused, or a defect."""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass

import httpx

from tests.chaos.cluster import DEADLINE, MAX_NEW, SIZES
from tests.e2e.prompts import prompt_of_about
from tests.e2e.reference import TIE_MARGIN, ReferenceModel


@dataclass
class Prompt:
    key: str
    size: str
    text: str
    ids: list[int]  # the reference's greedy tokens (without EOS), MAX_NEW of them at most
    eos_within: bool  # the reference stopped at EOS before MAX_NEW


@dataclass
class Record:
    client: int
    started: float  # seconds since the load started
    ended: float
    route: str
    stream: bool
    size: str
    max_new: int
    outcome: str  # ok | error | refused | defect
    status: int | None = None
    detail: str = ""
    prefill: str = ""
    decode: str = ""


def greedy(reference: ReferenceModel, text: str, max_new: int) -> tuple[list[int], float]:
    """tests/e2e/reference.py's greedy decoding with a KV cache (the same argmax wherever the top-2 margin is not
    a near-tie, which build_prompts refuses anyway): the generated ids, and the smallest top-2 margin."""
    import torch

    ids, margins = [], []
    with torch.inference_mode():
        out = reference.model(torch.tensor([reference.tokenizer(text)["input_ids"]]), use_cache=True)
        for _ in range(max_new):
            top2 = torch.topk(out.logits[0, -1].float(), 2)
            margins.append(float(top2.values[0] - top2.values[1]))
            ids.append(int(top2.indices[0]))
            if ids[-1] == reference.eos:
                break
            out = reference.model(torch.tensor([[ids[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return ids, min(margins)


def build_prompts(reference: ReferenceModel, per_size: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    prompts: list[Prompt] = []
    for size, n in SIZES.items():
        made, attempt = 0, 0
        while made < per_size and attempt < per_size * 6:
            attempt += 1
            lead = f"Question {rng.randrange(10_000)} about {rng.choice(['rivers', 'servers', 'bread', 'foxes'])}: "
            rest = n - len(reference.tokenizer(lead)["input_ids"])
            text = lead if n <= 8 else lead + prompt_of_about(reference.tokenizer, rest)
            generated, margin = greedy(reference, text, MAX_NEW)
            if margin < TIE_MARGIN:
                continue  # two correct engines may break a tie differently: keep the verdict exact
            ids = [t for t in generated if t != reference.eos]
            prompts.append(Prompt(f"{size}-{made}", size, text, ids, len(ids) < MAX_NEW))
            made += 1
    return prompts


class Load:
    def __init__(self, router_url: str, prompts: list[Prompt], tokenizer, clients: int, seed: int):
        self.router_url, self.prompts, self.tokenizer, self.clients = router_url, prompts, tokenizer, clients
        self.records: list[Record] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self.seed = seed
        self.in_flight = 0
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,), name=f"client-{i}", daemon=True)
                        for i in range(clients)]

    def start(self) -> None:
        self.t0 = time.monotonic()
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=DEADLINE + 10)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _client(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        timeout = httpx.Timeout(DEADLINE, connect=5.0)
        with httpx.Client(base_url=self.router_url, timeout=timeout,
                          limits=httpx.Limits(max_keepalive_connections=0)) as client:
            while not self.stop.is_set():
                prompt = rng.choice(self.prompts)
                route = rng.choice(["/generate", "/generate", "/v1/completions"])
                stream = rng.random() < 0.5
                max_new = rng.choice([8, 16, 32])
                with self._lock:
                    self.in_flight += 1
                record = self.one(client, index, prompt, route, stream, max_new)
                with self._lock:
                    self.in_flight -= 1
                    self.records.append(record)
                if record.outcome in ("refused", "error"):
                    time.sleep(0.2)  # a client backs off a little after an error; no spinning on a dead router

    def one(self, client: httpx.Client, index: int, prompt: Prompt, route: str, stream: bool,
            max_new: int) -> Record:
        if route == "/generate":
            body = {"text": prompt.text, "stream": stream,
                    "sampling_params": {"max_new_tokens": max_new, "temperature": 0}}
        else:
            body = {"model": "tiny-llama", "prompt": prompt.text, "max_tokens": max_new, "temperature": 0,
                    "stream": stream}
        record = Record(index, self.now(), 0.0, route, stream, prompt.size, max_new, "defect")
        started = time.monotonic()
        try:
            if stream:
                with client.stream("POST", route, json=body) as response:
                    self._pair(record, response)
                    if response.status_code != 200:
                        self._judge_error(record, response.status_code, response.read())
                    else:
                        self._judge_stream(record, response, prompt, route, max_new, started)
            else:
                response = client.post(route, json=body)
                self._pair(record, response)
                if response.status_code != 200:
                    self._judge_error(record, response.status_code, response.content)
                else:
                    self._judge_answer(record, response.content, prompt, route, max_new)
        except httpx.ConnectError as exc:
            record.outcome, record.detail = "refused", f"connect: {exc}"
        except httpx.TimeoutException as exc:
            record.outcome, record.detail = "defect", f"hang: no byte for {DEADLINE:.0f}s ({type(exc).__name__})"
        except httpx.HTTPError as exc:
            record.outcome, record.detail = "defect", f"connection broke mid-answer: {type(exc).__name__}: {exc}"
        record.ended = self.now()
        if record.ended - record.started > DEADLINE and record.outcome != "defect":
            record.outcome, record.detail = "defect", f"took {record.ended - record.started:.0f}s: past the deadline"
        return record

    @staticmethod
    def _pair(record: Record, response: httpx.Response) -> None:
        record.status = response.status_code
        record.prefill = response.headers.get("x-pdcluster-prefill", "")
        record.decode = response.headers.get("x-pdcluster-decode", "")

    @staticmethod
    def _judge_error(record: Record, status: int, payload: bytes) -> None:
        try:
            body = json.loads(payload)
        except ValueError:
            record.outcome, record.detail = "defect", f"{status} with a body that is not JSON: {payload[:120]!r}"
            return
        if not isinstance(body, dict):
            record.outcome, record.detail = "defect", f"{status} with a JSON that is not an object"
            return
        error = body.get("error") if isinstance(body.get("error"), dict) else body
        record.outcome, record.detail = "error", f"{status}: {str(error.get('message', body))[:200]}"

    def _expect(self, prompt: Prompt, max_new: int) -> list[int]:
        return prompt.ids[:max_new]

    def _check_ids(self, record: Record, got: list[int], prompt: Prompt, max_new: int) -> None:
        want = self._expect(prompt, max_new)
        got = [t for t in got if t != self.tokenizer.eos_token_id]
        if got == want:
            record.outcome = "ok"
        else:
            record.outcome, record.detail = "defect", f"wrong tokens: got {got[:12]}..., want {want[:12]}..."

    def _check_text(self, record: Record, text: str, prompt: Prompt, max_new: int) -> None:
        want = self.tokenizer.decode(self._expect(prompt, max_new), skip_special_tokens=True)  # as SGLang does
        if text == want:
            record.outcome = "ok"
        else:
            record.outcome, record.detail = "defect", f"wrong text: got {text[:40]!r}, want {want[:40]!r}"

    def _judge_answer(self, record: Record, payload: bytes, prompt: Prompt, route: str, max_new: int) -> None:
        try:
            body = json.loads(payload)
        except ValueError:
            record.detail = f"200 with a body that is not JSON: {payload[:120]!r}"
            return
        if route == "/generate":
            reason = ((body.get("meta_info") or {}).get("finish_reason") or {}).get("type")
            if reason not in ("length", "stop"):
                record.detail = f"200 with finish_reason {reason!r}: an error dressed as an answer"
                return
            self._check_ids(record, body.get("output_ids") or [], prompt, max_new)
        else:
            choice = (body.get("choices") or [{}])[0]
            if choice.get("finish_reason") not in ("length", "stop"):
                record.detail = f"200 with finish_reason {choice.get('finish_reason')!r}"
                return
            self._check_text(record, choice.get("text", ""), prompt, max_new)

    def _judge_stream(self, record: Record, response: httpx.Response, prompt: Prompt, route: str, max_new: int,
                      started: float) -> None:
        events: list[str] = []
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(line[5:].strip())
            if time.monotonic() - started > DEADLINE:
                record.detail = f"stream still going after {DEADLINE:.0f}s"
                return
        parsed = []
        for event in events:
            if event == "[DONE]":
                parsed.append("[DONE]")
                continue
            try:
                parsed.append(json.loads(event))
            except ValueError:
                record.detail = f"malformed SSE event: {event[:120]!r}"
                return
        errors = [e for e in parsed if isinstance(e, dict) and "error" in e]
        if errors:
            error = errors[-1]["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            record.outcome, record.detail = "error", f"SSE error event: {str(message)[:200]}"
            return
        if not parsed or parsed[-1] != "[DONE]":
            record.detail = f"stream ended with neither an error event nor [DONE] after {len(parsed)} events"
            return
        chunks = [e for e in parsed if isinstance(e, dict)]
        if not chunks:
            record.detail = "stream with [DONE] but no answer"
            return
        if route == "/generate":
            last = chunks[-1]
            reason = ((last.get("meta_info") or {}).get("finish_reason") or {}).get("type")
            if reason not in ("length", "stop"):
                record.detail = f"stream ended with finish_reason {reason!r}"
                return
            self._check_ids(record, last.get("output_ids") or [], prompt, max_new)
        else:
            text = "".join(((c.get("choices") or [{}])[0].get("text") or "") for c in chunks)
            reason = next((c["choices"][0].get("finish_reason") for c in reversed(chunks)
                           if c.get("choices") and c["choices"][0].get("finish_reason")), None)
            if reason not in ("length", "stop"):
                record.detail = f"stream ended with finish_reason {reason!r}"
                return
            self._check_text(record, text, prompt, max_new)


