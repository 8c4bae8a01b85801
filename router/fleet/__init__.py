"""The workers the router knows: each worker's state and breaker (`workers`, where `Worker.unusable` decides who gets
new requests), the registry's listing (`discovery`), and the probes that watch them (`health`, `liveness`)."""
