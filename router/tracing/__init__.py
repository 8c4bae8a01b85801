"""OpenTelemetry for the router's requests: the spans of one request (`spans`), the sampling decision (`sampling`),
and their way out of the router's process (`export`, `otlp`). Off by default; on, it never costs a request its time."""
