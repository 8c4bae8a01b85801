"""Models by name (router/pd/pairing.py): an OpenAI request's `model` picks the pool of the workers that serve it (by
served name or path); a name none serves is a 404 model_not_found; native /generate and static workers are as before."""

from __future__ import annotations

import time

import orjson
import pytest

from pdcluster.common.http import ApiError, error_body
from pdcluster.common.protocol import ModelIdentity, Role
from router.checks.validation import check_completion, check_generate
from router.fleet.workers import Worker, WorkerPool
from router.pd.pairing import Pairing
from router.pd.request import PdRequest
from router.routing.policy import RoundRobin, RoutingView


def worker(worker_id: str, role: Role, model: str | None) -> Worker:
    identity = None if model is None else ModelIdentity(
        model_path=f"/models/{model}", served_model_name=model, page_size=1, kv_cache_dtype="auto",
        transfer_backend="mooncake")
    return Worker(worker_id, role, f"http://{worker_id}", "h" if role is Role.PREFILL else None,
                  1 if role is Role.PREFILL else None, identity=identity)


def pairing_of(*workers: Worker) -> Pairing:
    return Pairing(WorkerPool(workers={w.worker_id: w for w in workers}, admission_check=False), RoundRobin(),
                   RoundRobin())


def request(route: str, body: dict) -> PdRequest:
    check = check_generate if route == "/generate" else check_completion
    return PdRequest(route, "r", body, check(body), time.monotonic(), 60)


def choose(pairing: Pairing, req: PdRequest) -> tuple[str, str]:
    choice = pairing.choose(req, RoutingView(req.route, req.body, req.checked))
    return choice.prefill.worker_id, choice.decode.worker_id


def test_the_model_a_request_names_picks_its_pool():
    pairing = pairing_of(worker("pa", Role.PREFILL, "a"), worker("da", Role.DECODE, "a"),
                         worker("pb", Role.PREFILL, "b"), worker("db", Role.DECODE, "b"))
    for _ in range(3):  # round robin would alternate: the name holds it to b's pair
        assert choose(pairing, request("/v1/completions", {"model": "b", "prompt": "hi"})) == ("pb", "db")
    assert choose(pairing, request("/v1/completions", {"model": "/models/a", "prompt": "hi"})) == ("pa", "da")
    served = {choose(pairing, request("/generate", {"text": "hi"})) for _ in range(4)}  # no name: any pair
    assert served == {("pa", "da"), ("pb", "db")}


def test_a_model_no_worker_serves_is_a_404_model_not_found():
    pairing = pairing_of(worker("pa", Role.PREFILL, "a"), worker("da", Role.DECODE, "a"))
    with pytest.raises(ApiError) as refused:
        choose(pairing, request("/v1/completions", {"model": "gpt-4o", "prompt": "hi"}))
    error = error_body(refused.value.status, refused.value.message, refused.value.param, refused.value.kind)["error"]
    assert (refused.value.status, error["type"], error["param"]) == (404, "model_not_found", "model")
    assert "'gpt-4o' is not served here" in orjson.dumps(error).decode()


def test_a_static_worker_serves_any_name():
    pairing = pairing_of(worker("p", Role.PREFILL, None), worker("d", Role.DECODE, None))
    assert choose(pairing, request("/v1/completions", {"model": "anything", "prompt": "hi"})) == ("p", "d")
