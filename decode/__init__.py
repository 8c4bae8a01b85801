"""The decode role: an SGLang server started with --disaggregation-mode decode, supervised by pdcluster's launcher."""
