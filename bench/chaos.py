"""`make chaos`: a local cluster of 2 prefills + 2 decodes under a steady mixed load, while faults are injected one
at a time; every request must end as a right answer or a clear error, every fault must heal on its own within its
limit, and at the end every worker must be back, registered, healthy, with its KV cache drained to its idle level.

    python -m bench.chaos [--clients 6] [--steady 60] [--faults all] [--out bench/results/chaos]

Load: `--clients` threads, each sending one request at a time through the router (a new connection each: no
keep-alive races to muddy the verdict): /generate and /v1/completions, streamed or not, prompts of ~5 to ~1800
tokens, 8/16/32 new tokens, temperature 0. Every answer is checked against plain `transformers`
(tests/e2e/reference.py; prompts whose reference has a near-tie in the first 32 tokens are not used).

Each request ends as exactly one of:
- ok: 200 and the reference's tokens (streams: ending in `data: [DONE]`);
- error: a clear error: a JSON 4xx/5xx, or an SSE error event; `refused` (connection refused while the router
  restarts: the client knows nothing was sent) is counted apart;
- defect: anything else: a hang past the deadline, a stream that ends with neither an error nor [DONE], malformed
  JSON, wrong tokens, a 200 whose finish_reason is "abort", a connection cut mid-answer.

Faults (in this order; `--faults` picks some): SIGSTOP of a decode's whole process tree and of a prefill's (15 s,
then SIGCONT), SIGSTOP of a decode's scheduler alone (its HTTP side answers: a stuck scheduler), kill -9 of a
decode's SGLang and of a prefill's (the local cluster's supervisor restarts them),
a restart of the bootstrap service and of the router (SIGTERM, not through the cluster: the supervisor restarts
them), and with `--network` a network fault between the prefills and a decode (iptables drops the decode's
Mooncake port for 15 s). Each has a time limit for detection (a hang: 10 s) and for recovery.

Writes <out>.json (summary, every fault with its timings, defects and a sample of errors, probe latencies, KV
usage) and <out>.png (requests/s, errors and defects over time, the faults marked). Exit status 1 if any
requirement failed. The probe measurements behind the router's liveness thresholds come from the same run
(docs/faults.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

from pdcluster.local import REPO, ComponentSpec, LocalCluster, LocalSpec, WorkerGroupSpec
from tests.e2e.prompts import prompt_of_about
from tests.e2e.reference import TIE_MARGIN, ReferenceModel

MAX_NEW = 32
DEADLINE = 60.0  # no request may take longer, whatever happens to the cluster
SIZES = {"tiny": 5, "short": 40, "medium": 200, "long": 700, "longest": 1800}
HANG_SECONDS = 15.0
DETECT_LIMIT = 10.0  # a hung or dead worker is out of rotation within this many seconds
LIMITS = {  # seconds from the injection (from SIGCONT for a hang) until every worker serves again
    "hang": 20.0,  # from SIGCONT
    "stall": 20.0,
    "kill": 300.0,  # SGLang takes ~30 s to start on an idle 2-core machine, minutes on a busy one
    "bootstrap": 15.0,
    "router": 60.0,
    "network": 30.0,
}
ALL_FAULTS = ["hang decode-0", "hang prefill-0", "stall decode-1", "kill decode-1", "kill prefill-1",
              "restart bootstrap", "restart router"]


# ----- the cluster -----

def chaos_spec(base: int, kv_base: int) -> LocalSpec:
    return LocalSpec(
        bootstrap=ComponentSpec(config="configs/bootstrap.yaml", port=base + 998),
        router=ComponentSpec(config="tests/e2e/router.yaml", port=base),  # names the pair on every answer
        prefill=WorkerGroupSpec(config="configs/prefill.yaml", count=2, first_port=base + 100,
                                first_kv_bootstrap_port=kv_base),
        decode=WorkerGroupSpec(config="configs/decode.yaml", count=2, first_port=base + 200),
        ready_timeout=900,
    )


def worker_url(spec: LocalSpec, name: str) -> str:
    group, index = name.split("-")
    first = spec.prefill.first_port if group == "prefill" else spec.decode.first_port
    return f"http://127.0.0.1:{first + int(index)}"


def used_tokens(url: str) -> int:
    loads = httpx.get(f"{url}/v1/loads", params={"include": "core"}, timeout=10).json()["loads"]
    return sum(load["num_used_tokens"] for load in loads)


def sglang_main(cluster: LocalCluster, name: str) -> psutil.Process | None:
    """The SGLang server process a worker's launcher runs (its direct child)."""
    try:
        children = psutil.Process(cluster.processes[name].popen.pid).children()
    except psutil.NoSuchProcess:
        return None
    return next((c for c in children if "sglang" in " ".join(c.cmdline())), None)


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


# ----- requests and their verdicts -----

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


# ----- watching the cluster -----

class Probes:
    """Every worker's liveness endpoint (/v1/loads) asked 4 times a second, as the router does once a second: how
    long it takes to answer, and how long the scheduler's snapshot stays unchanged while it has work. In the
    steady phase also SGLang's /health (a real generation), for comparison."""

    def __init__(self, spec: LocalSpec, load: Load):
        self.spec, self.load = spec, load
        self.names = [*(f"prefill-{i}" for i in range(spec.prefill.count)),
                      *(f"decode-{i}" for i in range(spec.decode.count))]
        self.samples: dict[str, list[tuple[float, float | None, bool | None, float | None, float]]] = {
            n: [] for n in self.names}
        self.health: dict[str, list[tuple[float, float | None]]] = {n: [] for n in self.names}  # (t, seconds)
        self.waiting_since: dict[str, float | None] = {n: None for n in self.names}  # as router/health.py keeps it
        self.stop = threading.Event()
        self.heavy = threading.Event()
        self.excluded: dict[str, list[tuple[float, float]]] = {n: [] for n in self.names}  # fault windows
        self.threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in self.names]
        self.threads += [threading.Thread(target=self._heavy, args=(n,), daemon=True) for n in self.names]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def _run(self, name: str) -> None:
        url = worker_url(self.spec, name)
        last_stamps, last_change = None, None
        with httpx.Client(timeout=10) as client:
            while not self.stop.is_set():
                t = self.load.now()
                began = time.monotonic()
                latency = busy = gap = None
                try:
                    response = client.get(f"{url}/v1/loads", params={"include": "core,disagg"})
                    latency = time.monotonic() - began
                    loads = response.json()["loads"]
                    stamps = tuple(load["timestamp"] for load in loads)
                    busy = any(load["num_running_reqs"] or load["num_waiting_reqs"] or any(
                        v for k, v in (load.get("disaggregation") or {}).items() if k.endswith("_reqs"))
                        for load in loads)
                    if stamps != last_stamps:
                        last_stamps, last_change = stamps, t
                    gap = t - last_change
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    last_stamps = None
                # The router's stall measure: /health waiting and the snapshot still, both for this long.
                waiting = self.waiting_since[name]
                stall = t - max(waiting, last_change) if waiting is not None and last_change is not None else 0.0
                self.samples[name].append((t, latency, busy, gap, stall))
                self.stop.wait(max(0.0, 0.25 - (time.monotonic() - began)))

    def _heavy(self, name: str) -> None:
        url = worker_url(self.spec, name)
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                if not self.heavy.wait(0.5):
                    continue
                began, t = time.monotonic(), self.load.now()
                if self.waiting_since[name] is None:
                    self.waiting_since[name] = t
                try:
                    ok = client.get(f"{url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    self.waiting_since[name] = None
                self.health[name].append((t, time.monotonic() - began if ok else None))
                self.stop.wait(1.0)

    def exclude(self, name: str, start: float, end: float) -> None:
        self.excluded[name].append((start, end))

    def summary(self, since: float = 0.0, until: float = float("inf")) -> dict:
        def pct(values: list[float], q: float) -> float:
            values = sorted(values)
            return round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 1) if values else None

        out = {}
        for name in self.names:
            windows = self.excluded[name]

            def kept(t: float) -> bool:
                return since <= t <= until and not any(a - 1 <= t <= b + 5 for a, b in windows)

            keep = [s for s in self.samples[name] if kept(s[0])]
            latencies = [s[1] for s in keep if s[1] is not None]
            busy_gaps = [s[3] for s in keep if s[2] and s[3] is not None]
            stalls = [s[4] for s in keep]
            heavy = [h for t, h in self.health[name] if h is not None and kept(t)]
            out[name] = {
                "samples": len(keep),
                "unanswered": sum(1 for s in keep if s[1] is None),
                "loads_ms": {"p50": pct(latencies, 0.5), "p99": pct(latencies, 0.99),
                             "max": round(max(latencies) * 1000, 1) if latencies else None},
                "busy_fraction": round(sum(1 for s in keep if s[2]) / len(keep), 3) if keep else None,
                "max_snapshot_gap_busy_s": round(max(busy_gaps), 2) if busy_gaps else None,
                "max_stall_measure_s": round(max(stalls), 2) if stalls else None,
                "health_ms": {"n": len(heavy), "p50": pct(heavy, 0.5), "p99": pct(heavy, 0.99),
                              "max": round(max(heavy) * 1000, 1) if heavy else None},
            }
        return out


def ready(router_url: str) -> dict | None:
    try:
        return httpx.get(f"{router_url}/ready", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return None


def worker_healthy(router_url: str, url: str) -> bool | None:
    """True/False as the router sees the worker; None if the router does not list it (or does not answer)."""
    state = ready(router_url)
    if state is None:
        return None
    row = next((w for w in state["workers"] if w["url"].rstrip("/") == url), None)
    return None if row is None else row["healthy"]


def all_serving(cluster: LocalCluster) -> bool:
    state = ready(cluster.router_url)
    want = cluster.spec.prefill.count + cluster.spec.decode.count
    return state is not None and sum(w["healthy"] for w in state["workers"]) >= want


def registered(cluster: LocalCluster) -> int:
    try:
        return len(httpx.get(f"{cluster.spec.bootstrap_url}/v1/workers", timeout=2).json()["workers"])
    except (httpx.HTTPError, ValueError, KeyError):
        return -1


def wait_for(predicate, timeout: float, interval: float = 0.2) -> float | None:
    """Seconds until predicate() held, or None if it did not within timeout."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if predicate():
            return time.monotonic() - began
        time.sleep(interval)
    return None


# ----- faults -----

@dataclass
class FaultResult:
    name: str
    kind: str
    target: str
    injected_at: float  # seconds since the load started
    detected_s: float | None = None  # injection -> out of rotation
    resumed_at: float | None = None  # SIGCONT / network back (hangs and network faults)
    recovered_s: float | None = None  # injection (or resume) -> every worker serving again
    recovered_at: float | None = None
    limit_detect_s: float | None = None
    limit_recover_s: float = 0.0
    restarts: int = 0  # restarts by the local cluster's supervisor during this fault
    ok: bool = False
    notes: list[str] = field(default_factory=list)


class Chaos:
    def __init__(self, cluster: LocalCluster, load: Load, probes: Probes, log):
        self.cluster, self.load, self.probes, self.log = cluster, load, probes, log
        self.results: list[FaultResult] = []

    def run(self, fault: str) -> FaultResult:
        kind, target = fault.split(" ", 1)
        result = FaultResult(fault, kind, target, self.load.now())
        before = sum(self.cluster.restarts().values())
        self.log(f"fault: {fault}")
        getattr(self, f"_{kind}")(target, result)
        result.restarts = sum(self.cluster.restarts().values()) - before
        if result.recovered_s is not None:
            result.recovered_at = self.load.now()
        result.ok = (result.recovered_s is not None and result.recovered_s <= result.limit_recover_s
                     and (result.limit_detect_s is None or (result.detected_s is not None
                                                            and result.detected_s <= result.limit_detect_s)))
        self.log(f"  {'ok' if result.ok else 'FAILED'}: detected {result.detected_s} s, recovered "
                 f"{result.recovered_s} s, restarts {result.restarts} {'; '.join(result.notes)}")
        self.results.append(result)
        return result

    def _out_of_rotation(self, url: str, result: FaultResult, began: float) -> None:
        result.limit_detect_s = DETECT_LIMIT
        seen = wait_for(lambda: worker_healthy(self.cluster.router_url, url) is not True, DETECT_LIMIT + 20, 0.1)
        result.detected_s = None if seen is None else round(time.monotonic() - began, 2)

    def _stall(self, name: str, result: FaultResult) -> None:
        """SIGSTOP of the worker's scheduler only: its HTTP side (and launcher) go on answering."""
        self._hang(name, result, only=lambda p: p.name().startswith("sglang::sched"))

    def _hang(self, name: str, result: FaultResult, only=None) -> None:
        url = worker_url(self.cluster.spec, name)
        processes = [p for p in tree(self.cluster.processes[name].popen.pid) if only is None or only(p)]
        if not processes:
            result.notes.append("no process to stop")
            return
        result.notes.append(f"stopped {', '.join(sorted({p.name() for p in processes}))}")
        began = time.monotonic()
        for p in processes:
            p.suspend()  # the launcher too: no heartbeats either, as when a machine stalls
        try:
            self._out_of_rotation(url, result, began)
            time.sleep(max(0.0, HANG_SECONDS - (time.monotonic() - began)))
        finally:
            for p in processes:
                try:
                    p.resume()
                except psutil.NoSuchProcess:
                    pass
        result.resumed_at = self.load.now()
        resumed = time.monotonic()
        self.probes.exclude(name, result.injected_at, result.resumed_at)
        result.limit_recover_s = LIMITS[result.kind]
        took = wait_for(lambda: all_serving(self.cluster), LIMITS[result.kind] + 30)
        result.recovered_s = None if took is None else round(time.monotonic() - resumed, 2)

    def _kill(self, name: str, result: FaultResult) -> None:
        url = worker_url(self.cluster.spec, name)
        victim = sglang_main(self.cluster, name)
        if victim is None:
            result.notes.append("no SGLang process found")
            return
        began = time.monotonic()
        victim.send_signal(signal.SIGKILL)  # SGLang crashes; its launcher exits; nobody asked for it
        self._out_of_rotation(url, result, began)
        result.limit_recover_s = LIMITS["kill"]
        took = wait_for(lambda: self.cluster.processes[name].restarts > 0 and all_serving(self.cluster),
                        LIMITS["kill"] + 60, 0.5)
        result.recovered_s = None if took is None else round(time.monotonic() - began, 2)
        self.probes.exclude(name, result.injected_at, self.load.now())

    def _restart(self, name: str, result: FaultResult) -> None:
        process = self.cluster.processes[name]
        began = time.monotonic()
        os.kill(process.popen.pid, signal.SIGTERM)  # not through the cluster: to it, an exit nobody asked for
        want = self.cluster.spec.prefill.count + self.cluster.spec.decode.count
        result.limit_recover_s = LIMITS[name]
        if name == "bootstrap":
            def back() -> bool:
                return process.restarts > 0 and registered(self.cluster) == want and all_serving(self.cluster)
        else:
            def back() -> bool:
                return process.restarts > 0 and all_serving(self.cluster)
        took = wait_for(back, LIMITS[name] + 60, 0.2)
        result.recovered_s = None if took is None else round(time.monotonic() - began, 2)

    def _network(self, name: str, result: FaultResult) -> None:
        """Drop what the prefills send to the decode's Mooncake transfer ports for HANG_SECONDS (iptables)."""
        ports = mooncake_ports(self.cluster, name)
        if not ports:
            result.notes.append("no Mooncake port found")
            return
        rules = [["-p", "tcp", "-d", "127.0.0.1", "--dport", str(port), "-m", "comment", "--comment",
                  "pdcluster-chaos", "-j", "DROP"] for port in ports]
        began = time.monotonic()
        try:
            for rule in rules:
                subprocess.run(["iptables", "-I", "OUTPUT", *rule], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            result.notes.append(f"iptables refused: {exc}")
            return
        try:
            result.notes.append(f"dropped tcp to 127.0.0.1 ports {ports}")
            time.sleep(HANG_SECONDS)
        finally:
            for rule in rules:
                subprocess.run(["iptables", "-D", "OUTPUT", *rule], capture_output=True)
        result.resumed_at = self.load.now()
        resumed = time.monotonic()
        result.limit_recover_s = LIMITS["network"]
        took = wait_for(lambda: all_serving(self.cluster), LIMITS["network"] + 30)
        result.recovered_s = None if took is None else round(time.monotonic() - resumed, 2)
        result.notes.append(f"injected for {resumed - began:.0f}s")


def mooncake_ports(cluster: LocalCluster, name: str) -> list[int]:
    """TCP ports the worker's scheduler listens on for Mooncake transfers (not its HTTP/ZMQ loopback ports)."""
    ports = set()
    for p in tree(cluster.processes[name].popen.pid):
        try:
            if "sched" not in p.name():
                continue
            for conn in p.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr.ip in ("0.0.0.0", "::"):
                    ports.add(conn.laddr.port)
        except psutil.Error:
            continue
    return sorted(ports)


def clean_iptables() -> None:
    """Remove rules a previous run left behind (it was killed mid-fault)."""
    try:
        listing = subprocess.run(["iptables", "-S", "OUTPUT"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return
    for line in listing.splitlines():
        if "pdcluster-chaos" in line and line.startswith("-A "):
            subprocess.run(["iptables", "-D", *line.split()[1:]], capture_output=True)


# ----- the run -----

def summarize(records: list[Record]) -> dict:
    out: dict = {"requests": len(records)}
    for outcome in ("ok", "error", "refused", "defect"):
        out[outcome] = sum(1 for r in records if r.outcome == outcome)
    kinds: dict[str, dict] = {}
    for r in records:
        key = f"{r.route} {'stream' if r.stream else 'plain'}"
        kinds.setdefault(key, {"ok": 0, "error": 0, "refused": 0, "defect": 0})[r.outcome] += 1
    out["by_kind"] = kinds
    out["by_size"] = {s: sum(1 for r in records if r.size == s and r.outcome == "ok") for s in SIZES}
    latencies = [r.ended - r.started for r in records if r.outcome == "ok"]
    if latencies:
        latencies.sort()
        out["ok_latency_s"] = {"p50": round(statistics.median(latencies), 2),
                               "p99": round(latencies[int(0.99 * (len(latencies) - 1))], 2),
                               "max": round(latencies[-1], 2)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--steady", type=float, default=60.0, help="seconds of load before the first fault")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds of load between faults")
    parser.add_argument("--faults", default="all", help="comma-separated, from: " + ", ".join(ALL_FAULTS)
                        + "; 'all' or 'none'")
    parser.add_argument("--network", action="store_true", help="also: drop decode-0's Mooncake port (iptables)")
    parser.add_argument("--max-minutes", type=float, default=30.0, help="skip faults not started by then")
    parser.add_argument("--port-base", type=int, default=38000, help="router; +998 bootstrap, +100 prefills, "
                        "+200 decodes")
    parser.add_argument("--kv-port-base", type=int, default=39500)
    parser.add_argument("--prompts-per-size", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "chaos"), help="writes OUT.json, OUT.png")
    args = parser.parse_args(argv)

    faults = [] if args.faults == "none" else ALL_FAULTS if args.faults == "all" else [
        f.strip() for f in args.faults.split(",") if f.strip()]
    for fault in faults:
        if fault not in ALL_FAULTS:
            parser.error(f"unknown fault {fault!r}")
    if args.network:
        faults.insert(2 if len(faults) >= 2 else len(faults), "network decode-0")
    began_wall = time.time()
    t_start = time.monotonic()

    def log(line: str) -> None:
        print(f"[chaos {time.monotonic() - t_start:6.0f}s] {line}", flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = REPO / "logs" / "chaos"  # git-ignored; one file per component, appended across restarts
    spec = chaos_spec(args.port_base, args.kv_port_base)
    lines: list[str] = []

    def report(line: str) -> None:
        lines.append(f"{time.monotonic() - t_start:.1f}s {line}")
        log(f"supervisor: {line.splitlines()[0]}")

    cluster = LocalCluster(spec, log_dir, report=report)
    log("building the reference answers ...")
    reference = ReferenceModel(str(REPO / "models" / "tiny-llama"))
    prompts = build_prompts(reference, args.prompts_per_size, args.seed)
    log(f"{len(prompts)} prompts ({', '.join(f'{s} ~{n}' for s, n in SIZES.items())} tokens); starting a 2P+2D "
        f"cluster (logs in {log_dir}) ...")
    if args.network:
        clean_iptables()
    cluster.start()
    cluster.supervise()  # from the start: a worker that dies while starting is restarted too
    load = probes = chaos = None
    verdicts: list[str] = []
    try:
        started = wait_for(lambda: all_serving(cluster), cluster.spec.ready_timeout, 1.0)
        if started is None:
            raise TimeoutError(f"the cluster did not get ready within {cluster.spec.ready_timeout:.0f}s")
        log(f"ready after {started:.0f}s")
        names = [*(f"prefill-{i}" for i in range(2)), *(f"decode-{i}" for i in range(2))]
        baseline = {n: used_tokens(worker_url(spec, n)) for n in names}
        restarts_at_ready = cluster.restarts()
        load = Load(cluster.router_url, prompts, reference.tokenizer, args.clients, args.seed)
        probes = Probes(spec, load)
        load.start()
        probes.start()
        probes.heavy.set()
        log(f"steady load: {args.clients} clients for {args.steady:.0f}s")
        time.sleep(args.steady)
        steady_end = load.now()
        chaos = Chaos(cluster, load, probes, log)
        for fault in faults:
            if time.monotonic() - t_start > args.max_minutes * 60:
                verdicts.append(f"fault {fault} not run: past --max-minutes")
                continue
            if wait_for(lambda: all_serving(cluster), 120) is None:
                verdicts.append(f"before {fault}: not every worker serving")
            time.sleep(args.settle)
            chaos.run(fault)
        time.sleep(args.settle)
        log("stopping the load ...")
        load.finish()
        probes.stop.set()
        # The end: every worker registered and healthy, and its KV back at its idle level.
        end_ready = wait_for(lambda: all_serving(cluster) and registered(cluster) == 4, 300)
        kv_after = {}
        drained = wait_for(lambda: all(kv_after.update({n: used_tokens(worker_url(spec, n))}) or
                                       kv_after[n] <= baseline[n] for n in names), 60, 1.0)
        kv = {"baseline": baseline, "after": kv_after, "drained_s": None if drained is None else round(drained, 1)}
    except BaseException as exc:
        log(f"run aborted: {type(exc).__name__}: {exc}")
        verdicts.append(f"run aborted: {type(exc).__name__}: {exc}")
        end_ready, kv, steady_end, restarts_at_ready = None, {}, 0.0, {}
        if load is not None:
            load.finish()
        if probes is not None:
            probes.stop.set()
    finally:
        if args.network:
            clean_iptables()
        codes = cluster.stop(timeout=60)
    records = load.records if load else []
    summary = summarize(records)
    fault_results = [asdict(r) for r in (chaos.results if chaos else [])]
    if summary.get("defect"):
        verdicts.append(f"{summary['defect']} defects")
    for r in fault_results:
        if not r["ok"]:
            verdicts.append(f"fault {r['name']}: detected {r['detected_s']} s (limit {r['limit_detect_s']}), "
                            f"recovered {r['recovered_s']} s (limit {r['limit_recover_s']}) {r['notes']}")
    if load is not None and end_ready is None:
        verdicts.append("at the end, not every worker was registered and healthy")
    if kv and kv.get("drained_s") is None:
        verdicts.append(f"KV usage not back at its idle level: {kv}")
    result = {
        "what": "bench/chaos.py: faults one at a time under load on a local 2P+2D cluster (CPU, tiny-llama)",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(began_wall)),
        "duration_s": round(time.monotonic() - t_start),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_at_end": [round(x, 1) for x in os.getloadavg()]},
        "load": {"clients": args.clients, "routes": ["/generate", "/v1/completions"], "stream": "half",
                 "prompt_tokens": SIZES, "max_new_tokens": [8, 16, 32], "deadline_s": DEADLINE,
                 "prompts": len(prompts)},
        "passed": not verdicts,
        "verdicts": verdicts,
        "summary": summary,
        "faults": fault_results,
        "kv_used_tokens": kv,
        "restarts": {"at_ready": restarts_at_ready, "total": cluster.restarts()},
        "supervisor_lines": [line.splitlines()[0] for line in lines],
        "exit_codes": codes,
        "probes": {"steady": probes.summary(0, steady_end) if probes else {},
                   "whole_run_outside_fault_windows": probes.summary() if probes else {}},
        "defects": [asdict(r) for r in records if r.outcome == "defect"],
        "requests_columns": ["client", "started", "ended", "route", "stream", "size", "max_new", "outcome"],
        "requests": [[r.client, round(r.started, 2), round(r.ended, 2), r.route, r.stream, r.size, r.max_new,
                      r.outcome] for r in records],
        "errors": [asdict(r) for r in records if r.outcome in ("error", "refused")][:200],
        "timeline": timeline(records),
    }
    Path(f"{out}.json").write_text(dump(result))
    try:
        draw(result, Path(f"{out}.png"))
    except Exception as exc:  # noqa: BLE001 - the JSON is the result; the picture is a view of it
        log(f"no picture: {exc}")
    log(f"{summary.get('requests', 0)} requests: {summary.get('ok', 0)} ok, {summary.get('error', 0)} clear errors, "
        f"{summary.get('refused', 0)} refused, {summary.get('defect', 0)} defects; "
        f"{'PASSED' if not verdicts else 'FAILED: ' + '; '.join(verdicts)}")
    log(f"wrote {out}.json and {out}.png")
    return 0 if not verdicts else 1


def dump(result: dict) -> str:
    """Indented JSON, with every list or object of plain values on one line (the per-request rows, the timeline):
    a tenth of the lines, and a diff still shows what changed."""
    text = json.dumps(result, indent=1)
    for pattern in (r"\[\n\s+([^\[\]{}]*?)\n\s+\]", r"\{\n\s+([^\[\]{}]*?)\n\s+\}"):
        opening, closing = pattern[1], pattern[-1]
        text = re.sub(pattern, lambda m: opening + " ".join(line.strip() for line in m.group(1).splitlines())
                      + closing, text)
    return text + "\n"


def timeline(records: list[Record]) -> list[dict]:
    """Per second of the run: answers, clear errors, refusals and defects, by the second each request ended."""
    if not records:
        return []
    seconds = int(max(r.ended for r in records)) + 1
    rows = [{"t": t, "ok": 0, "error": 0, "refused": 0, "defect": 0} for t in range(seconds)]
    for r in records:
        rows[int(r.ended)][r.outcome] += 1
    return rows


def draw(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["timeline"]
    if not rows:
        return
    window = 5  # seconds: a moving mean keeps the low rates readable

    def rate(key: str) -> list[float]:
        values = [r[key] for r in rows]
        return [sum(values[max(0, i - window + 1):i + 1]) / min(window, i + 1) for i in range(len(values))]

    t = [r["t"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(15, 9), sharex=True, gridspec_kw={"height_ratios": [1, 1]})
    top.plot(t, rate("ok"), color="#2ca02c", label="right answers/s")
    top.plot(t, rate("error"), color="#d62728", label="clear errors/s (JSON 4xx/5xx, SSE error event)")
    refused = top.twinx()
    refused.plot(t, rate("refused"), color="#7f7f7f", lw=1, label="refused/s, right axis (router restarting)")
    refused.set_ylabel("refused/s", color="#7f7f7f")
    defects = [r["t"] for r in rows if r["defect"]]
    if defects:
        top.scatter(defects, [0] * len(defects), color="black", marker="x", s=60, zorder=5, label="defects")
    colors = {"hang": "#9467bd", "stall": "#8c564b", "kill": "#d62728", "restart": "#ff7f0e", "network": "#17becf"}
    for fault in result["faults"]:
        start, color = fault["injected_at"], colors.get(fault["kind"], "#cccccc")
        end = fault["recovered_at"] or (fault["resumed_at"] or start) + 5
        for ax in (top, bottom):
            ax.axvspan(start, end, color=color, alpha=0.12)
            if fault["resumed_at"]:
                ax.axvline(fault["resumed_at"], color=color, alpha=0.6, lw=1, ls="--")
            if fault["detected_s"] is not None:
                ax.axvline(start + fault["detected_s"], color=color, alpha=0.9, lw=1, ls=":")
        detected = "not seen" if fault["detected_s"] is None else f"out in {fault['detected_s']:.1f}s"
        top.annotate(f"{fault['name']}: {detected}, serving again after {fault['recovered_s']}s"
                     f"{'' if fault['ok'] else ' (FAILED)'}", (start, 0.98), xycoords=("data", "axes fraction"),
                     va="top", ha="right", fontsize=7, rotation=90)
    top.set_ylabel(f"per second ({window} s moving mean)")
    lines = top.get_legend_handles_labels()[0] + refused.get_legend_handles_labels()[0]
    top.legend(lines, [h.get_label() for h in lines], loc="lower left", fontsize=8, framealpha=0.85)
    top.grid(alpha=0.3)
    s = result["summary"]
    top.set_title(f"Chaos run: {s.get('requests', 0)} requests, {s.get('ok', 0)} right, {s.get('error', 0)} clear "
                  f"errors, {s.get('refused', 0)} refused, {s.get('defect', 0)} defects "
                  f"({'passed' if result['passed'] else 'FAILED'})")
    style = {"ok": ("#2ca02c", "o", "right answer"), "error": ("#d62728", "s", "clear error"),
             "refused": ("#7f7f7f", ".", "refused"), "defect": ("black", "x", "defect")}
    columns = result["requests_columns"]
    requests = [dict(zip(columns, row)) for row in result["requests"]]
    for outcome, (color, marker, label) in style.items():
        mine = [r for r in requests if r["outcome"] == outcome]
        if mine:
            bottom.scatter([r["started"] for r in mine], [max(0.01, r["ended"] - r["started"]) for r in mine],
                           s=8 if outcome == "ok" else 24, color=color, marker=marker, alpha=0.6, label=label)
    bottom.axhline(DEADLINE, color="black", lw=1, ls="--", alpha=0.5)
    bottom.set_yscale("log")
    bottom.set_ylabel("request duration, s (log; dashed: the deadline)")
    bottom.set_xlabel("seconds since the load started, by the request's start (shaded: a fault from injection until "
                      "every worker serves again; dotted: out of rotation; dashed: SIGCONT / network back)")
    bottom.legend(loc="upper left", fontsize=8)
    bottom.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
