"""The worker launcher shared by `prefill.py` and `decode.py`: config -> SGLang command -> supervised process. What
differs between the roles is in prefill/plan.py and decode/plan.py. It imports common/ and the KV store it wires into
SGLang (kvstore/), never the components that use it."""
