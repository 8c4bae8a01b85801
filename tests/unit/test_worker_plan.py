"""From a worker config to the SGLang command: option names, precedence, role and CPU profile, early errors."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pdcluster.protocol import Role
from pdcluster.worker.options import ConfigError
from pdcluster.worker.plan import CPU_SHIM_DIR, build_plan

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return str(tmp_path / "model")


def write_config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "worker.yaml"
    path.write_text(text)
    return str(path)


def plan(tmp_path, model_dir, yaml_text="", overrides=(), role=Role.PREFILL, device="cpu"):
    config = write_config(tmp_path, f"model-path: {model_dir}\nport: 0\n{yaml_text}\ncluster:\n  device: {device}\n")
    return build_plan(role, config, list(overrides), env={"PATH": "/usr/bin"})


def argv_value(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_prefill_cpu_profile(tmp_path, model_dir):
    p = plan(tmp_path, model_dir)
    cmd = p.command
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert argv_value(cmd, "--disaggregation-mode") == "prefill"
    assert argv_value(cmd, "--device") == "cpu" and argv_value(cmd, "--attention-backend") == "torch_native"
    assert argv_value(cmd, "--disaggregation-transfer-backend") == "mooncake_tcp"
    assert "--disable-overlap-schedule" in cmd
    assert int(argv_value(cmd, "--disaggregation-bootstrap-port")) != 8998
    assert p.env["SGLANG_USE_CPU_ENGINE"] == "1" and p.env["SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"] == "1"
    assert p.env["PYTHONPATH"].split(":")[0] == str(CPU_SHIM_DIR)
    assert p.registration.role is Role.PREFILL and p.registration.bootstrap_port is not None


def test_decode_cpu_profile_and_gpu_gets_none_of_it(tmp_path, model_dir):
    cmd = plan(tmp_path, model_dir, role=Role.DECODE).command
    assert argv_value(cmd, "--disaggregation-decode-retraction-backup") == "cpu_tensor"
    assert "--disaggregation-bootstrap-port" not in cmd
    gpu = plan(tmp_path, model_dir, role=Role.DECODE, device="cuda")
    assert "--device" not in gpu.command and "PYTHONPATH" not in gpu.env_added
    assert argv_value(gpu.command, "--disaggregation-transfer-backend") == "mooncake"


def test_command_line_beats_file_beats_profile(tmp_path, model_dir):
    p = plan(tmp_path, model_dir, "max-total-tokens: 4096\nmem_fraction_static: 0.2\n", ["--max-total-tokens", "2048"])
    assert argv_value(p.command, "--max-total-tokens") == "2048"
    assert argv_value(p.command, "--mem-fraction-static") == "0.2"  # underscore spelling works like SGLang's
    assert p.command.count("--max-total-tokens") == 1


@pytest.mark.parametrize(
    ("yaml_text", "overrides", "role", "message"),
    [
        ("max-totl-tokens: 5", [], Role.PREFILL, "unknown SGLang option --max-totl-tokens (did you mean --max-total-tokens?)"),
        ("", ["--disaggregation-mode", "decode"], Role.PREFILL, "contradicts this prefill worker"),
        ("disaggregation-transfer-backend: fake", [], Role.PREFILL, "fake is decode-only"),
        ("disaggregation-transfer-backend: nixl", [], Role.DECODE, "Mooncake"),
        ("disaggregation-bootstrap-port: 8998", [], Role.PREFILL, "collides with the bootstrap service"),
        ("disaggregation-bootstrap-port: 9100", [], Role.DECODE, "is a prefill option"),
        ("dtype: float65", [], Role.DECODE, "invalid choice: 'float65'"),
    ],
)
def test_mistakes_are_one_clear_error(tmp_path, model_dir, yaml_text, overrides, role, message):
    with pytest.raises(ConfigError) as caught:
        plan(tmp_path, model_dir, yaml_text, overrides, role=role)
    assert message in str(caught.value)


def test_missing_model_and_busy_port(tmp_path, model_dir):
    with pytest.raises(ConfigError, match="does not exist"):
        plan(tmp_path, str(tmp_path / "nope"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} on 127.0.0.1 is already in use"):
            plan(tmp_path, model_dir, overrides=["--port", str(port)])


def test_cli_reports_errors_on_one_line_with_status_2(tmp_path, model_dir):
    config = write_config(tmp_path, f"model-path: {model_dir}\nmax-totl-tokens: 5\n")
    result = subprocess.run([sys.executable, "decode.py", "--config", config], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "decode: error: unknown SGLang option --max-totl-tokens (did you mean --max-total-tokens?)"]


def test_cli_dry_run_prints_command_and_environment(tmp_path, model_dir):
    config = write_config(tmp_path, f"model-path: {model_dir}\nport: 0\ncluster:\n  device: cpu\n")
    result = subprocess.run([sys.executable, "prefill.py", "--config", config, "--dry-run"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "SGLANG_USE_CPU_ENGINE=1" in result.stdout and "sglang.launch_server" in result.stdout
