"""The worker launcher shared by `prefill.py` and `decode.py`: config -> SGLang command -> supervised process."""
