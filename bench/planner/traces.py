"""The gym's traces, seeded, each sized to the fleet: a request mix (prompt and answer lengths, lognormal around a
median and clipped to a range the profile measured) arriving as a Poisson process at a rate that is `load` of what
the fleet could serve of that mix at its best split, by the profile's throughput alone (no queueing):
    capacity = workers / (prefill seconds of the prompt + answer tokens x ITL(b*) / b*) requests per second,
b* the largest decode batch within the ITL bound. At load 0.75 a well-split fleet meets its SLOs with room for
randomness; a badly split one overloads one role.

- shifting: a prompt-heavy hour (documents: long prompts, short answers), an answer-heavy hour (chat: short prompts,
  long answers), and the prompt-heavy hour again;
- bursts: the steady mix at half load, and every 20 minutes a 4-minute burst of prompt-heavy requests on top;
- steady: two hours of one mix in between the two.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from pdcluster.common.capacity import Profile
from planner.simulator import Phase, Trace

HOUR = 3600.0


@dataclass(frozen=True)
class Mix:
    name: str
    prompt: tuple[int, int, int]  # median, lowest, highest
    answer: tuple[int, int, int]

    def draw(self, rng: random.Random) -> tuple[int, int]:
        return _lognormal(rng, *self.prompt), _lognormal(rng, *self.answer)


def _lognormal(rng: random.Random, median: int, lo: int, hi: int, sigma: float = 0.5) -> int:
    return int(min(hi, max(lo, round(median * math.exp(rng.gauss(0.0, sigma))))))


def mixes(profile: Profile) -> dict[str, Mix]:
    """The three mixes, their prompts within the prompt lengths the profile measured."""
    longest = max(p.prompt_tokens for p in profile.prefill)
    return {
        "prompt-heavy": Mix("prompt-heavy", (longest // 2, longest // 8, longest), (16, 4, 64)),
        "answer-heavy": Mix("answer-heavy", (128, 32, 512), (256, 64, 512)),
        "steady": Mix("steady", (longest // 4, 64, longest), (96, 16, 256)),
    }


def seconds_per_request(profile: Profile, mix: Mix, itl_bound: float, samples: int = 4000) -> float:
    """Worker-seconds one request of `mix` takes at the best split: its prefill alone, plus its share of a decode
    batched up to the ITL bound (the mean over draws, so that the lognormal tails count)."""
    rng = random.Random(7)
    total = 0.0
    for _ in range(samples):
        prompt, answer = mix.draw(rng)
        context = prompt + answer / 2
        batch = max(1, profile.max_decode_batch(itl_bound, context, prompt + answer))
        total += profile.prefill_seconds(prompt) + (answer - 1) * profile.decode_itl(batch, context) / batch
    return total / samples


def _arrivals(rng: random.Random, mix: Mix, rate: float, start: float, end: float) -> list[tuple[float, int, int]]:
    out, t = [], start
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= end:
            return out
        out.append((t, *mix.draw(rng)))
    return out


def _rate(profile: Profile, mix: Mix, workers: int, load: float, itl_bound: float) -> float:
    return load * workers / seconds_per_request(profile, mix, itl_bound)


def shifting(profile: Profile, workers: int, itl_bound: float, seed: int, load: float = 0.75,
             hour: float = HOUR) -> Trace:
    rng, m = random.Random(seed), mixes(profile)
    plan = [("prompt-heavy 1", m["prompt-heavy"]), ("answer-heavy", m["answer-heavy"]),
            ("prompt-heavy 2", m["prompt-heavy"])]
    requests, phases = [], []
    for i, (name, mix) in enumerate(plan):
        start, end = i * hour, (i + 1) * hour
        requests += _arrivals(rng, mix, _rate(profile, mix, workers, load, itl_bound), start, end)
        phases.append(Phase(name, start, end))
    return Trace("shifting", tuple(requests), len(plan) * hour, tuple(phases))


def bursts(profile: Profile, workers: int, itl_bound: float, seed: int, load: float = 0.5,
           burst_load: float = 0.5, hour: float = HOUR) -> Trace:
    rng, m = random.Random(seed), mixes(profile)
    every, lasting = hour / 3, hour / 15  # 20 and 4 minutes
    base = _arrivals(rng, m["steady"], _rate(profile, m["steady"], workers, load, itl_bound), 0.0, hour)
    extra, phases, start = [], [], 0.0
    for k in range(3):
        burst = k * every + every / 2
        extra += _arrivals(rng, m["prompt-heavy"], _rate(profile, m["prompt-heavy"], workers, burst_load, itl_bound),
                           burst, burst + lasting)
        phases += [Phase(f"base {k + 1}", start, burst), Phase(f"burst {k + 1}", burst, burst + lasting)]
        start = burst + lasting
    phases.append(Phase("base 4", start, hour))
    return Trace("bursts", tuple(sorted(base + extra)), hour, tuple(phases))


def steady(profile: Profile, workers: int, itl_bound: float, seed: int, load: float = 0.75,
           hour: float = HOUR) -> Trace:
    rng, mix = random.Random(seed), mixes(profile)["steady"]
    requests = _arrivals(rng, mix, _rate(profile, mix, workers, load, itl_bound), 0.0, 2 * hour)
    return Trace("steady", tuple(requests), 2 * hour, (Phase("steady", 0.0, 2 * hour),))


TRACES = {"shifting": shifting, "bursts": bursts, "steady": steady}
