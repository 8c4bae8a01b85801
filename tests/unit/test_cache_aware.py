"""The cache_aware policy: the prefill holding the prompt's prefix wins, unless its queue costs more than the hit
saves; blind (no events) it routes as round robin, and without token ids as the text prefix policy does."""

from __future__ import annotations

from pdcluster.common.protocol import ModelIdentity, Role
from router.checks.checked import Checked
from router.fleet.workers import Worker, WorkerPool
from router.kv_routing.cache_aware import CacheAware
from router.kv_routing.kv_routed import RoutedPrompts
from router.kv_routing.kv_wire import Stored
from router.metrics import RouterMetrics
from router.pd.policies import make_policy
from router.routing.policy import Choice, RoutingView

PAGE = 4
IDENTITY = ModelIdentity(model_path="m", served_model_name="m", page_size=PAGE, kv_cache_dtype="auto",
                         transfer_backend="mooncake")
PROMPT = list(range(1, 401))  # 100 pages


def prefills(n: int = 3) -> list[Worker]:
    return [Worker(f"p{i}", Role.PREFILL, f"http://p{i}", "h", 9000 + i, identity=IDENTITY) for i in range(n)]


DECODE = Worker("d0", Role.DECODE, "http://d0", identity=IDENTITY)


def request(ids: list[int] | None = None, text: str = "hello") -> RoutingView:
    """What the policy reads of a /generate of `ids` (given as token ids), or else of `text`."""
    checked = (Checked(None, False, ids, token_ids="input_ids", prompts=(ids,)) if ids is not None
               else Checked(None, False, text))
    return RoutingView("/generate", {}, checked)


def choose(policy: CacheAware, workers: list[Worker], view: RoutingView) -> Choice:
    """The policy's choice as the prefill policy, of a prefill among `workers` for DECODE."""
    choice = policy.choose_prefill(DECODE, workers, view)
    assert choice.decode is DECODE
    return choice


def policy_holding(held: dict[str, int]) -> CacheAware:
    """Each worker of `held` indexed, holding that many leading tokens of PROMPT."""
    policy = make_policy("cache_aware")
    assert isinstance(policy, CacheAware)
    policy.metrics = RouterMetrics(WorkerPool())
    policy.routed = RoutedPrompts(ttl=0)  # the index alone: what was routed is forgotten at once
    for worker_id, tokens in held.items():
        index = policy.index.open(worker_id, PAGE)
        pages = tokens // PAGE
        if pages:
            index.apply(Stored(tuple(range(1, pages + 1)), None, tuple(PROMPT[:tokens]), PAGE, "GPU"))
    return policy


def decisions(policy: CacheAware, kind: str) -> float:
    assert policy.metrics is not None
    return policy.metrics.registry.get_sample_value("pdcluster_router_routing_decisions_total", {"kind": kind}) or 0


def test_the_holder_of_the_longest_prefix_wins():
    workers = prefills()
    policy = policy_holding({"p0": 40, "p1": 320, "p2": 0})
    for _ in range(5):
        choice = choose(policy, workers, request([*PROMPT, 7, 7]))
        assert choice.prefill.worker_id == "p1" and choice.predicted_cached == 320
    assert decisions(policy, "indexed") == 5


def test_load_outweighs_a_small_hit_not_a_large_one():
    workers = prefills(2)
    policy = policy_holding({"p0": 16, "p1": 0})
    workers[0].pending_work_tokens, workers[0].in_flight = 2000, 2  # a queue far longer than the 16 tokens saved
    assert choose(policy, workers, request(PROMPT)).prefill.worker_id == "p1"
    policy = policy_holding({"p0": 400, "p1": 0})
    workers[0].pending_work_tokens = 100  # a short queue: the whole prompt cached is worth it
    assert choose(policy, workers, request(PROMPT)).prefill.worker_id == "p0"


def test_queued_repeats_of_a_held_prompt_are_short_work_not_their_whole_prompts():
    """Its queue costs what it will compute: three repeats of the prompt it holds queued on p0 (each 400 tokens, all
    but a few held) still leave it the cheapest place for a fourth."""
    workers = prefills(2)
    policy = policy_holding({"p0": 400, "p1": 0})
    workers[0].pending_prompt_tokens, workers[0].pending_work_tokens, workers[0].in_flight = 1200, 3 * 8, 3
    assert choose(policy, workers, request(PROMPT)).prefill.worker_id == "p0"


def test_a_burst_sharing_a_new_prefix_goes_where_its_first_went_before_any_event_tells():
    """The prefill publishes a prompt's pages once it computed them: until then, what this router sent it counts."""
    workers = prefills(2)
    policy = policy_holding({"p0": 8, "p1": 8})  # both heard of, neither holds the new prompt
    policy.routed = RoutedPrompts()
    new = list(range(1000, 1400))
    first = choose(policy, workers, request(new)).prefill
    first.pending_work_tokens, first.in_flight = 400, 1  # its prefill half is queued there
    for suffix in range(3):
        follower = choose(policy, workers, request([*new[:384], *range(2000 + suffix * 16, 2016 + suffix * 16)]))
        assert follower.prefill is first and follower.predicted_cached == 384


def test_the_chosen_prefill_is_booked_with_what_it_will_compute_by_the_ids_not_the_estimate():
    """The router's estimate of a prompt's tokens is an upper bound (~3x for English text): weighing queues by it made
    a queued request of ~760 tokens look like 2500, and every tenant ended up on both prefills."""
    workers = prefills(2)
    policy = policy_holding({"p0": 400, "p1": 0})
    single = choose(policy, workers, RoutingView("/generate", {}, Checked(
        None, False, PROMPT, token_ids="input_ids", prompts=(PROMPT,), prompt_tokens=1300)))
    assert single.prefill.worker_id == "p0"
    assert single.predicted_cached == 396 and single.prefill_work == 400 - 396
    batch = choose(policy, workers, RoutingView("/generate", {}, Checked(
        2, False, PROMPT, token_ids="input_ids", prompts=(PROMPT, PROMPT), prompt_tokens=1300)))
    # its ids are its first prompt's: the estimate stands for the rest
    assert batch.predicted_cached is None and batch.prefill_work == 1300 - 396


def test_blind_it_routes_as_round_robin_and_without_token_ids_by_the_prompts_text():
    workers = prefills()
    policy = policy_holding({})  # no worker publishes: perhaps none caches; the cluster's old default
    text = "You are a helpful assistant. " * 20
    assert {choose(policy, workers, request(text=text + q)).prefill.worker_id for q in ("1?", "2?", "3?")} == {
        "p0", "p1", "p2"}
    assert decisions(policy, "blind") == 3
    for worker in workers:  # subscribed, but nothing heard yet (or a port the router cannot reach): still blind
        policy.index.open(worker.worker_id, PAGE)
    assert {choose(policy, workers, request(PROMPT)).prefill.worker_id for _ in range(3)} == {"p0", "p1", "p2"}
    assert decisions(policy, "blind") == 6
    policy = policy_holding({"p0": 40})  # indexed workers, but no tokenizer loaded for model "m"
    first = choose(policy, workers, request(text=text + "one?")).prefill
    assert all(choose(policy, workers, request(text=text + q)).prefill is first for q in ("two?", "three?"))
    assert decisions(policy, "no_tokens") == 3


def test_the_prediction_is_what_sglang_reuses_and_rides_on_the_choice():
    workers = prefills(2)
    policy = policy_holding({"p0": 400, "p1": 0})  # all of PROMPT's pages
    whole = choose(policy, workers, request(PROMPT))
    assert whole.prefill.worker_id == "p0"
    assert whole.predicted_cached == 396  # SGLang computes at least the last token: the last page is recomputed
    batch = choose(policy, workers, RoutingView("/generate", {}, Checked(2, False, PROMPT, token_ids="input_ids",
                                                                         prompts=(PROMPT, [1]))))
    assert batch.prefill.worker_id == "p0"
    assert batch.predicted_cached is None  # its answer counts both prompts' cached tokens: nothing to compare


def test_one_candidate_is_no_choice_nothing_is_tokenized_or_counted():
    policy, only = policy_holding({"p0": 400}), prefills(1)
    one = choose(policy, only, request(PROMPT))
    assert one.prefill is only[0] and one.predicted_cached is None and one.prefill_work is None
    assert decisions(policy, "indexed") == decisions(policy, "blind") == 0


def test_a_worker_without_events_beside_indexed_ones_is_routed_by_load():
    workers = prefills(2)
    policy = policy_holding({"p0": 8})
    workers[0].pending_work_tokens = 5000
    assert choose(policy, workers, request(PROMPT)).prefill.worker_id == "p1"  # p1: blind, idle
