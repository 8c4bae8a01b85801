from router.breaker import BreakerState, CircuitBreaker


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
