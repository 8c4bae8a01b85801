"""What every benchmark under bench/ shares: starting and stopping processes by their own PIDs (procs), the real
clusters on SGLang they measure (clusters), the fakes they measure against (fake_worker, otlp_receiver), load (wrk
in loadgen, sglang.bench_serving in serving), CPU accounting (cpu), the machine a result was measured on (machine),
where results go (paths), and the pictures and README tables drawn from them (plot, markdown)."""
