from router.fleet.workers import BreakerState, CircuitBreaker


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_opens_after_threshold_then_half_opens_then_closes_on_success():
    clock = Clock()
    breaker = CircuitBreaker(threshold=3, cooldown=10, clock=clock)
    for _ in range(2):
        breaker.on_failure()
    assert breaker.state is BreakerState.CLOSED and breaker.allows()
    breaker.on_failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allows()
    clock.now = 10
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allows()
    breaker.on_attempt()
    assert not breaker.allows()  # one trial at a time
    breaker.on_success()
    assert breaker.state is BreakerState.CLOSED and breaker.failures == 0


def test_a_failed_trial_reopens_at_once():
    clock = Clock()
    breaker = CircuitBreaker(threshold=2, cooldown=5, clock=clock)
    breaker.on_failure()
    breaker.on_failure()
    clock.now = 5
    breaker.on_attempt()
    breaker.on_failure()
    assert breaker.state is BreakerState.OPEN
    clock.now = 9.9
    assert not breaker.allows()


def half_open(clock: Clock) -> CircuitBreaker:
    breaker = CircuitBreaker(threshold=1, cooldown=5, clock=clock)
    breaker.on_failure()
    clock.now += 5
    assert breaker.state is BreakerState.HALF_OPEN
    return breaker


def test_a_trial_that_settles_nothing_frees_the_slot_for_the_next():
    """A trial ending in a 4xx, a client that left, a timeout, or the other half's failure proves nothing about the
    worker: the next request may be the trial (it used to stay out of rotation for ever)."""
    breaker = half_open(Clock())
    breaker.on_attempt()
    assert not breaker.allows()
    breaker.on_end()
    assert breaker.allows() and breaker.state is BreakerState.HALF_OPEN


def test_end_after_success_or_failure_changes_nothing():
    clock = Clock()
    breaker = half_open(clock)
    breaker.on_attempt()
    breaker.on_success()
    breaker.on_end()
    assert breaker.state is BreakerState.CLOSED
    breaker = half_open(clock)
    breaker.on_attempt()
    breaker.on_failure()
    breaker.on_end()
    assert breaker.state is BreakerState.OPEN and not breaker.allows()


def test_a_successful_probe_readmits_after_the_cooldown_only():
    clock = Clock()
    breaker = CircuitBreaker(threshold=1, cooldown=5, clock=clock)
    breaker.on_failure()
    breaker.on_probe_success()
    assert breaker.state is BreakerState.OPEN  # within the cooldown a probe is no trial
    clock.now = 5
    breaker.on_probe_success()
    assert breaker.state is BreakerState.CLOSED
