"""Each policy's choice on a known sequence, the one registry that names them (and the config that accepts those
names only), and pairing: the stages before a policy's pick, and its hooks."""

import pytest
from pydantic import ValidationError

from pdcluster.common.http import ApiError
from pdcluster.common.protocol import ModelIdentity, Role, WorkerRegistration, WorkerStatus
from router.__main__ import main as router_main
from router.checks.checked import Checked
from router.config import RouterConfig
from router.fleet.workers import CircuitBreaker, Worker, WorkerPool
from router.pd.pairing import Pairing
from router.pd.policies import REGISTRY, make_policy
from router.pd.request import PdRequest
from router.routing.policy import Choice, RoutingView


def prompt(text: str) -> RoutingView:
    """What a policy reads of a /generate of `text`."""
    return RoutingView("/generate", {"text": text}, Checked(None, False, text))


NO_PROMPT = prompt("")
UNKNOWN = "unknown policy 'fastest'; known: cache_aware, power_of_two, prefix, random, round_robin"


def workers(*loads: int) -> list[Worker]:
    return [Worker(f"w{i}", Role.PREFILL, f"http://w{i}", "h", 9000 + i, in_flight=load)
            for i, load in enumerate(loads)]


def ids(chosen: list[Worker]) -> list[str]:
    return [w.worker_id for w in chosen]


def test_registry_names():
    assert sorted(REGISTRY) == ["cache_aware", "power_of_two", "prefix", "random", "round_robin"]
    assert all(make_policy(name).name == name for name in REGISTRY)


def test_the_config_accepts_the_names_of_the_policies_there_are_and_refuses_others_clearly(tmp_path, capsys):
    known = {"policies": REGISTRY}  # as the router's command passes them (router/__main__.py)
    for name in REGISTRY:
        assert RouterConfig.model_validate({"prefill_policy": name, "decode_policy": name}, context=known)
    for field in ("prefill_policy", "decode_policy"):
        with pytest.raises(ValidationError, match=UNKNOWN) as refused:
            RouterConfig.model_validate({field: "fastest"}, context=known)
        assert refused.value.errors()[0]["loc"] == (field,)
    bad = tmp_path / "router.yaml"
    bad.write_text("prefill_policy: fastest\n")
    with pytest.raises(SystemExit) as exited:
        router_main(["--config", str(bad), "--dry-run"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"router: error: {bad}: prefill_policy: Value error, {UNKNOWN}\n"
    # A config made in code is not checked against the registry: the app refuses the name when it makes the policy.
    with pytest.raises(ValueError, match=UNKNOWN):
        make_policy(RouterConfig(prefill_policy="fastest").prefill_policy)


def test_round_robin_cycles_in_order():
    pool, policy = workers(0, 0, 0), make_policy("round_robin")
    assert ids([policy.choose(pool, NO_PROMPT) for _ in range(7)]) == ["w0", "w1", "w2", "w0", "w1", "w2", "w0"]


def test_random_is_reproducible_with_a_seed_and_uses_every_worker():
    from router.routing.policy import RandomChoice

    pool = workers(0, 0, 0)
    a, b = RandomChoice(seed=7), RandomChoice(seed=7)
    assert ids([a.choose(pool, NO_PROMPT) for _ in range(10)]) == ids([b.choose(pool, NO_PROMPT) for _ in range(10)])
    policy = RandomChoice(seed=1)
    assert set(ids([policy.choose(pool, NO_PROMPT) for _ in range(50)])) == {"w0", "w1", "w2"}


def test_power_of_two_never_picks_the_busier_of_its_two_samples():
    pool, policy = workers(5, 0, 9), make_policy("power_of_two")
    picks = ids([policy.choose(pool, NO_PROMPT) for _ in range(100)])
    assert "w2" not in picks  # the busiest loses every pairing it is sampled into
    assert set(picks) == {"w0", "w1"}
    assert ids([policy.choose(workers(3), NO_PROMPT)]) == ["w0"]


def test_prefix_sends_a_shared_prefix_to_one_worker_and_falls_back_to_load():
    policy = make_policy("prefix")
    pool = workers(0, 0, 0)
    system = "You are a helpful assistant. " * 20
    first = policy.choose(pool, prompt(system + "Question one?"))
    for question in ("Question two?", "Something else entirely", "3"):
        pool[0].in_flight, pool[1].in_flight, pool[2].in_flight = 1, 1, 1
        assert policy.choose(pool, prompt(system + question)) is first
    # A different prompt goes to the least loaded worker.
    first.in_flight = 3
    other = policy.choose(pool, prompt("Completely different text " * 10))
    assert other is not first
    # The owner overloaded: load wins over affinity.
    first.in_flight = 10
    assert policy.choose(pool, prompt(system + "Question four?")) is not first


# ----- pairing -----

def identity(model: str) -> ModelIdentity:
    return ModelIdentity(model_path=model, served_model_name=model, page_size=1, kv_cache_dtype="auto",
                         transfer_backend="mooncake")


def pool_of(*workers: Worker) -> WorkerPool:
    pool = WorkerPool()
    for worker in workers:
        pool.workers[worker.worker_id] = worker
    return pool


def request(prompt: object = "hi", tried: set[str] = frozenset()) -> PdRequest:
    r = PdRequest("/generate", "req", {"text": prompt}, Checked(None, False, prompt), 0.0, 60.0)
    r.tried.update(tried)
    return r


def pair(pairing: Pairing, r: PdRequest) -> tuple[Worker, Worker]:
    """(prefill, decode) of pairing's choice for the request, as its view shows it to the policies."""
    choice = pairing.choose(r, RoutingView(r.route, r.body, r.checked))
    assert isinstance(choice, Choice) and choice.predicted_cached is None and choice.prefill_work is None
    return choice.prefill, choice.decode


def test_pairing_skips_tried_workers_until_none_is_left_and_pairs_only_compatible_halves():
    a, b = identity("a"), identity("b")
    p_a, p_b = Worker("pa", Role.PREFILL, "http://pa", identity=a), Worker("pb", Role.PREFILL, "http://pb", identity=b)
    d_b = Worker("db", Role.DECODE, "http://db", identity=b)
    pairing = Pairing(pool_of(p_a, p_b, d_b), make_policy("round_robin"), make_policy("round_robin"))
    assert [pair(pairing, request()) for _ in range(3)] == [(p_b, d_b)] * 3  # pa can't send KV to db
    assert pair(pairing, request(tried={"db"})) == (p_b, d_b)  # every decode tried: tried ones serve again
    p_b.probe_healthy = False
    with pytest.raises(ApiError, match="no prefill is compatible with any decode"):
        pair(pairing, request())
    d_b.breaker = CircuitBreaker(threshold=1)
    d_b.breaker.on_failure()
    with pytest.raises(ApiError, match="1 prefill and 0 decode workers available"):
        pair(pairing, request())


def test_only_a_policy_that_reads_the_prompt_makes_it_into_text():
    unserializable = object()  # were the prompt made into text, orjson would raise
    prefill, decode = Worker("p", Role.PREFILL, "http://p"), Worker("d", Role.DECODE, "http://d")
    round_robin = Pairing(pool_of(prefill, decode), make_policy("round_robin"), make_policy("round_robin"))
    assert pair(round_robin, request(unserializable)) == (prefill, decode)
    prefix = Pairing(pool_of(prefill, decode), make_policy("round_robin"), make_policy("prefix"))
    with pytest.raises(TypeError):
        pair(prefix, request(unserializable))


def test_prefix_forgets_a_worker_that_left_the_pool():
    policy = make_policy("prefix")
    gone, staying = workers(0, 0)
    policy.choose([gone], prompt("You are a helpful assistant. " * 20))
    policy.choose([staying], prompt("Another prompt entirely, long enough to be remembered. " * 5))
    assert set(policy._owner.values()) == {gone.worker_id, staying.worker_id}
    policy.worker_removed(gone.worker_id)
    assert set(policy._owner.values()) == {staying.worker_id}


def test_the_pool_tells_the_policies_of_a_removed_worker():
    removed = []
    pool = WorkerPool()
    pairing = Pairing(pool, make_policy("round_robin"), make_policy("round_robin"))
    pairing.decode_policy.worker_removed = removed.append
    registration = WorkerRegistration(worker_id="d1", role=Role.DECODE, url="http://10.0.0.2:30000",
                                      identity=identity("m"))
    pool.sync_discovered([WorkerStatus(registration=registration, healthy=True, registered_at=0, last_heartbeat=0)])
    pool.sync_discovered([])
    assert removed == ["d1"] and not pool.workers
