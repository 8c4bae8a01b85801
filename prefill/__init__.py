"""The prefill role: an SGLang server started with --disaggregation-mode prefill, supervised by pdcluster's launcher."""
