"""The live planner's own Prometheus metrics (python -m planner serves them on its port): each decision's inputs,
verdict and reason, the flips it asked for, and the pool size a Kubernetes autoscaler (KEDA, or an HPA on external
metrics) can scale a worker Deployment to. One registry per planner, so tests can run several in one process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, generate_latest

from planner.sizing import Decision, Split

ROLES = ("prefill", "decode")
FLIP_RESULTS = ("accepted", "refused", "done", "failed")


class PlannerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.desired = Gauge("pdcluster_planner_desired_workers", "The split the last decision wants, per role (of "
                             "the workers there are)", ["role"], registry=r)
        self.observed = Gauge("pdcluster_planner_observed_workers", "Workers per role in the registry (a switching "
                              "one counts as its new role)", ["role"], registry=r)
        self.needed = Gauge("pdcluster_planner_needed_workers", "Workers per role the predicted load needs at the "
                            "SLOs, at least 1 (what a per-role autoscaler scales to)", ["role"], registry=r)
        self.pool = Gauge("pdcluster_planner_desired_pool_size", "Workers the predicted load needs, both roles "
                          "together", registry=r)
        self.pool_workers = Gauge("pdcluster_planner_desired_pool_workers", "Switch-enabled workers the predicted "
                                  "load needs beyond the serving ones that cannot flip (what a role-flexible pool's "
                                  "autoscaler scales its Deployment to)", registry=r)
        self.predicted = Gauge("pdcluster_planner_predicted", "The next interval's predicted load: requests_per_s, "
                               "prompt_tokens and answer_tokens (means per request)", ["quantity"], registry=r)
        self.attainment = Gauge("pdcluster_planner_attainment", "The last interval's share of judged requests "
                                "within the SLO's bound (-1: none judged)", ["slo"], registry=r)
        self.correction = Gauge("pdcluster_planner_correction", "The SLO correction on each role's need", ["role"],
                                registry=r)
        self.decisions = Counter("pdcluster_planner_decisions", "Decisions, by verdict (hold, change)", ["verdict"],
                                 registry=r)
        self.reason = Info("pdcluster_planner_decision", "The last decision: its verdict and reason (one log line "
                           "per decision says the same with its inputs)", registry=r)
        self.flips = Counter("pdcluster_planner_flips", "Flips asked of the bootstrap service, by result (accepted; "
                             "refused: its 409 or an error; done, failed: as the registry reported)", ["result"],
                             registry=r)
        for role in ROLES:
            self.desired.labels(role)
            self.observed.labels(role)
        for result in FLIP_RESULTS:
            self.flips.labels(result)
        for verdict in ("hold", "change"):
            self.decisions.labels(verdict)

    def export(self, decision: Decision, observed: Split, needed: Split, fixed: Split, reason: str) -> None:
        """One decision's numbers (`needed`: sizing.pool_size's; `fixed`: the serving workers that cannot flip, per
        role); `reason` the decision's, with what act did."""
        for role, desired, have, need, correction in (
                ("prefill", decision.desired.prefill, observed.prefill, needed.prefill, decision.corrections[0]),
                ("decode", decision.desired.decode, observed.decode, needed.decode, decision.corrections[1])):
            self.desired.labels(role).set(desired)
            self.observed.labels(role).set(have)
            self.needed.labels(role).set(need)
            self.correction.labels(role).set(correction)
        self.pool.set(needed.workers)
        # Per role: fixed prefills beyond the prefill need do not stand in for missing decodes.
        self.pool_workers.set(max(0, needed.prefill - fixed.prefill) + max(0, needed.decode - fixed.decode))
        load = decision.predicted
        for quantity, value in (("requests_per_s", load.requests_per_s), ("prompt_tokens", load.prompt_tokens),
                                ("answer_tokens", load.answer_tokens)):
            self.predicted.labels(quantity).set(value)
        seen = decision.observed
        for slo in ("ttft", "itl"):
            share = None if seen is None else getattr(seen, f"{slo}_attainment")
            self.attainment.labels(slo).set(-1 if share is None else share)
        verdict = "change" if decision.changes else "hold"
        self.decisions.labels(verdict).inc()
        self.reason.info({"verdict": verdict, "desired": str(decision.desired), "reason": reason})

    def render(self) -> bytes:
        return generate_latest(self.registry)
