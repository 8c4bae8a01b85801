"""pdcluster/plugins/cpu_seeded_sampling: on a CPU, a request's seed decides its sampled tokens; SGLang's own samplers
run through the plugin's seeded sampler (the same tokens for the same seed and position, from the distribution asked
for); a batch's seeds survive its merges; min_p is still applied; the plugin patches exactly the SGLang functions it
was written for, once, and refuses changed ones."""

from __future__ import annotations

import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pdcluster.plugins import sglang_plugin
from pdcluster.plugins.cpu_seeded_sampling import internals
from pdcluster.worker.environment import _cpu_env

REPO = Path(__file__).resolve().parents[2]


def test_the_same_seed_and_position_give_the_same_token_and_others_follow_the_distribution():
    logprobs = torch.log(torch.tensor([[0.7, 0.2, 0.1, 0.0]] * 3000, dtype=torch.float32))
    positions = torch.arange(3000)
    first = internals.multinomial_with_seed(logprobs, torch.full((3000,), 7), positions)
    again = internals.multinomial_with_seed(logprobs, torch.full((3000,), 7), positions)
    other = internals.multinomial_with_seed(logprobs, torch.full((3000,), 8), positions)
    assert first.shape == (3000, 1) and torch.equal(first, again) and not torch.equal(first, other)
    shares = torch.bincount(first.view(-1), minlength=4) / 3000
    assert abs(shares[0] - 0.7) < 0.05 and abs(shares[1] - 0.2) < 0.05 and shares[3] == 0  # never a 0-probability


def test_a_rows_token_does_not_depend_on_the_rows_batched_with_it():
    logprobs = torch.log_softmax(torch.randn(4, 50), dim=-1)
    alone = internals.multinomial_with_seed(logprobs[2:3], torch.tensor([11]), torch.tensor([5]))
    batched = internals.multinomial_with_seed(logprobs, torch.tensor([1, 2, 11, 3]), torch.tensor([9, 9, 5, 9]))
    assert batched[2, 0] == alone[0, 0]


@pytest.fixture
def applied(monkeypatch):
    """The plugin applied to SGLang's own modules, undone after the test."""
    from sglang.srt.layers import sampler
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    for name in ("multinomial_with_seed", "top_k_top_p_min_p_sampling_from_probs_torch"):
        monkeypatch.setattr(sampler, name, getattr(sampler, name))
    monkeypatch.setattr(SamplingBatchInfo, "from_schedule_batch", SamplingBatchInfo.__dict__["from_schedule_batch"])
    monkeypatch.setattr(SamplingBatchInfo, "merge_batch", SamplingBatchInfo.merge_batch)
    patched = internals.apply()
    return sampler, SamplingBatchInfo, patched


def test_sglangs_samplers_sample_by_the_seed_once_applied_and_min_p_is_kept(applied):
    sampler, info_cls, patched = applied
    assert len(patched) == 4 and info_cls.merge_batch.pdcluster_wrapped is not None
    assert internals.apply() == []  # a forked child loading the plugins again
    probs = torch.softmax(torch.randn(2, 64), dim=-1)
    seeds, positions = torch.tensor([5, 6]), torch.tensor([3, 4])
    plain = [sampler.sampling_from_probs_torch(probs, seeds, positions) for _ in range(3)]
    assert all(torch.equal(plain[0], other) for other in plain)
    top_k, top_p, min_p = torch.tensor([10, 10]), torch.tensor([0.9, 0.9]), torch.tensor([0.5, 0.5])
    filtered = [sampler.top_k_top_p_min_p_sampling_from_probs_torch(probs, top_k, top_p, min_p, False, seeds, positions)
                for _ in range(3)]
    assert all(torch.equal(filtered[0], other) for other in filtered)
    # SGLang's seeded path asserts on min_p: the plugin applies it first, still by the seed
    before = probs.clone()
    only_top = sampler.top_k_top_p_min_p_sampling_from_probs_torch(probs, top_k, top_p, torch.tensor([1.0, 1.0]),
                                                                    True, seeds, positions)
    assert torch.equal(only_top.long(), probs.argmax(dim=-1)) and torch.equal(probs, before)  # theirs untouched
    wide = torch.softmax(torch.zeros(2, 64), dim=-1)  # every token as likely: min_p 0.5 keeps all
    by_min_p = [sampler.top_k_top_p_min_p_sampling_from_probs_torch(wide, torch.tensor([64, 64]), torch.tensor(
        [1.0, 1.0]), torch.tensor([0.5, 0.5]), True, seeds, positions) for _ in range(2)]
    unfiltered = sampler.top_k_top_p_min_p_sampling_from_probs_torch(wide, torch.tensor([64, 64]), torch.tensor(
        [1.0, 1.0]), torch.tensor([0.0, 0.0]), False, seeds, positions)
    assert torch.equal(by_min_p[0], by_min_p[1]) and torch.equal(by_min_p[0], unfiltered)


def request(seed: int | None) -> SimpleNamespace:
    return SimpleNamespace(sampling_params=SimpleNamespace(sampling_seed=seed))


class Info(SimpleNamespace):
    """What the wrappers read of SGLang's SamplingBatchInfo: its rows (len: its temperatures) and seeds."""

    def __len__(self) -> int:
        return len(self.temperatures)


def test_a_batch_with_a_seeded_request_carries_every_rows_seed():
    def unseeded(cls, batch, vocab_size):  # SGLang's without deterministic inference
        return Info(temperatures=torch.ones(len(batch.reqs)), sampling_seed=None)

    made = internals.seeding(unseeded)
    seeded = made(None, SimpleNamespace(reqs=[request(None), request(42)]), 64)
    assert seeded.sampling_seed.tolist()[1] == 42 and 0 <= seeded.sampling_seed.tolist()[0] < 2**63
    assert made(None, SimpleNamespace(reqs=[request(None)]), 64).sampling_seed is None  # as before


def test_merging_a_seeded_batch_with_an_unseeded_one_keeps_a_seed_per_row():
    merged = []

    def merge(self, other):  # SGLang's: concatenates seeds only when both sides have them
        merged.append((len(self.sampling_seed), len(other.sampling_seed)))

    internals.aligning(merge)(Info(temperatures=torch.ones(2), sampling_seed=torch.tensor([1, 2])),
                              Info(temperatures=torch.ones(3), sampling_seed=None))
    assert merged == [(2, 3)]


@pytest.mark.parametrize("name", ["merge_batch", "filter_batch"])
def test_a_changed_function_stops_the_worker_naming_it(monkeypatch, name):
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    def changed(self, *args):
        return None

    monkeypatch.setattr(SamplingBatchInfo, name, changed)
    with pytest.raises(sglang_plugin.IncompatibleSGLang, match=f"SamplingBatchInfo.{name} has changed"):
        internals.apply()


def test_the_launcher_turns_it_on_for_cpu_workers_and_sglang_is_told_of_it():
    from pdcluster.worker.settings import ClusterSettings

    assert _cpu_env(ClusterSettings(), {}, {})["PDCLUSTER_CPU_SEEDED_SAMPLING"] == "1"
    entry_points = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    assert entry_points["sglang.srt.plugins"]["pdcluster_cpu_seeded_sampling"] == (
        "pdcluster.plugins.cpu_seeded_sampling:register")


def test_off_without_its_variable(monkeypatch):
    from sglang.srt.layers import sampler

    from pdcluster.plugins.cpu_seeded_sampling import register

    before = sampler.multinomial_with_seed
    monkeypatch.delenv("PDCLUSTER_CPU_SEEDED_SAMPLING", raising=False)
    register()
    assert sampler.multinomial_with_seed is before
    assert 0 <= internals.row_seed(-1, 0) <= internals.MASK64  # SGLang allows negative seeds: a generator's seed
