"""The planner gym (`make bench-planner`): traces replayed on the planner's simulator (planner/simulator.py) for every
static split, the planner and an oracle, at several fleet sizes, scored in SLO goodput per worker per second. No
cluster: the simulator runs on the committed capacity profile (configs/profiles/)."""
