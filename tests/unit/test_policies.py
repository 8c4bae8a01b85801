"""Each policy's choice on a known sequence."""

from pdcluster.protocol import Role
from router.policies import REGISTRY, RequestHint, make_policy
from router.workers import Worker

NO_HINT = RequestHint()


def workers(*loads: int) -> list[Worker]:
    return [Worker(f"w{i}", Role.PREFILL, f"http://w{i}", "h", 9000 + i, in_flight=load)
            for i, load in enumerate(loads)]


def ids(chosen: list[Worker]) -> list[str]:
    return [w.worker_id for w in chosen]


def test_registry_names():
    assert sorted(REGISTRY) == ["power_of_two", "prefix", "random", "round_robin"]


def test_round_robin_cycles_in_order():
    pool, policy = workers(0, 0, 0), make_policy("round_robin")
    assert ids([policy.choose(pool, NO_HINT) for _ in range(7)]) == ["w0", "w1", "w2", "w0", "w1", "w2", "w0"]


def test_random_is_reproducible_with_a_seed_and_uses_every_worker():
    from router.policies.random_choice import RandomChoice

    pool = workers(0, 0, 0)
    a, b = RandomChoice(seed=7), RandomChoice(seed=7)
    assert ids([a.choose(pool, NO_HINT) for _ in range(10)]) == ids([b.choose(pool, NO_HINT) for _ in range(10)])
    policy = RandomChoice(seed=1)
    assert set(ids([policy.choose(pool, NO_HINT) for _ in range(50)])) == {"w0", "w1", "w2"}


def test_power_of_two_never_picks_the_busier_of_its_two_samples():
    pool, policy = workers(5, 0, 9), make_policy("power_of_two")
    picks = ids([policy.choose(pool, NO_HINT) for _ in range(100)])
    assert "w2" not in picks  # the busiest loses every pairing it is sampled into
    assert set(picks) == {"w0", "w1"}
    assert ids([policy.choose(workers(3), NO_HINT)]) == ["w0"]


def test_prefix_sends_a_shared_prefix_to_one_worker_and_falls_back_to_load():
    policy = make_policy("prefix")
    pool = workers(0, 0, 0)
    system = "You are a helpful assistant. " * 20
    first = policy.choose(pool, RequestHint(system + "Question one?"))
    for question in ("Question two?", "Something else entirely", "3"):
        pool[0].in_flight, pool[1].in_flight, pool[2].in_flight = 1, 1, 1
        assert policy.choose(pool, RequestHint(system + question)) is first
    # A different prompt goes to the least loaded worker.
    first.in_flight = 3
    other = policy.choose(pool, RequestHint("Completely different text " * 10))
    assert other is not first
    # The owner overloaded: load wins over affinity.
    first.in_flight = 10
    assert policy.choose(pool, RequestHint(system + "Question four?")) is not first
