"""The decode role: an SGLang server started with --disaggregation-mode decode, supervised by pdcluster's launcher
(pdcluster/worker/). What only a decode decides about its launch is in plan.py."""
