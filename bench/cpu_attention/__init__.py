"""pdcluster's CPU attention ops (pdcluster/cpu_attention) timed against SGLang's own, in this process, no server:
the extend a prompt's chunks and cache hits cause (extend, which bench.persistence reports as the most the plugin can
save cold), and one decode step for a batch (decode, `python -m bench.cpu_attention.decode`)."""
