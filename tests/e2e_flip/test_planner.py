"""The live planner on the flip cluster (tests/e2e_flip/conftest.py: 2 prefills + 1 decode, tiny-llama), started as a
user starts it (`python -m planner --config FILE`) on the cluster's router and bootstrap service, with a test profile:
in mode act it flips a prefill to decode under a decode-heavy load and a worker back to prefill under a prompt-heavy
one, losing no request; in mode recommend it says the split it wants and flips nothing."""

from __future__ import annotations

import json
import random
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdcluster.common.capacity import DecodePoint, PrefillPoint, Profile
from pdcluster.local.process import Process
from tests.e2e_flip.conftest import roles
from tests.e2e_flip.test_flip import Load, flipped
from tests.helpers import CLUSTER_POLL, until

PLANNER_PORT = 21900  # the suite's ports are 21xxx
INTERVAL_S = 3.0  # one decision every 3 s: quick, and still a few answers per interval on a busy machine
SHORT_PROMPT, LONG_ANSWER = 8, 64  # decode-heavy: 8 prompt tokens, 64 answer tokens (ignore_eos: always 64)
LONG_PROMPT = 512  # prompt-heavy: 512 prompt tokens, one answer token

# The test profile: a cartoon of a worker, so that the test's two loads call for opposite splits by a wide margin
# whatever their rate on a busy 2-core machine (each load runs at ~0.5-10 requests/s; the numbers hold from 0.15/s).
# - Prefill: 1600 tokens/s at 16 tokens (an 8-token prompt is held at that rate: 5 ms), 51.2 tokens/s at 512 (10 s
#   per prompt-heavy request). Decode-heavy: the offered load is rps x 5 ms, far below one prefill, and one prefill
#   meets the TTFT bound (30 s) for all but a vanishing share: need 1. Prompt-heavy: rps x 10 s of work per second;
#   from 0.1/s one prefill is at or past saturation, so the need is 2 or more (Erlang C; past the 3 workers there
#   are, rps x 10 / 0.9).
# - Decode: a step takes 0.25 s alone and 0.5 s for two streams, at any context; with the ITL bound at 0.3 s a decode
#   holds one stream. Decode-heavy: each request holds a decode for 64 x 0.25 = 16 s, so the need is rps x 16 / 0.85
#   (decode_utilization), >= 2.8 from 0.15/s: 2P1D runs its decode at >= 2.8, 1P2D at max(1, need/2), lower by far
#   more than the hysteresis (a fifth): change to 1P2D. Prompt-heavy: one token, rps x 0.25 / 0.85 = 0.3 x rps,
#   always under half the prefill need: 1P2D runs its prefill at the prefill need, 2P1D at half of it: change to 2P1D.
# The SLO corrections can only raise a need by 1.5x at most, which changes none of these verdicts.
PROFILE = Profile(
    model="tiny-llama", hardware="none: a test's numbers (tests/e2e_flip/test_planner.py says why)",
    measured_at=datetime(2026, 1, 1, tzinfo=UTC), method="written by tests/e2e_flip/test_planner.py",
    prefill=(PrefillPoint(prompt_tokens=16, tokens_per_s=1600.0), PrefillPoint(prompt_tokens=512, tokens_per_s=51.2)),
    decode=tuple(DecodePoint(batch=batch, context_tokens=context, itl_s=0.25 * batch)
                 for context in (16, 1024) for batch in (1, 2)))


def planner_config(tmp_path: Path, cluster, mode: str) -> Path:
    profile = tmp_path / "tiny-llama-profile.json"
    PROFILE.dump(profile)
    config = {
        "ttft": {"percentile": 90, "bound_s": 30.0}, "itl": {"percentile": 90, "bound_s": 0.3},
        "interval_s": INTERVAL_S, "mode": mode,
        "dwell_s": 0,  # the test reverses its load on purpose: no dwell holds the flip back
        "predictor": "constant", "window": 1,  # the last interval's load: the test changes it in steps
        "profile": str(profile), "router_url": cluster.router_url, "bootstrap_url": cluster.spec.bootstrap_url,
        "host": "127.0.0.1", "port": PLANNER_PORT,
    }
    path = tmp_path / f"planner-{mode}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


class Planner:
    """`python -m planner` as a child process (pdcluster.local's Process, as `make up PLANNER=1` starts it)."""

    def __init__(self, config: Path, log_dir: Path):
        self.process = Process("planner", [sys.executable, "-m", "planner", "--config", str(config)],
                               log_dir / f"{config.stem}.log")

    def metric(self, name: str, **labels: str) -> float | None:
        text = httpx.get(f"http://127.0.0.1:{PLANNER_PORT}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return None

    def flips(self) -> dict[str, float]:
        return {result: self.metric("pdcluster_planner_flips_total", result=result) or 0.0
                for result in ("accepted", "refused", "done", "failed")}

    def log(self) -> str:
        return self.process.tail(40)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{PLANNER_PORT}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


@contextmanager
def planner(tmp_path: Path, cluster, mode: str) -> Iterator[Planner]:
    started = Planner(planner_config(tmp_path, cluster, mode), tmp_path)
    started.process.start()
    try:
        assert until(started.healthy, 60, CLUSTER_POLL), started.log()
        yield started
    finally:
        started.process.signal(signal.SIGTERM)
        assert started.process.popen is not None
        assert started.process.popen.wait(timeout=60) == 0, started.log()


class Requests(Load):
    """test_flip's Load with another body: each client sends `body(rng)` again and again, streamed or not, and keeps
    (status, answer tokens) of each answer."""

    def __init__(self, router: httpx.Client, body: Callable[[random.Random], dict], clients: int = 3):
        super().__init__(router, clients)
        self.body = body

    def _client(self, text: str) -> None:
        rng = random.Random(text)
        while not self.stop.is_set():
            body = self.body(rng)
            try:
                self.answers.append(self._one(body))
            except httpx.HTTPError as exc:
                self.answers.append((-1, repr(exc)))

    def _one(self, body: dict) -> tuple[int, object]:
        if not body.get("stream"):
            response = self.router.post("/generate", json=body)
            ok = response.status_code == 200
            return response.status_code, len(response.json()["output_ids"]) if ok else response.text[:200]
        with self.router.stream("POST", "/generate", json=body) as response:
            lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
            if response.status_code != 200 or len(lines) < 2 or lines[-1] != "[DONE]":
                return response.status_code, lines[-2:]
        return 200, len(json.loads(lines[-2])["output_ids"])

    def all_answered(self, tokens: int) -> bool:
        return bool(self.answers) and all(a == (200, tokens) for a in self.answers)


def ids_of(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 1000) for _ in range(n)]  # the demo vocabulary: 1000 ids, the first few special


def decode_heavy(rng: random.Random) -> dict:
    return {"input_ids": ids_of(rng, SHORT_PROMPT), "stream": True,
            "sampling_params": {"max_new_tokens": LONG_ANSWER, "temperature": 0, "ignore_eos": True}}


def prompt_heavy(rng: random.Random) -> dict:
    return {"input_ids": ids_of(rng, LONG_PROMPT), "sampling_params": {"max_new_tokens": 1, "temperature": 0}}


def split(registry: httpx.Client) -> tuple[int, int]:
    now = list(roles(registry).values())
    return now.count("prefill"), now.count("decode")


def no_switch_running(registry: httpx.Client) -> bool:
    return not any((w.get("switch") or {}).get("state") in ("draining", "switching")
                   for w in registry.get("/v1/workers").json()["workers"])


def test_planner_recommend_says_two_decodes_under_decode_heavy_load_and_flips_nothing(
        flip_cluster, router, registry, tmp_path):
    started_as = roles(registry)
    with planner(tmp_path, flip_cluster, "recommend") as recommending, Requests(router, decode_heavy) as decoding:
        # Two decisions for 1P2D in a row: a recommendation that holds, and time in which a flip would have started.
        assert until(lambda: recommending.metric("pdcluster_planner_decisions_total", verdict="change") >= 2, 60,
                     CLUSTER_POLL), recommending.log()
        assert recommending.metric("pdcluster_planner_desired_workers", role="decode") == 2
        assert recommending.metric("pdcluster_planner_desired_workers", role="prefill") == 1
        assert recommending.metric("pdcluster_planner_observed_workers", role="decode") == 1
        assert "recommend: no flip asked for" in recommending.log()
        assert roles(registry) == started_as and no_switch_running(registry)
        assert recommending.flips() == {"accepted": 0, "refused": 0, "done": 0, "failed": 0}
    assert decoding.all_answered(LONG_ANSWER), [a for a in decoding.answers if a != (200, LONG_ANSWER)][:3]


def test_planner_act_flips_a_prefill_to_decode_under_decode_heavy_load_and_back_under_prompt_heavy(
        flip_cluster, router, registry, ids, switch, tmp_path):
    started_as = roles(registry)
    with planner(tmp_path, flip_cluster, "act") as live:
        with Requests(router, decode_heavy) as decoding:
            assert until(lambda: split(registry) == (1, 2) and no_switch_running(registry)
                         and live.flips()["done"] == 1, 90, CLUSTER_POLL), (roles(registry), live.flips(), live.log())
        flipped_to_decode = next(wid for wid, role in roles(registry).items() if started_as[wid] != role)
        assert started_as[flipped_to_decode] == "prefill"
        assert f"flip done: {flipped_to_decode} serves as decode" in live.log()
        with Requests(router, prompt_heavy) as prompting:
            assert until(lambda: split(registry) == (2, 1) and no_switch_running(registry)
                         and live.flips()["done"] == 2, 90, CLUSTER_POLL), (roles(registry), live.flips(), live.log())
        assert live.flips() == {"accepted": 2, "refused": 0, "done": 2, "failed": 0}, live.log()
    # Nothing lost: every answer of both phases, before, during and after each flip, whole.
    assert decoding.all_answered(LONG_ANSWER), [a for a in decoding.answers if a != (200, LONG_ANSWER)][:3]
    assert prompting.all_answered(1), [a for a in prompting.answers if a != (200, 1)][:3]
    # The planner flips back the decode that loses least, which may be decode-0 (prefill-1 then stays a decode): the
    # split is the cluster's, the roles the test's to restore, with the planner stopped. One at a time, never
    # emptying a role: the one whose current role another worker still serves first.
    for _ in ids:
        now = roles(registry)
        wrong = [wid for wid, role in now.items() if role != started_as[wid]]
        if not wrong:
            break
        wid = next(w for w in wrong if list(now.values()).count(now[w]) > 1)
        flipped(switch(wid, started_as[wid]), wid, now[wid], started_as[wid])
    assert roles(registry) == started_as
