"""The SLO planner: sizes prefill and decode to the load from one capacity model (pdcluster/common/capacity.py).

Its config (config.py), the load predictors (predict.py), the pure sizing core (sizing.py), the live planner
(`python -m planner`: __main__.py, live.py; its inputs scrape.py and fleet.py, its metrics exported.py), the profiler
that measures this machine's model into a profile (profile.py, measurements.py) and the simulator its gym runs on
(simulator.py, sim_workers.py, sim_policies.py). It imports pdcluster and no other component, and none
imports it.
"""
