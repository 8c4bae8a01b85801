"""`python -m bench.routing.restarts` (`make bench-routing-restarts`, ~12 min): cache_aware across restarts, on real
SGLang (2 prefills, 1 decode, SmolLM2; no KV store, or one shared: `--shared-store` below). One workload of
bench.routing's shape, its tenants' system prompts the same throughout and every question new, sent in three phases
by 4 closed-loop clients through one cache_aware router of ours (workers discovered from the bootstrap service):
1. steady: the reference hit ratio (a request's cached tokens over its prompt tokens), over its second half;
2. the router restarted (stopped, started on the same port; traffic resumes once it answers): its index is empty
   until it replays what the prefills' publishers buffered;
3. a prefill killed mid-traffic and started again: its memory is empty, its old index entries must go.
Per restart: the decisions by kind (`blind`: no candidate's events known), the requests that failed, and the seconds
from the restarted part being back until the hit ratio over 4 consecutive answers is >= 0.9 of steady. Targets: <= 1%
of decisions blind, back within 10 s. And what the restarted prefill served once back (its requests, their cached
tokens, read from the store among them, the tokens the router predicted it held), and the other prefill while it was
down. Writes bench/results/routing-restarts.json and .png. Hold `flock /tmp/pdcluster-cluster.lock` (the Makefile
target does).

`--shared-store` (`make bench-routing-restarts SHARED=1`, routing-restarts-shared.json and .png): both prefills
read and write one KV store (`cluster.kv_store.dir`: one fresh directory, so one namespace and one store id), so the
restarted prefill comes back with an empty memory and a warm store, whose pages cache_aware credits to it
(router/kv_routing/kv_index.py). The decode gets the store's page size only (decode_offload off: its answers are never
a prompt
here, and a third HiCache worker would need SGLang's 10 GiB RAM reserve once more). Otherwise the same run, but with
HiCache on the prefills and pages of 64 tokens (only whole pages are cached): compare each run with its own steady.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from bench.harness import clusters, machine, procs
from bench.harness.paths import RESULTS
from bench.harness.plot import pyplot, save
from bench.routing import report
from bench.routing.load import CONCURRENCY, QUICK, drive, one
from bench.routing.report import Shape

PER_PHASE = 40
WINDOW = 4  # answers in a row that make a hit ratio
RECOVERED = 0.9  # of steady's hit ratio
TARGET_SECONDS, TARGET_BLIND = 10.0, 0.01
KILL_AFTER = 5.0  # seconds into phase 3
BACK_WITHIN = 600.0  # seconds for the restarted prefill to be in the router's pool again, or the run stops
# SGLang starts a HiCache worker only with 10 GiB of RAM available besides its host pool (~1.4 GiB here), after what
# the workers starting with it took (~2.5 GiB each; tests/e2e_persistence/conftest.py): two prefills at once.
STORE_RAM_GIB = 10.5 + 2 * 2.5
_DECISIONS = re.compile(r'^pdcluster_router_routing_decisions_total\{kind="(\w+)"\} (\S+)$', re.M)


def decisions(router: procs.Proc) -> dict[str, float]:
    return {kind: float(v) for kind, v in _DECISIONS.findall(httpx.get(f"{router.url}/metrics", timeout=10).text)}


async def timed(url: str, texts: list[str], t0: float) -> list[dict]:
    """bench.routing's closed loop, each answer with when it ended (seconds from t0)."""
    answers: list[dict] = [{} for _ in texts]
    pending = iter(enumerate(texts))
    async with httpx.AsyncClient(timeout=900) as client:
        async def client_loop() -> None:
            for i, text in pending:
                answers[i] = {**await one(client, url, text), "ended": time.monotonic() - t0}
        await asyncio.gather(*(client_loop() for _ in range(CONCURRENCY)))
    return answers


def ratio(answer: dict) -> float | None:
    prompt = answer.get("prompt_tokens")
    return answer["cached_tokens"] / prompt if prompt and answer.get("error") is None else None


def recovery(answers: list[dict], back_at: float, steady: float) -> float | None:
    """Seconds from `back_at` until WINDOW answers in a row (by their end) hold RECOVERED of steady's hit ratio."""
    done = sorted((a for a in answers if ratio(a) is not None and a["ended"] >= back_at), key=lambda a: a["ended"])
    for i in range(len(done) - WINDOW + 1):
        window = [ratio(a) or 0.0 for a in done[i:i + WINDOW]]
        if sum(window) / WINDOW >= RECOVERED * steady:
            return round(max(0.0, done[i]["ended"] - back_at), 2)
    return None


def phase_row(name: str, answers: list[dict], kinds: dict[str, float], back_at: float | None, steady: float) -> dict:
    total = sum(kinds.values())
    ratios = [r for a in answers if (r := ratio(a)) is not None]
    return {"phase": name, "requests": len(answers), "errors": sum(a.get("error") is not None for a in answers),
            "decisions": kinds, "blind_share": round(kinds.get("blind", 0) / total, 4) if total else None,
            "hit_ratio": round(sum(ratios) / len(ratios), 4) if ratios else None,
            "seconds_to_recover": recovery(answers, back_at, steady) if back_at is not None else None}


def store_args(store: Path) -> dict[str, list[str]]:
    """Both prefills on the one directory `store`; the decode with its page size (the launcher's, with kv_store)."""
    where = ["--cluster", f"kv_store.dir={store}"]
    return {"prefill": where, "decode": [*where, "--cluster", "kv_store.decode_offload=false"]}


def served(answers: list[dict], port: int, since: float, until: float = float("inf")) -> dict:
    """What the prefill on `port` answered, ending from `since` to `until` (an answer names its prefill,
    prefill-<host>-<port>)."""
    mine = [a for a in answers if a.get("error") is None and since <= a["ended"] < until
            and str(a.get("prefill") or "").endswith(f"-{port}")]
    return {key: sum(a.get(key) or 0 for a in mine) for key in
            ("prompt_tokens", "cached_tokens", "storage_tokens", "predicted")} | {"requests": len(mine)}


def store_contents(store: Path) -> dict:
    """The store's namespaces (one: both prefills wrote the same) and their pages, as files on disk."""
    spaces = [d for d in store.iterdir() if (d / "namespace.json").is_file()] if store.is_dir() else []
    return {"namespaces": len(spaces), "pages": sum(1 for d in spaces for f in d.iterdir() if f.suffix == ".bin")}


def run(log, shared: bool) -> dict:
    model = clusters.MODELS["smollm2"]
    log_dir = Path(tempfile.mkdtemp(prefix="bench-routing-restarts-"))
    log(f"process logs in {log_dir}")
    shape = Shape(requests=3 * PER_PHASE)
    texts = [r.text for r in report.workload(shape, seed=1)]  # one set of tenants, every question new
    store = log_dir / "kv"
    if shared and psutil.virtual_memory().available < STORE_RAM_GIB * 2**30:
        raise SystemExit(f"--shared-store: SGLang starts the two HiCache prefills only with ~{STORE_RAM_GIB:.1f} GiB "
                         f"of RAM available, {psutil.virtual_memory().available / 2**30:.1f} GiB are")
    cluster = clusters.start_cluster(model, 2, sleep_on_idle=True, log_dir=log_dir / "cluster",
                                    extra_args=store_args(store) if shared else None)
    router = None
    try:
        cluster.wait_ready()
        settings = {"bootstrap_url": cluster.spec.bootstrap_url, "expose_worker_ids": True}
        router = procs.start_ours("router-cache_aware", log_dir, [], [], "cache_aware", settings=settings)
        clusters.wait_generates(router, 300)
        asyncio.run(drive(router.url, [r.text for r in report.workload(QUICK, seed=10_000)], 2))
        log("warmed up")
        t0 = time.monotonic()
        start = decisions(router)
        steady_answers = asyncio.run(timed(router.url, texts[:PER_PHASE], t0))
        steady_ratios = [r for a in steady_answers[PER_PHASE // 2:] if (r := ratio(a)) is not None]
        steady = sum(steady_ratios) / len(steady_ratios)
        kinds = {k: v - start.get(k, 0) for k, v in decisions(router).items()}
        phases = [phase_row("steady", steady_answers, kinds, None, steady)]
        log(f"steady: {phases[-1]}")

        router.stop()
        router = procs.start(router.name, list(router.popen.args), log_dir, router.port)  # its config: same port
        clusters.wait_generates(router, 300)
        back_at = time.monotonic() - t0
        answers = asyncio.run(timed(router.url, texts[PER_PHASE:2 * PER_PHASE], t0))
        phases.append(phase_row("router restarted", answers, decisions(router), back_at, steady))
        log(f"router restarted: {phases[-1]}")

        before = decisions(router)
        answers, down_at, back_at = asyncio.run(prefill_restart(cluster, router, texts[2 * PER_PHASE:], t0, log))
        kinds = {k: v - before.get(k, 0) for k, v in decisions(router).items()}
        phases.append(phase_row("prefill restarted", answers, kinds, back_at, steady))
        # With the store: the other prefill reads the killed one's tenants from it while it is down (storage_tokens),
        # and the restarted one, once back, reads what either wrote.
        restarted = {"once_back": served(answers, clusters.PORTS["prefill"], back_at),
                     "other_while_down": served(answers, clusters.PORTS["prefill"] + 1, down_at, back_at)}
        log(f"prefill restarted: {phases[-1]}; prefill-0 restarted: {restarted}")
    finally:
        if router is not None:
            router.stop()
        cluster.stop()
    return {"steady_hit_ratio": round(steady, 4), "phases": phases, "restarted_prefill": restarted,
            **({"store": store_contents(store)} if shared else {})}


async def prefill_restart(cluster, router: procs.Proc, texts: list[str], t0: float,
                          log) -> tuple[list[dict], float, float]:
    """Phase 3's traffic, with prefill-0 killed KILL_AFTER seconds in and started again; when it was killed, and when
    the router has it back."""
    traffic = asyncio.create_task(timed(router.url, texts, t0))
    await asyncio.sleep(KILL_AFTER)
    down_at = time.monotonic() - t0
    name, url = "prefill-0", f"http://127.0.0.1:{clusters.PORTS['prefill']}"
    with cluster.held(name) as process:
        await asyncio.to_thread(_kill_and_start, process)
    log(f"{name} killed and started again")
    while await asyncio.to_thread(_usable, router, url):  # until the router saw it go (then come back)
        await asyncio.sleep(0.2)
    deadline = time.monotonic() + BACK_WITHIN
    while not await asyncio.to_thread(_usable, router, url):
        if time.monotonic() > deadline:  # e.g. SGLang refused it the RAM (the supervisor restarts it meanwhile)
            raise RuntimeError(f"{name} not back in the router's pool within {BACK_WITHIN:.0f} s: {process.log_path}")
        await asyncio.sleep(0.5)
    back_at = time.monotonic() - t0
    log(f"{name} back in the router's pool at {back_at:.1f}s")
    return await traffic, down_at, back_at


def _kill_and_start(process) -> None:
    for child in procs.tree(process.popen.pid)[::-1]:
        child.kill()
    process.popen.wait(timeout=60)
    process.start()


def _usable(router: procs.Proc, url: str) -> bool:
    """Whether the router lists the worker at `url` and may send it requests."""
    try:
        workers = httpx.get(f"{router.url}/ready", timeout=10).json().get("workers", [])
    except (httpx.HTTPError, ValueError):
        return False
    return any(w.get("url") == url and not w.get("unusable") for w in workers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routing.restarts",
                                     description="cache_aware across restarts (the module docstring)")
    parser.add_argument("--shared-store", action="store_true",
                        help="both prefills on one KV store directory (routing-restarts-shared.json)")
    args = parser.parse_args(argv)
    stem = "routing-restarts-shared" if args.shared_store else "routing-restarts"
    t0 = time.monotonic()

    def log(line: str) -> None:
        print(f"[routing-restarts {time.monotonic() - t0:5.0f}s] {line}", flush=True)

    began, measured_on = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), machine.machine()
    measured = run(log, args.shared_store)
    restarts = measured["phases"][1:]
    verdicts = {p["phase"]: {"blind_share": p["blind_share"], "blind_met": (p["blind_share"] or 0) <= TARGET_BLIND,
                             "seconds_to_recover": p["seconds_to_recover"],
                             "recover_met": p["seconds_to_recover"] is not None
                             and p["seconds_to_recover"] <= TARGET_SECONDS} for p in restarts}
    store = ", both prefills on one KV store" if args.shared_store else ""
    result = {"benchmark": f"cache_aware across a router restart and a prefill restart, 2 prefills + 1 decode, "
                           f"SmolLM2{store}",
              "settings": {"shape": vars(Shape(requests=3 * PER_PHASE)), "per_phase": PER_PHASE,
                           "shared_store": args.shared_store,
                           "concurrency": CONCURRENCY, "window": WINDOW, "recovered": RECOVERED,
                           "kill_after_s": KILL_AFTER},
              "machine": measured_on, "started_utc": began, "wall_seconds": round(time.monotonic() - t0),
              **measured, "verdicts": verdicts}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, RESULTS / f"{stem}.png")
    log(json.dumps(verdicts))
    return 0


def plot(result: dict, path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(8, 3.5))
    names = [p["phase"] for p in result["phases"]]
    ax.bar(names, [p["hit_ratio"] or 0 for p in result["phases"]], color="tab:blue")
    for i, p in enumerate(result["phases"]):
        label = f"blind {p['blind_share']}, errors {p['errors']}"
        if p["seconds_to_recover"] is not None:
            label += f"\nback in {p['seconds_to_recover']} s"
        ax.text(i, (p["hit_ratio"] or 0) / 2, label, ha="center", fontsize=8, color="white")
    ax.set_ylabel("cached / prompt tokens")
    ax.set_title("cache_aware across restarts" + (", one KV store" if result["settings"].get("shared_store") else ""))
    save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
