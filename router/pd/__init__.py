"""The PD core: a checked request (`request`) paired with a prefill and a decode (`pairing`, with `kv_fit` for a prompt
no decode holds) by the policies the config names (`policies`, the one registry), one attempt on the pair with its one
owner (`attempt`, with the prefill's half: `prefill_half`), what a failed half means (`failures`), the prefill's
logprobs merged into the decode's answer (`logprobs`), how a fan-out's choice is served apart (`fan_out_options`),
and the canary that admits a new worker (`admission`)."""
