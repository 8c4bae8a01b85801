"""`python -m bench.planner.flip` (`make bench-flip`): what a live role flip costs on this machine's model, the number
the planner and its simulator take as `flip_seconds` (pdcluster/common/capacity.py).

A 2-prefill + 1-decode cluster (the shared harness, SmolLM2 by default) under a light load of streamed greedy
requests; its second prefill is flipped to decode and back `--repeats` times with the operator's command (`python -m
bootstrap switch`). Per flip: the drain (until SGLang is idle: depends on the load, reported apart), the switch (from
the end of the drain until the worker registered in its new role) and the router's admission of the new instance (its
canary); "flip" = switch + admission, from the end of the drain to serving in the new role (target <= 15 s). Every
answer of the load is checked: none lost, each token-exact against the same prompt's answer before any flip.
`--write-profile` stores the median flip in the model's profile (configs/profiles/), for the planner and the gym.
Writes bench/results/flip.json and .png."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.harness import clusters
from bench.harness.machine import machine
from bench.harness.markdown import met
from bench.harness.paths import REPO, RESULTS
from bench.harness.plot import pyplot, save, stamp
from pdcluster.common.capacity import Profile

PROMPTS = ("The capital of France is", "Once upon a time, in a land far away,", "Write a haiku about the sea.")
MAX_NEW = 32
TARGET_S = 15.0
OUTCOME = re.compile(r"drained in ([\d.]+)s, switched in ([\d.]+)s")


def greedy(text: str, stream: bool) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}, "stream": stream}


def ask(client: httpx.Client, text: str) -> tuple[int, list[int]]:
    """One streamed /generate: its status and the final output ids ([] unless it ended with [DONE])."""
    with client.stream("POST", "/generate", json=greedy(text, stream=True)) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    if response.status_code != 200 or not lines or lines[-1] != "[DONE]":
        return response.status_code, []
    return 200, json.loads(lines[-2])["output_ids"]


class Load:
    """`clients` threads of a pool, each asking one prompt after another until stopped; every answer kept."""

    def __init__(self, router_url: str, clients: int = 2):
        self.stop, self.answers, self.clients = threading.Event(), [], clients
        self.client = httpx.Client(base_url=router_url, timeout=300)
        self.pool = ThreadPoolExecutor(clients, thread_name_prefix="load")

    def _run(self, text: str) -> None:
        while not self.stop.is_set():
            try:
                self.answers.append((text, *ask(self.client, text)))
            except httpx.HTTPError as exc:
                self.answers.append((text, -1, [repr(exc)]))

    def __enter__(self) -> Load:
        self.running = [self.pool.submit(self._run, PROMPTS[i % len(PROMPTS)]) for i in range(self.clients)]
        return self

    def __exit__(self, *_exc) -> None:
        self.stop.set()
        self.pool.shutdown(wait=True)  # each client ends its request in flight
        self.client.close()


def serving_as(router_url: str, wid: str, role: str) -> bool:
    workers = httpx.get(f"{router_url}/ready", timeout=10).json()["workers"]
    return any(w["worker_id"] == wid and w["role"] == role and not w["unusable"] for w in workers)


def flip(bootstrap_url: str, router_url: str, wid: str, to: str) -> dict:
    """One flip by the operator's command; its drain, switch and admission seconds."""
    done = subprocess.run([sys.executable, "-m", "bootstrap", "switch", wid, "--to", to, "--wait", "600", "--url",
                           bootstrap_url], cwd=REPO, capture_output=True, text=True, timeout=660)
    registered = time.monotonic()
    match = OUTCOME.search(done.stdout)
    if done.returncode != 0 or not match:
        raise RuntimeError(f"the flip of {wid} to {to} failed: {done.stdout} {done.stderr}")
    while not serving_as(router_url, wid, to):
        if time.monotonic() - registered > 300:
            raise RuntimeError(f"{wid} not admitted as a {to} 300 s after it registered")
        time.sleep(0.1)
    admission = time.monotonic() - registered
    drain, switch = float(match[1]), float(match[2])
    return {"to": to, "drain_s": drain, "switch_s": switch, "admission_s": round(admission, 2),
            "flip_s": round(switch + admission, 2)}


def summary(flips: list[dict], answers: list[tuple], expected: dict[str, list[int]]) -> dict:
    flip_s = [f["flip_s"] for f in flips]
    lost = [a for a in answers if a[1] != 200]
    wrong = [a for a in answers if a[1] == 200 and a[2] != expected[a[0]]]
    return {"flips": len(flips), "flip_s_median": statistics.median(flip_s), "flip_s_max": max(flip_s),
            "drain_s_median": statistics.median(f["drain_s"] for f in flips),
            "answers": len(answers), "lost": len(lost), "not_token_exact": len(wrong),
            "target": f"flip <= {TARGET_S} s, 0 lost, all token-exact",
            "met": max(flip_s) <= TARGET_S and not lost and not wrong}


def readme_line(result: dict) -> str:
    """bench/README.md's line for a run (bench/tables.py)."""
    s = result["summary"]
    return (f"{s['flips']} flips under load, end of drain to serving: median {s['flip_s_median']:.1f} s, max "
            f"{s['flip_s_max']:.1f} s (drains apart: median {s['drain_s_median']:.1f} s); {s['answers']} answers, "
            f"{s['lost']} lost, {s['not_token_exact']} not token-exact. Target (<= {TARGET_S:.0f} s, none lost, all "
            f"exact): {met(s['met'])}.")


def draw(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    flips = result["flips"]
    labels = [f"{i + 1}: to {f['to']}" for i, f in enumerate(flips)]
    switch = [f["switch_s"] for f in flips]
    ax.bar(labels, switch, label="switch (SGLang + registration)", color="#4c72b0")
    ax.bar(labels, [f["admission_s"] for f in flips], bottom=switch, label="router admission", color="#dd8452")
    ax.axhline(TARGET_S, color="#c44e52", linestyle="--", label=f"target {TARGET_S:.0f} s")
    ax.set_ylabel("seconds from the end of the drain")
    ax.set_title(f"Role flips on {result['settings']['model']} ({stamp(result['machine'])})", fontsize=9)
    ax.legend(fontsize=8)
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.planner.flip", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(clusters.MODELS), default="smollm2")
    parser.add_argument("--repeats", type=int, default=3, help="round trips (prefill to decode and back)")
    parser.add_argument("--write-profile", action="store_true", help="store the median flip in the model's profile")
    parser.add_argument("--out", type=Path, default=RESULTS / "flip", help="result path without extension")
    args = parser.parse_args(argv)
    model = clusters.MODELS[args.model]
    log_dir = Path(tempfile.mkdtemp(prefix="bench-flip-"))
    print(f"process logs in {log_dir}", flush=True)
    measured_on, began = machine(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cluster = clusters.start_cluster(model, 2, sleep_on_idle=True, log_dir=log_dir)
    router_url, bootstrap_url = cluster.spec.router_url, cluster.spec.bootstrap_url
    wid = f"prefill-127.0.0.1-{clusters.PORTS['prefill'] + 1}"
    flips: list[dict] = []
    try:
        cluster.wait_ready()
        with httpx.Client(base_url=router_url, timeout=300) as client:
            expected = {text: ask(client, text)[1] for text in PROMPTS}  # before any flip
        with Load(router_url) as load:
            for _ in range(args.repeats):
                for to in ("decode", "prefill"):
                    time.sleep(10)  # requests through the worker in its current role, between flips
                    flips.append(flip(bootstrap_url, router_url, wid, to))
                    print(f"flip {len(flips)}: {flips[-1]}", flush=True)
            time.sleep(10)
    finally:
        cluster.stop()
    result = {"benchmark": "live role flip, end of the drain to serving in the new role",
              "settings": {"model": model.path, "repeats": args.repeats, "load_clients": 2, "max_new_tokens": MAX_NEW},
              "machine": measured_on, "started_utc": began, "flips": flips,
              "summary": summary(flips, load.answers, expected)}
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")
    draw(result, Path(f"{args.out}.png"))
    print(json.dumps(result["summary"], indent=1), flush=True)
    if args.write_profile:
        path = REPO / "configs" / "profiles" / f"{model.served}.json"
        Profile.load(path).model_copy(update={"flip_seconds": result["summary"]["flip_s_median"]}).dump(path)
        print(f"wrote flip_seconds={result['summary']['flip_s_median']} into {path}", flush=True)
    return 0 if result["summary"]["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
