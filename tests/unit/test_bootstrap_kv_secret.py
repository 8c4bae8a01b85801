"""The bootstrap service refuses a worker whose KV secret differs from the live workers of its KV namespace: with
another secret (or none) it would take every page they wrote for a damaged one, recompute every hit and remove the
pages, silently. Workers register a keyed proof of the secret (pdcluster/kvstore/secret_proof.py), never the secret."""

from __future__ import annotations

import hashlib
import time

import pytest
from fastapi.testclient import TestClient

from pdcluster.kvstore.secret_proof import secret_proof
from tests.helpers import until
from tests.unit.test_bootstrap_service import client, registration

NS, OTHER_NS = "0123456789abcdef", "fedcba9876543210"


def kv_worker(worker_id: str, secret: bytes | None, namespace: str = NS, role: str = "prefill") -> dict:
    return registration(worker_id, role=role, page_size=64,
                        kv_store={"namespace": namespace, "secret_proof": secret_proof(secret, namespace)})


def listed(c: TestClient) -> list[str]:
    return sorted(w["registration"]["worker_id"] for w in c.get("/v1/workers").json()["workers"])


def test_workers_with_the_same_secret_are_both_admitted():
    with client() as c:
        assert c.put("/v1/workers/p1", json=kv_worker("p1", b"s3cret")).status_code == 200
        assert c.put("/v1/workers/p2", json=kv_worker("p2", b"s3cret")).status_code == 200
        assert c.put("/v1/workers/d1", json=kv_worker("d1", b"s3cret", role="decode")).status_code == 200
        assert listed(c) == ["d1", "p1", "p2"]
        assert c.put("/v1/workers/p3", json=kv_worker("p3", None, OTHER_NS)).status_code == 200
        assert c.put("/v1/workers/p4", json=kv_worker("p4", None, OTHER_NS)).status_code == 200, "none and none agree"


@pytest.mark.parametrize(("first", "second", "problem"), [
    (b"s3cret", b"another", f"kv secret differs from the other workers of KV namespace {NS} (p1)"),
    (b"s3cret", None, f"no kv secret is set, but the other workers of KV namespace {NS} (p1) have one"),
    (None, b"s3cret", f"a kv secret is set, but the other workers of KV namespace {NS} (p1) have none"),
])
def test_a_worker_whose_secret_differs_from_its_namespaces_is_refused_with_a_409_that_says_why(first, second, problem):
    with client() as c:
        assert c.put("/v1/workers/p1", json=kv_worker("p1", first)).status_code == 200
        refused = c.put("/v1/workers/p2", json=kv_worker("p2", second))
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["message"].startswith(problem + ": each would take the other's pages for damaged ones"), error
        assert error["param"] == "kv_store" and error["code"] == 409 and error["type"] == "invalid_request_error"
        for secret in (b"s3cret", b"another"):
            assert secret.decode() not in refused.text
        assert listed(c) == ["p1"], "the refused worker gets no traffic"


def test_workers_of_different_namespaces_never_conflict_and_workers_without_a_store_neither():
    with client() as c:
        assert c.put("/v1/workers/p1", json=kv_worker("p1", b"s3cret")).status_code == 200
        assert c.put("/v1/workers/p2", json=kv_worker("p2", b"another", OTHER_NS)).status_code == 200
        assert c.put("/v1/workers/p3", json=kv_worker("p3", None, "00000000000000aa")).status_code == 200
        assert c.put("/v1/workers/d1", json=registration("d1")).status_code == 200  # keeps no KV on disk
        assert listed(c) == ["d1", "p1", "p2", "p3"]


def test_once_the_last_worker_of_a_namespace_leaves_a_new_secret_may_take_it():
    with client() as c:
        c.put("/v1/workers/p1", json=kv_worker("p1", b"old"))
        c.put("/v1/workers/p2", json=kv_worker("p2", b"old"))
        assert c.put("/v1/workers/p3", json=kv_worker("p3", b"new")).status_code == 409
        c.delete("/v1/workers/p1")
        refused = c.put("/v1/workers/p3", json=kv_worker("p3", b"new"))
        assert refused.status_code == 409 and "(p2)" in refused.json()["error"]["message"]
        c.delete("/v1/workers/p2")
        assert c.put("/v1/workers/p3", json=kv_worker("p3", b"new")).status_code == 200
        assert c.put("/v1/workers/p1", json=kv_worker("p1", b"old")).status_code == 409, "now the new one holds it"


def test_a_worker_alone_in_its_namespace_may_restart_with_another_secret():
    """Its own earlier entry (same worker_id, still listed until its TTL) is no other worker."""
    with client() as c:
        assert c.put("/v1/workers/p1", json=kv_worker("p1", b"old")).status_code == 200
        assert c.put("/v1/workers/p1", json=kv_worker("p1", b"new")).status_code == 200
        assert c.put("/v1/workers/p2", json=kv_worker("p2", b"old")).status_code == 409


def test_a_silent_worker_holds_its_namespace_only_until_its_ttl():
    with client(ttl_seconds=0.5) as c:
        c.put("/v1/workers/p1", json=kv_worker("p1", b"old"))
        started = time.monotonic()
        assert c.put("/v1/workers/p2", json=kv_worker("p2", b"new")).status_code == 409
        assert until(lambda: c.put("/v1/workers/p2", json=kv_worker("p2", b"new")).status_code == 200, timeout=10)
        assert time.monotonic() - started >= 0.5
        assert listed(c) == ["p2"]


def test_the_proof_reveals_nothing_of_the_secret():
    """Keyed, so it cannot be tried against guessed secrets offline as a bare hash could; bound to its namespace and
    to the message's version; absent without a secret."""
    secret = b"correct horse battery staple"
    proof = secret_proof(secret, NS)
    assert proof is not None and len(proof) == 64 and int(proof, 16) >= 0
    assert proof == secret_proof(secret, NS), "the same secret proves the same in a namespace"
    for leak in (secret.decode(), secret.hex(), hashlib.sha256(secret).hexdigest(), hashlib.sha1(secret).hexdigest()):
        assert leak not in proof and proof not in leak
    assert proof not in (secret_proof(secret, OTHER_NS), secret_proof(b"correct horse battery stapl", NS))
    assert secret_proof(None, NS) is None and secret_proof(b"", NS) is None


@pytest.mark.parametrize("bad", [{"namespace": "../etc", "secret_proof": None},
                                 {"namespace": NS, "secret_proof": "s3cret"}])
def test_only_a_namespace_and_a_proof_are_taken(bad):
    """A worker (or a bug) cannot register the secret itself in the proof's place: it is not 64 hex digits."""
    with client() as c:
        refused = c.put("/v1/workers/p1", json=registration("p1", role="prefill", kv_store=bad))
        assert refused.status_code == 400 and refused.json()["error"]["param"].startswith("kv_store")
