"""A prefill runs SGLang's KV events on ports it owns and registers them; a decode does not; the switch and an
operator's own --kv-events-config are respected. The flag's JSON is read back by SGLang's own KVEventsConfig."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from sglang.srt.disaggregation.kv_events import KVEventsConfig

from pdcluster.common.protocol import Role
from pdcluster.worker.plan import LaunchPlan, build_plan
from tests.unit.test_worker_plan import RULES, argv_value, plan, write_config


def prefill(tmp_path: Path, model_dir: str, cluster: str, options: str = "") -> LaunchPlan:
    config = write_config(tmp_path, f"model-path: {model_dir}\nport: 0\n{options}\ncluster:\n  device: cpu\n{cluster}")
    return build_plan(RULES[Role.PREFILL], config, [], env={"PATH": "/usr/bin"})


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return str(tmp_path / "model")


def test_a_prefill_publishes_on_a_free_pair_of_ports_bound_to_its_host(tmp_path, model_dir):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    base = busy.getsockname()[1]  # the base itself is taken: the launcher moves past it
    p = prefill(tmp_path, model_dir, f"  kv_events_port_base: {base}\n", "host: 127.0.0.1")
    busy.close()
    config = KVEventsConfig.from_cli(argv_value(p.command, "--kv-events-config"))
    port = int(config.endpoint.rsplit(":", 1)[1])
    assert port > base and config.publisher == "zmq" and config.bind is True
    assert config.endpoint == f"tcp://127.0.0.1:{port}" and config.replay_endpoint == f"tcp://127.0.0.1:{port + 1}"
    events = p.registration.kv_events
    assert events is not None and (events.host, events.port, events.replay_port) == ("127.0.0.1", port, port + 1)


def test_a_wildcard_host_binds_every_interface_and_registers_the_advertised_one(tmp_path, model_dir):
    p = plan(tmp_path, model_dir, "host: 0.0.0.0", overrides=["--port", "0"])
    config = KVEventsConfig.from_cli(argv_value(p.command, "--kv-events-config"))
    assert config.endpoint.startswith("tcp://*:")
    assert p.registration.kv_events is not None and p.registration.kv_events.host == p.registration.url.host


def test_a_decode_publishes_none_and_the_switch_turns_a_prefill_off(tmp_path, model_dir):
    decode = plan(tmp_path, model_dir, "enable-pd-role-switch: false", role=Role.DECODE)  # switch-enabled: it does
    assert "--kv-events-config" not in decode.command and decode.registration.kv_events is None
    off = prefill(tmp_path, model_dir, "  kv_events_port_base: null\n")
    assert "--kv-events-config" not in off.command and off.registration.kv_events is None


def test_an_operators_own_config_is_kept_and_registered_as_it_publishes(tmp_path, model_dir):
    own = json.dumps({"publisher": "zmq", "endpoint": "tcp://*:7001", "replay_endpoint": "tcp://*:7002",
                      "topic": "t"})
    p = plan(tmp_path, model_dir, overrides=["--kv-events-config", own])
    assert argv_value(p.command, "--kv-events-config") == own
    events = p.registration.kv_events
    assert events is not None and (events.port, events.replay_port, events.topic) == (7001, 7002, "t")
    silent = plan(tmp_path, model_dir, overrides=["--kv-events-config", '{"publisher": "null"}'])
    assert silent.registration.kv_events is None
