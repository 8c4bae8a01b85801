"""Admission (router/pd/admission.py): a new worker instance gets traffic only once its canary answers what admitted
workers of its model answer. Fake workers answer the canary with `canary_ids` (a worker with other weights under
the same path and name answers other ids)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx

from bootstrap.app import create_app as create_bootstrap
from bootstrap.config import BootstrapConfig
from router.app import create_app
from router.config import RouterConfig
from router.pd import admission
from tests.fakes import Behaviour, FakeWorker, ServerThread, until
from tests.unit.test_bootstrap_service import registration
from tests.unit.test_router_pd import metric


def register(service: str, worker_id: str, role: str, url: str, instance: str = "1", **extra) -> None:
    """Register a fake worker (`extra`: more registration fields) and heartbeat it, as its launcher would, until it
    is deregistered: a test may outlive the registry's TTL on a busy machine."""
    body = registration(worker_id, role) | {"url": url, "instance_id": instance} | extra
    assert httpx.put(f"{service}/v1/workers/{worker_id}", json=body).status_code == 200
    threading.Thread(target=_heartbeats, args=(service, worker_id), daemon=True).start()


def _heartbeats(service: str, worker_id: str) -> None:
    while True:
        time.sleep(1.0)
        try:
            if httpx.post(f"{service}/v1/workers/{worker_id}/heartbeat", json={}, timeout=5).status_code != 200:
                return  # deregistered
        except httpx.HTTPError:
            return  # the service stopped


@contextlib.contextmanager
def discovered(fakes: dict[str, FakeWorker], first: dict[str, str], ttl: float = 5.0,
               extra: dict[str, dict] | None = None) -> Iterator[tuple[str, dict[str, str], str]]:
    """A bootstrap service, each fake served, the `first` of them (name -> role) registered under their names (with
    `extra[name]`'s fields), then a router following the registry (its worker ids exposed). Yields the service's URL,
    each fake's URL and the router's URL."""
    with contextlib.ExitStack() as stack:
        service = stack.enter_context(ServerThread(create_bootstrap(BootstrapConfig(ttl_seconds=ttl)))).url
        urls = {name: stack.enter_context(ServerThread(fake.app())).url for name, fake in fakes.items()}
        for name, role in first.items():
            register(service, name, role, urls[name], **(extra or {}).get(name, {}))
        router = stack.enter_context(ServerThread(create_app(RouterConfig(bootstrap_url=service,
                                                                          expose_worker_ids=True))))
        yield service, urls, router.url


def workers(router: str) -> dict[str, dict]:
    return {w["worker_id"]: w for w in httpx.get(f"{router}/ready").json()["workers"]}


def test_a_worker_with_other_weights_is_kept_out_and_a_good_one_comes_in():
    wrong = FakeWorker(canary_ids=[9, 9, 9])
    fakes = {"p": FakeWorker(), "d-good": FakeWorker(), "d-wrong": wrong}
    with discovered(fakes, {"p": "prefill", "d-good": "decode"}) as (service, urls, router):
        # The first pair of a model sets the reference: both admitted before the router serves.
        assert httpx.get(f"{router}/ready").status_code == 200
        admissions = {k: v["admission"] for k, v in workers(router).items()}
        assert admissions == {"p": "admitted", "d-good": "admitted"}
        register(service, "d-wrong", "decode", urls["d-wrong"])  # same identity, other weights
        assert until(lambda: workers(router).get("d-wrong", {}).get("admission") == "refused")
        refused = workers(router)["d-wrong"]
        assert refused["unusable"].startswith("refused at admission: canary through p answered [9, 9, 9]")
        served = {httpx.post(f"{router}/generate", json={"text": "x"}).headers["x-pdcluster-decode"]
                  for _ in range(6)}
        assert served == {"d-good"} and wrong.received == []
        assert metric(router, "pdcluster_router_admissions_total", role="decode", result="refused") == 1
        # Once per instance: it is not asked again...
        canaries = wrong.canaries
        register(service, "d-wrong", "decode", urls["d-wrong"])
        assert not until(lambda: wrong.canaries > canaries, timeout=2)
        # ... but a restarted instance is: here with the right weights, it comes in.
        wrong.canary_ids = [1, 2, 3]
        register(service, "d-wrong", "decode", urls["d-wrong"], instance="2")
        assert until(lambda: workers(router)["d-wrong"]["admission"] == "admitted")


def test_a_model_restarted_whole_on_other_weights_is_admitted_anew_and_checked_against_them():
    """Every worker of a model gone (stopped together, started on new weights under the same path): no worker admitted
    by the old reference is left, so the new first pair sets the reference instead of waiting forever to answer like
    the old weights (seen in e2e: a whole cluster restarted on other weights stayed 'awaiting its admission canary')."""
    decode = FakeWorker()
    fakes = {"p": FakeWorker(), "d": decode, "d-old": FakeWorker(canary_ids=[1, 2, 3])}
    with discovered(fakes, {"p": "prefill", "d": "decode"}) as (service, urls, router):
        assert httpx.get(f"{router}/ready").status_code == 200
        for worker_id in ("p", "d"):
            assert httpx.delete(f"{service}/v1/workers/{worker_id}").status_code == 200
        assert until(lambda: workers(router) == {}, timeout=30)  # once the registry is past its TTL
        decode.canary_ids = [9, 9, 9]  # the new weights
        register(service, "p", "prefill", urls["p"], instance="2")
        register(service, "d", "decode", urls["d"], instance="2")
        assert until(lambda: {w["admission"] for w in workers(router).values()} == {"admitted"})
        assert "first pair" in workers(router)["d"]["admission_note"]
        register(service, "d-old", "decode", urls["d-old"])  # still on the old weights: now the odd one out
        assert until(lambda: workers(router).get("d-old", {}).get("admission") == "refused")


def test_a_canary_that_cannot_run_is_tried_again():
    prefill, decode = FakeWorker(), FakeWorker(canary_failures=2)
    with ServerThread(prefill.app()) as p, ServerThread(decode.app()) as d:
        config = RouterConfig(bootstrap_url=None, prefill=[{"url": p.url, "kv_bootstrap_port": 8999}],
                              decode=[{"url": d.url}])
        with ServerThread(create_app(config)) as router:  # its start waits for the admissions (RETRY_AFTER each)
            assert until(lambda: httpx.get(f"{router.url}/ready").status_code == 200, timeout=20)
            assert decode.canaries == 3
            errors = sum(metric(router.url, "pdcluster_router_admissions_total", role=role, result="error")
                         for role in ("prefill", "decode"))
            assert errors == 2  # one for each of the pair's two new workers, as each tried it
            assert httpx.post(f"{router.url}/generate", json={"text": "x"}).status_code == 200


def test_a_canary_that_times_out_is_tried_again_and_admissions_go_on(monkeypatch):
    """A canary whose worker never answers (stopped mid-canary) ends at its deadline and is tried again. (In an e2e run
    a canary's asyncio.timeout, which the retry did not catch, ended the admission task for good: every later worker
    stayed 'awaiting its admission canary'. router/pd/admission.py now catches it and keeps the task alive.)"""
    monkeypatch.setattr(admission, "CANARY_TIMEOUT", 1.0)
    prefill, decode = FakeWorker(), FakeWorker(canary_stalls=1)
    with ServerThread(prefill.app()) as p, ServerThread(decode.app()) as d:
        config = RouterConfig(bootstrap_url=None, prefill=[{"url": p.url, "kv_bootstrap_port": 8999}],
                              decode=[{"url": d.url}])
        with ServerThread(create_app(config)) as router:
            assert until(lambda: httpx.get(f"{router.url}/ready").status_code == 200, timeout=30)
            assert decode.canaries == 2
            assert httpx.post(f"{router.url}/generate", json={"text": "x"}).status_code == 200


def test_without_the_check_workers_serve_at_once():
    prefill, decode = FakeWorker(Behaviour()), FakeWorker()
    with ServerThread(prefill.app()) as p, ServerThread(decode.app()) as d:
        config = RouterConfig(bootstrap_url=None, prefill=[{"url": p.url, "kv_bootstrap_port": 8999}],
                              decode=[{"url": d.url}], admission_check=False)
        with ServerThread(create_app(config)) as router:
            assert httpx.post(f"{router.url}/generate", json={"text": "x"}).status_code == 200
    assert decode.canaries == 0
