"""The cluster benchmark on real SGLang (`python -m bench.cluster`, `make bench-cluster`): our router against SGLang's
and a colocated server, prefix against round robin, sleep-on-idle on against off; with `--idle-only` the idle CPU of
the `make up` shape (`make bench-idle`) and with `--decode-only` a decode on fake KV (`make bench-decode-only`)."""
