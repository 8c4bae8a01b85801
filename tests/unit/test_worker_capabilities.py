"""What a worker registers that requests depend on (pdcluster/common/protocol.py's WorkerCapabilities): decided by its
plan from SGLang's own options, refused at start where SGLang would only decide it (or refuse it) once running, carried
through the bootstrap service to the router, and tolerant of peers of another version."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from bootstrap.app import create_app
from bootstrap.config import BootstrapConfig
from pdcluster.common.protocol import Role, WorkerCapabilities, WorkerListing, WorkerRegistration, from_newer
from pdcluster.worker.options import ConfigError
from tests.unit.test_bootstrap_service import registration
from tests.unit.test_worker_plan import plan


@pytest.fixture
def model_dir(tmp_path) -> str:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return str(tmp_path / "model")


def test_a_plan_registers_its_parsers_and_no_deterministic_inference_by_default(tmp_path, model_dir):
    assert plan(tmp_path, model_dir).registration.capabilities == WorkerCapabilities()
    parsed = plan(tmp_path, model_dir, "tool-call-parser: pythonic", ["--reasoning-parser", "qwen3"], Role.DECODE)
    assert parsed.registration.capabilities == WorkerCapabilities(tool_call_parser="pythonic",
                                                                  reasoning_parser="qwen3")
    assert "--tool-call-parser" in parsed.command and "--reasoning-parser" in parsed.command


@pytest.mark.parametrize(("yaml_text", "overrides", "message"), [
    ("tool-call-parser: auto", [], "tool-call-parser auto: name the parser"),
    ("", ["--reasoning-parser", "auto"], "reasoning-parser auto: name the parser"),
    ("tool-call-parser: smollm", [], "invalid choice: 'smollm'"),  # SGLang's own parser knows its parsers
    ("enable-deterministic-inference: true", [], "SGLang refuses it with the torch_native attention backend"),
])
def test_what_sglang_would_decide_or_refuse_only_once_running_is_refused_at_start(tmp_path, model_dir, yaml_text,
                                                                                  overrides, message):
    with pytest.raises(ConfigError) as caught:
        plan(tmp_path, model_dir, yaml_text, overrides)
    assert message in str(caught.value)


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen-3", "auto-detect"])
def test_an_unknown_reasoning_parser_is_refused_at_start_with_every_name_sglang_registers(tmp_path, model_dir, name):
    """As tool-call parsers are: SGLang's own parser lists its registry's names, and the worker never starts."""
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    with pytest.raises(ConfigError) as caught:
        plan(tmp_path, model_dir, f"reasoning-parser: {name}")
    assert f"argument --reasoning-parser: invalid choice: '{name}'" in str(caught.value)
    assert all(f"'{known}'" in str(caught.value) for known in ReasoningParser.DetectorMap)


def test_deterministic_inference_is_registered_off_the_cpu_profile(tmp_path, model_dir):
    gpu = plan(tmp_path, model_dir, "enable-deterministic-inference: true", device="cuda")
    assert gpu.registration.capabilities.deterministic_inference


def test_capabilities_reach_the_listing_and_peers_of_other_versions_still_read_each_other():
    capabilities = {"tool_call_parser": "pythonic", "reasoning_parser": None, "deterministic_inference": True}
    with TestClient(create_app(BootstrapConfig())) as service:
        assert service.put("/v1/workers/d1", json=registration("d1", capabilities=capabilities)).status_code == 200
        assert service.put("/v1/workers/d2", json=registration("d2")).status_code == 200  # an older launcher's
        newer = registration("d3", capabilities={**capabilities, "speculative": True}, shiny=1)
        assert service.put("/v1/workers/d3", json=newer).status_code == 200  # a newer one's: its extras dropped
        listing, dropped = from_newer(WorkerListing, service.get("/v1/workers").json())
    got = {row.registration.worker_id: row.registration.capabilities for row in listing.workers}
    assert got == {"d1": WorkerCapabilities(**capabilities), "d2": WorkerCapabilities(),
                   "d3": WorkerCapabilities(**capabilities)}
    assert dropped == []
    # An older router reads a newer listing: what it does not know is dropped, the rest checked as strictly.
    old, dropped = from_newer(WorkerRegistration, registration("d4", capabilities={"tool_call_parser": "x", "new": 1}))
    assert old.capabilities.tool_call_parser == "x" and dropped == ["capabilities.new"]
    with pytest.raises(ValueError):
        WorkerRegistration.model_validate(registration("d5", capabilities={"tool_call_parser": ""}))
