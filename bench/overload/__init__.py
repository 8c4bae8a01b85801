"""bench.overload: more load than the cluster can serve (`make bench-overload`; __main__.py says what runs)."""
