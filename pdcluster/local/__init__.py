"""The whole cluster on one machine (`make up`, `python -m pdcluster.local`, the end-to-end tests and the chaos soak):
the local spec (spec.py), each component as a child process (process.py), restarts with backoff (restarts.py), the
cluster that starts and supervises them (cluster.py) and the models it serves (models.py). It starts every component
through its public command, so it imports none of the worker launcher or the KV store."""
