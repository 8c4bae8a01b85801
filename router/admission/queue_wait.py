"""How long a new request would wait for a prefill: the tokens booked on the prefill's queue over the prefill's rate.

The booking is every policy's (router/pd/prefill_half.py books each prefill half until its answer): cache_aware books
what it predicts the prefill will compute (the prompt less what it holds), the other policies the router's estimate
of the prompt. The rate is the one capacity model's (pdcluster/common/capacity.py: a profile's rate for a queue of
unknown prompt lengths, its slowest measured) for the prefills of the profile's model, else `unmeasured_tokens_per_s`,
until the prefill is measured; then its own: an EWMA of tokens per second over its answered prefill halves. Before
MEASURED_AFTER answers the lower of the two stands (a wait predicted too long refuses a request early and it comes back
after Retry-After; one predicted too short lets the decode wait out SGLang's KV timeout).

A prefill half's service time runs from when it was sent, or from when the prefill's previous half ended if that was
later (the prefill was busy before it), to its answer. A sample is the work of one or more halves over their service
times, taken once those add up to SAMPLE_SECONDS: SGLang computes several prompts in one forward pass, and their
answers arrive milliseconds apart, so one half's work over its own few milliseconds read as tens of thousands of
tokens a second (bench.overload found the router admitting a 190 s queue as a 2 s one); summed, the work of a batch
counts over the time the batch took. A short prompt's time is mostly fixed costs, so its sample is low: the rate errs
on the slow side.
"""

from __future__ import annotations

from pdcluster.common.capacity import Profile
from router.config import AdmissionConfig
from router.fleet.workers import Worker

EWMA_WEIGHT = 0.3  # a new sample's weight
MEASURED_AFTER = 3  # samples before a prefill's own rate alone stands
SAMPLE_SECONDS = 0.5  # service time a sample spans at least: longer than the gap between one batch's answers


def record_prefill(worker: Worker, work_tokens: int, sent_at: float, done_at: float) -> None:
    """A prefill half that computed `work_tokens`, sent at `sent_at`, answered at `done_at` (monotonic seconds)."""
    started = max(sent_at, worker.prefill_busy_until)
    worker.prefill_busy_until = max(worker.prefill_busy_until, done_at)
    if work_tokens <= 0:
        return
    worker.prefill_unsampled_tokens += work_tokens
    worker.prefill_unsampled_seconds += max(0.0, done_at - started)
    if worker.prefill_unsampled_seconds < SAMPLE_SECONDS:
        return
    sample = worker.prefill_unsampled_tokens / worker.prefill_unsampled_seconds
    worker.prefill_unsampled_tokens, worker.prefill_unsampled_seconds = 0, 0.0
    measured = worker.prefill_rate_samples
    worker.prefill_rate = sample if not measured else EWMA_WEIGHT * sample + (1 - EWMA_WEIGHT) * worker.prefill_rate
    worker.prefill_rate_samples = measured + 1


class WaitModel:
    """Each prefill's rate and a queue's predicted wait on it (the module's docstring)."""

    def __init__(self, profile: Profile | None = None, unmeasured_tokens_per_s: float = 100.0):
        self.profile, self.unmeasured = profile, unmeasured_tokens_per_s

    @classmethod
    def from_config(cls, config: AdmissionConfig) -> WaitModel:
        return cls(Profile.load(config.profile) if config.profile else None, config.unmeasured_tokens_per_s)

    def prior_rate(self, worker: Worker) -> float:
        """Tokens/s before measurement: the profile's, if the worker serves its model (a static worker, whose model is
        not known, is taken to), else the configured one."""
        profile = self.profile
        if profile is not None and (worker.identity is None or worker.identity.served_model_name == profile.model):
            return 1.0 / profile.queue_wait_seconds(1.0)  # the profile's rate for a queue of unknown lengths
        return self.unmeasured

    def rate(self, worker: Worker) -> float:
        """The tokens/s the worker's queue is predicted to drain at."""
        if worker.prefill_rate_samples >= MEASURED_AFTER:
            return worker.prefill_rate
        prior = self.prior_rate(worker)
        return min(prior, worker.prefill_rate) if worker.prefill_rate_samples else prior

    def wait(self, worker: Worker, extra_tokens: float = 0.0) -> float:
        """Seconds a new prompt waits behind what is booked on `worker`, and `extra_tokens` more."""
        return max(0.0, worker.pending_work_tokens + extra_tokens) / self.rate(worker)
