"""The PD core: a checked request (`request`) paired with a prefill and a decode (`pairing`, with `kv_fit` for a prompt
no decode holds), one attempt on the pair with its one owner (`attempt`), what a failed half means (`failures`), the
prefill's logprobs merged into the decode's answer (`logprobs`), and the canary that admits a new worker
(`admission`)."""
