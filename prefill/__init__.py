"""The prefill role: an SGLang server started with --disaggregation-mode prefill, supervised by pdcluster's launcher
(pdcluster/worker/). What only a prefill decides about its launch is in plan.py."""
