from itertools import pairwise

import pytest
from pydantic import ValidationError

from pdcluster.common.protocol import Role
from router.config import RouterConfig
from router.fleet.discovery import static_worker
from router.fleet.workers import Worker
from router.pd.request import add_pd_fields, new_rid

PREFILL = Worker("p", Role.PREFILL, "http://10.0.0.1:30000", kv_bootstrap_host="10.0.0.1",
                 kv_bootstrap_port=8999)


def test_single_request_gets_host_port_room_and_a_router_rid():
    body = {"text": "hi"}
    rids = add_pd_fields(body, PREFILL, None)
    assert body["bootstrap_host"] == "10.0.0.1" and body["bootstrap_port"] == 8999
    assert isinstance(body["bootstrap_room"], int) and 0 <= body["bootstrap_room"] < 2**63
    assert rids == [body["rid"]] and len(body["rid"]) == 32


def test_batch_gets_one_distinct_room_and_rid_per_item():
    body = {"text": ["a", "b", "c", "d"]}
    rids = add_pd_fields(body, PREFILL, 4)
    assert body["bootstrap_host"] == ["10.0.0.1"] * 4 and body["bootstrap_port"] == [8999] * 4
    assert len(set(body["bootstrap_room"])) == 4
    assert rids == body["rid"] and len(set(rids)) == 4


def test_a_client_rid_never_reaches_sglang():
    """SGLang aborts by rid prefix: a client's rid ("2", "") would let it abort other clients' requests."""
    for client_rid in ("2", "", "abc", ["x", "y"]):
        body = {"text": "hi" if not isinstance(client_rid, list) else ["a", "b"], "rid": client_rid}
        rids = add_pd_fields(body, PREFILL, None if not isinstance(client_rid, list) else 2)
        assert client_rid not in rids and body["rid"] != client_rid


def test_no_rid_is_a_prefix_of_another():
    rids = [new_rid() for _ in range(20_000)]
    assert len(set(rids)) == len(rids) and {len(r) for r in rids} == {32}
    ordered = sorted(rids)  # a prefix would sort right before the rid it starts
    assert not any(b.startswith(a) for a, b in pairwise(ordered))


def test_rooms_differ_between_requests():
    bodies = [{"text": "x"} for _ in range(100)]
    for b in bodies:
        add_pd_fields(b, PREFILL, None)
    assert len({b["bootstrap_room"] for b in bodies}) == 100


def test_a_static_prefills_kv_bootstrap_server_is_what_sglang_gets():
    spec = {"url": "http://10.0.0.1:30000", "kv_bootstrap_host": "10.0.0.9", "kv_bootstrap_port": 8999}
    config = RouterConfig(bootstrap_url=None, prefill=[spec])
    prefill = static_worker(config.prefill[0], Role.PREFILL, 0)
    body = {"text": "hi"}
    add_pd_fields(body, prefill, None)
    assert (body["bootstrap_host"], body["bootstrap_port"]) == ("10.0.0.9", 8999)
    assert RouterConfig(prefill=[{"url": "http://h:1", "kv_bootstrap_port": 8999}]).prefill[0].kv_bootstrap_host is None


def test_the_old_static_worker_names_are_refused():
    with pytest.raises(ValidationError, match="bootstrap_port"):
        RouterConfig(bootstrap_url=None, prefill=[{"url": "http://10.0.0.1:30000", "bootstrap_port": 8999}])
