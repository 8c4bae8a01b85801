from pdcluster.protocol import Role
from router.rooms import inject_pd_fields
from router.workers import Worker

PREFILL = Worker("p", Role.PREFILL, "http://10.0.0.1:30000", bootstrap_host="10.0.0.1", bootstrap_port=8999)


def test_single_request_gets_host_port_room_and_rid():
    body = {"text": "hi"}
    rids = inject_pd_fields(body, PREFILL, None, "req1")
    assert body["bootstrap_host"] == "10.0.0.1" and body["bootstrap_port"] == 8999
    assert isinstance(body["bootstrap_room"], int) and 0 <= body["bootstrap_room"] < 2**63
    assert rids == ["req1"] == [body["rid"]]


def test_batch_gets_one_distinct_room_per_item():
    body = {"text": ["a", "b", "c", "d"]}
    rids = inject_pd_fields(body, PREFILL, 4, "req2")
    assert body["bootstrap_host"] == ["10.0.0.1"] * 4 and body["bootstrap_port"] == [8999] * 4
    assert len(set(body["bootstrap_room"])) == 4
    assert rids == body["rid"] == ["req2-0", "req2-1", "req2-2", "req2-3"]


def test_client_rid_is_kept_so_the_client_can_still_abort_by_it():
    body = {"text": "hi", "rid": "mine"}
    assert inject_pd_fields(body, PREFILL, None, "req3") == ["mine"]


def test_rooms_differ_between_requests():
    bodies = [{"text": "x"} for _ in range(100)]
    for b in bodies:
        inject_pd_fields(b, PREFILL, None, "r")
    assert len({b["bootstrap_room"] for b in bodies}) == 100
