"""pdcluster.local.models: which model a worker serves when a config's is overridden (make up MODEL=..., the fast
suites)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from pdcluster.local.cluster import LocalCluster
from pdcluster.local.models import DEMO_ARGS, model_args
from pdcluster.local.spec import LocalSpec


def test_a_local_folder_is_served_under_its_name_and_a_hub_id_under_the_id(demo_model):
    assert model_args("models/tiny-llama") == ["--model-path", "models/tiny-llama", "--served-model-name", "tiny-llama"]
    assert model_args("HuggingFaceTB/SmolLM2-360M-Instruct")[-1] == "HuggingFaceTB/SmolLM2-360M-Instruct"
    assert DEMO_ARGS[-2:] == ["--max-total-tokens", "65536"]  # the demo model's pool as before SmolLM2's profile


def test_group_args_override_the_config_file_for_every_worker_of_the_group(tmp_path: Path):
    spec = LocalSpec.model_validate({
        "bootstrap": {"config": "configs/bootstrap.yaml"}, "router": {"config": "configs/router.yaml"},
        "prefill": {"config": "configs/prefill.yaml", "args": DEMO_ARGS, "count": 2, "first_port": 30100},
        "decode": {"config": "configs/decode.yaml", "first_port": 30200}})
    cluster = LocalCluster(spec, tmp_path)
    for name in ("prefill-0", "prefill-1"):
        command = cluster.processes[name].command
        # after --config, so the launcher takes them over the file (command line > file)
        assert command[command.index("--config") + 2:][:len(DEMO_ARGS)] == DEMO_ARGS
    assert "--model-path" not in cluster.processes["decode-0"].command  # the file's model: SmolLM2


def test_a_port_where_sglang_picks_ports_at_random_is_refused_with_the_range_named():
    """A decode on 27200 once lost its port to a prefill's TCPStore, which SGLang binds at random in 22000-29999."""
    base = {"bootstrap": {"config": "configs/bootstrap.yaml"}, "router": {"config": "configs/router.yaml"},
            "prefill": {"config": "configs/prefill.yaml", "count": 2, "first_port": 30100},
            "decode": {"config": "configs/decode.yaml", "first_port": 30200}}
    LocalSpec.model_validate(base)  # make up's ports
    for group, field, port in (("decode", "first_port", 27200), ("prefill", "first_kv_bootstrap_port", 21999),
                               ("router", "port", 22000), ("prefill", "first_kv_events_port", 29999)):
        bad = {**base, group: {**base[group], field: port}}
        with pytest.raises(ValidationError, match="overlap 22000-29999, where each SGLang worker picks a port"):
            LocalSpec.model_validate(bad)
