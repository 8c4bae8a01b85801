"""OpenTelemetry for the router's requests: whether a request is traced and its server span (`spans`), what its trace
holds while it runs, its attempts' and legs' spans (`request_trace`), the sampling decision (`sampling`), and their way
out of the router's process (`export`, `otlp`). Off by default; on, it never costs a request its time."""
