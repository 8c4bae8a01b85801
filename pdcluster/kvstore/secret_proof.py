"""Proof that a worker holds a given cluster secret, which the bootstrap service compares between the workers of a KV
namespace (bootstrap/registry.py) without ever learning the secret.

Workers of one namespace read each other's pages, and a page sealed with another secret (or none) is a `secret` miss:
a worker started with the wrong secret would recompute every hit and remove the others' pages, silently. So each
worker registers HMAC-SHA256(secret, a fixed message naming the namespace): equal for equal secrets, and it reveals
nothing of the secret (a bare hash of it could be tried against guesses offline, this is keyed). The namespace in the
message makes the proofs of one secret differ between namespaces, so they cannot be matched across them.
"""

from __future__ import annotations

import hashlib
import hmac

# The file the kvstore launch step writes the namespace and proof to (launch.announce), for the worker launcher that
# named it (pdcluster/worker/registrar.py): a launcher must not resolve the weights a second time, nor guess.
MEMBERSHIP_ENV = "PDCLUSTER_KV_MEMBERSHIP_FILE"
# Versioned: a future change of the message makes a new proof, never one that collides with this one's.
MESSAGE = "pdcluster kv secret proof v1\0{namespace}"


def secret_proof(secret: bytes | None, namespace: str) -> str | None:
    """The proof as 64 hex digits; None for a worker that seals pages without a secret."""
    if not secret:
        return None
    return hmac.new(secret, MESSAGE.format(namespace=namespace).encode(), hashlib.sha256).hexdigest()
