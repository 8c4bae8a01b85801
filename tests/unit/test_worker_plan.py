"""From a worker config to the SGLang command: option names, precedence, role and CPU profile, early errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import decode.plan
import prefill.plan
from pdcluster.common.protocol import Role
from pdcluster.kvstore import wiring
from pdcluster.worker.environment import CPU_SHIM_DIR
from pdcluster.worker.options import ConfigError
from pdcluster.worker.plan import build_plan

REPO = Path(__file__).resolve().parents[2]
RULES = {Role.PREFILL: prefill.plan, Role.DECODE: decode.plan}  # what each role's entry point passes the launcher


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
    return build_plan(RULES[role], config, list(overrides), env={"PATH": "/usr/bin"})


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
    assert p.registration.role is Role.PREFILL and p.registration.kv_bootstrap_port is not None


def test_decode_cpu_profile_and_gpu_gets_none_of_it(tmp_path, model_dir):
    # Not switch-enabled (the default is: tests/unit/test_role_flip.py): it runs no KV bootstrap server.
    cmd = plan(tmp_path, model_dir, "enable-pd-role-switch: false", role=Role.DECODE).command
    assert argv_value(cmd, "--disaggregation-decode-retraction-backup") == "cpu_tensor"
    assert "--disaggregation-bootstrap-port" not in cmd
    gpu = plan(tmp_path, model_dir, role=Role.DECODE, device="cuda")
    assert "--device" not in gpu.command and "PYTHONPATH" not in gpu.env_added
    assert argv_value(gpu.command, "--disaggregation-transfer-backend") == "mooncake"


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_openai_usage_reports_cached_tokens_unless_a_config_says_not(tmp_path, model_dir, role):
    assert "--enable-cache-report" in plan(tmp_path, model_dir, role=role).command
    assert "--enable-cache-report" in plan(tmp_path, model_dir, role=role, device="cuda").command
    assert "--enable-cache-report" not in plan(tmp_path, model_dir, "enable-cache-report: false", role=role).command


def test_cpu_skips_the_model_modules_that_cannot_hold_the_models_class(tmp_path, model_dir):
    """SGLang imports every model module to find one class; on CPU the others are skipped (3-4 s of each start)."""
    assert "SGLANG_DISABLED_MODEL_ARCHS" not in plan(tmp_path, model_dir).env_added  # no architectures: none skipped
    (Path(model_dir) / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    skipped = plan(tmp_path, model_dir).env_added["SGLANG_DISABLED_MODEL_ARCHS"].split(",")
    assert "qwen2" in skipped and "deepseek_v2" in skipped
    assert "llama" not in skipped and "llama_eagle" not in skipped  # llama.py defines it, llama_eagle subclasses it
    assert "SGLANG_DISABLED_MODEL_ARCHS" not in plan(tmp_path, model_dir, device="cuda").env_added


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_mooncake_tcp_gets_room_for_scattered_pages_and_an_export_still_wins(tmp_path, model_dir, role):
    """Mooncake's TCP transport rejects a hand-off of more than ~2k transfers per peer (a long prompt on scattered
    pages): on mooncake_tcp both roles raise the queue. RDMA (`mooncake`, the GPU default) has no such queue."""
    cpu = plan(tmp_path, model_dir, role=role)
    assert cpu.env["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] == "32768"
    gpu = plan(tmp_path, model_dir, role=role, device="cuda")
    assert "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER" not in gpu.env_added
    config = write_config(tmp_path, f"model-path: {model_dir}\nport: 0\ncluster:\n  device: cpu\n")
    exported = build_plan(RULES[role], config, [], env={"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "4096"})
    assert exported.env["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] == "4096"


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_cpu_attention_on_by_default_off_by_setting_never_on_gpu(tmp_path, model_dir, role):
    config = write_config(tmp_path, f"model-path: {model_dir}\nport: 0\ncluster:\n  device: cpu\n")
    assert build_plan(RULES[role], config, [], env={}).env_added["PDCLUSTER_CPU_ATTENTION"] == "1"
    # The setting decides, whatever the caller's environment says (the benchmark switches it per cluster).
    off = build_plan(RULES[role], config, [], env={"PDCLUSTER_CPU_ATTENTION": "1"},
                     cluster_overrides={"cpu_attention": "false"})
    assert off.env["PDCLUSTER_CPU_ATTENTION"] == "0" and off.env_added["PDCLUSTER_CPU_ATTENTION"] == "0"
    assert "PDCLUSTER_CPU_ATTENTION=0" in off.describe()  # what --dry-run prints
    gpu = plan(tmp_path, model_dir, role=role, device="cuda")
    assert "PDCLUSTER_CPU_ATTENTION" not in gpu.env_added


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_cpus_pin_sglangs_whole_tree_and_size_its_threads(tmp_path, model_dir, role):
    core = min(os.sched_getaffinity(0))
    config = write_config(tmp_path, f"model-path: {model_dir}\nport: 0\ncluster:\n  device: cpu\n  cpus: '{core}'\n")
    # The setting decides the thread count, whatever the caller exported (4 threads on 1 core spin at each step).
    p = build_plan(RULES[role], config, [], env={"OMP_NUM_THREADS": "4"})
    assert p.command[:3] == ["taskset", "--cpu-list", str(core)] and "sglang.launch_server" in p.command
    assert p.env["OMP_NUM_THREADS"] == "1" and "OMP_NUM_THREADS=1" in p.describe()
    assert "OMP_WAIT_POLICY" not in p.env_added  # its own cores: spinning takes nothing from another worker
    unpinned = plan(tmp_path, model_dir, role=role)
    assert "taskset" not in unpinned.command and "OMP_NUM_THREADS" not in unpinned.env_added
    # Sharing the host's cores, its threads wait passively, unless the caller exported a policy.
    assert unpinned.env_added["OMP_WAIT_POLICY"] == "PASSIVE"
    exported = build_plan(RULES[role], write_config(tmp_path, f"model-path: {model_dir}\nport: 0\ncluster:\n"
                                                              "  device: cpu\n"), [], env={"OMP_WAIT_POLICY": "ACTIVE"})
    assert exported.env["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "OMP_WAIT_POLICY" not in plan(tmp_path, model_dir, role=role, device="cuda").env_added
    spans = build_plan(RULES[role], config, [], env={}, cluster_overrides={"cpus": f"{core},{core}-{core}"})
    assert spans.command[:3] == ["taskset", "--cpu-list", str(core)] and spans.env["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize(("cpus", "message"), [
    ("1-0", "a range goes from the lower core to the higher"),
    ("zero", "should match pattern"),
    ("0,", "should match pattern"),
    ("4096", "core(s) 4096 not available here"),
])
def test_cpus_that_cannot_be_had_are_one_clear_error(tmp_path, model_dir, cpus, message):
    config = write_config(tmp_path, f"model-path: {model_dir}\nport: 0\ncluster:\n  device: cpu\n")
    with pytest.raises(ConfigError) as caught:
        build_plan(RULES[Role.DECODE], config, [], env={}, cluster_overrides={"cpus": cpus})
    assert message in str(caught.value) and "cpus" in str(caught.value)


def test_command_line_beats_file_beats_profile(tmp_path, model_dir):
    p = plan(tmp_path, model_dir, "max-total-tokens: 4096\nmem_fraction_static: 0.2\n", ["--max-total-tokens", "2048"])
    assert argv_value(p.command, "--max-total-tokens") == "2048"
    assert argv_value(p.command, "--mem-fraction-static") == "0.2"  # underscore spelling works like SGLang's
    assert p.command.count("--max-total-tokens") == 1


@pytest.mark.parametrize(
    ("yaml_text", "overrides", "role", "message"),
    [
        ("max-totl-tokens: 5", [], Role.PREFILL,
         "unknown SGLang option --max-totl-tokens (did you mean --max-total-tokens?)"),
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
                            text=True, timeout=600)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "decode: error: unknown SGLang option --max-totl-tokens (did you mean --max-total-tokens?)"]


def test_a_plan_reaches_the_lean_launcher_whole(tmp_path, model_dir):
    """The launcher hands its decided plan to the interpreter it execs into (pdcluster/worker/cli.py) as JSON."""
    from pdcluster.worker.plan import LaunchPlan

    config = write_config(tmp_path, f"model-path: {model_dir}\nport: 0\ncluster:\n  device: cpu\n  token: s3cret\n"
                                    f"  grace_period: 30\n  kv_store: {{dir: {tmp_path / 'kv'}, max_size: 1GiB}}\n")
    decided = build_plan(RULES[Role.DECODE], config, [], env={"PATH": "/usr/bin"})
    again = LaunchPlan.from_json(decided.to_json())
    assert again == decided
    assert again.cluster.kv_store.max_size == 2**30 and again.registration.role is Role.DECODE


def test_cli_dry_run_prints_command_and_environment(tmp_path, model_dir):
    config = write_config(tmp_path, f"model-path: {model_dir}\nport: 0\nreasoning-parser: qwen3\n"
                                    f"cluster:\n  device: cpu\n")
    result = subprocess.run([sys.executable, "prefill.py", "--config", config, "--dry-run"], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "SGLANG_USE_CPU_ENGINE=1" in result.stdout and "sglang.launch_server" in result.stdout
    assert "PDCLUSTER_CPU_ATTENTION=1" in result.stdout and " --reasoning-parser qwen3 " in result.stdout


# --- cluster.kv_store: KV cache on disk (pdcluster/kvstore) -------------------------------------------------------

def kv_plan(tmp_path, model_dir, kv=None, yaml_text="", role=Role.PREFILL, device="cpu", overrides=()):
    kv = {"dir": str(tmp_path / "kv"), **(kv or {})}
    config = write_config(tmp_path, f"model-path: {model_dir}\nport: 0\n{yaml_text}\ncluster:\n  device: {device}\n"
                                    f"  kv_store: {json.dumps(kv)}\n")
    return build_plan(RULES[role], config, list(overrides), env={"PATH": "/usr/bin"})


def sglang_part(command: list[str]) -> list[str]:
    return command[command.index("--") + 1:] if "--" in command else command


def test_kv_store_prefill_cpu(tmp_path, model_dir):
    p = kv_plan(tmp_path, model_dir, {"max_size": "1GiB", "prefetch_threshold": 32, "orphan_tmp_age": 60})
    assert p.command[1:8] == ["-m", "pdcluster.kvstore", "launch", "--role", "prefill", "--dir", str(tmp_path / "kv")]
    assert p.command[8:10] == ["--orphan-tmp-age", "60.0"] and (tmp_path / "kv").is_dir()
    cmd = sglang_part(p.command)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert "--enable-hierarchical-cache" in cmd and argv_value(cmd, "--hicache-storage-backend") == "dynamic"
    assert argv_value(cmd, "--hicache-write-policy") == "write_through"
    assert argv_value(cmd, "--hicache-io-backend") == "direct"
    assert argv_value(cmd, "--hicache-mem-layout") == "page_first_direct"
    assert argv_value(cmd, "--page-size") == "64"
    assert json.loads(argv_value(cmd, "--hicache-storage-backend-extra-config")) == {
        "prefetch_threshold": 32, **wiring.PREFETCH_BUDGET, **wiring.SEALED}
    assert argv_value(cmd, "--hicache-storage-prefetch-policy") == "timeout", "a request waits for its pages"
    assert "--enable-metrics" in cmd, "the sealed storage's counters are on the worker's /metrics"
    assert p.env["PDCLUSTER_CPU_HICACHE"] == "1" and p.env["SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"] == str(1 << 30)
    assert "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR" not in p.env, "the namespace is the launch step's to choose"
    assert p.registration.identity.page_size == 64


def test_kv_store_prefill_gpu_keeps_sglang_kernels(tmp_path, model_dir):
    p = kv_plan(tmp_path, model_dir, {"min_free_space": "5GB"}, yaml_text="tp-size: 2", device="cuda")
    cmd = sglang_part(p.command)
    assert "--enable-hierarchical-cache" in cmd and "--hicache-io-backend" not in cmd and "--device" not in cmd
    assert argv_value(cmd, "--hicache-mem-layout") == "page_first"
    assert "--hicache-storage-prefetch-policy" not in cmd  # SGLang's own, where recomputing is cheap
    assert "PDCLUSTER_CPU_HICACHE" not in p.env_added and "PYTHONPATH" not in p.env_added
    assert p.env_added["SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE"] == "5000000000"
    assert "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE" not in p.env_added
    tp2 = kv_plan(tmp_path, model_dir, {"max_size": 1000}, yaml_text="tp-size: 2", device="cuda")
    assert tp2.env_added["SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"] == "500", "each TP rank bounds its own files"


def test_kv_store_decode(tmp_path, model_dir):
    p = kv_plan(tmp_path, model_dir, role=Role.DECODE)
    assert p.command[1:6] == ["-m", "pdcluster.kvstore", "launch", "--role", "decode"]
    cmd = sglang_part(p.command)
    assert "--disaggregation-decode-enable-offload-kvcache" in cmd and "--enable-hierarchical-cache" not in cmd
    assert argv_value(cmd, "--hicache-storage-backend") == "dynamic" and argv_value(cmd, "--page-size") == "64"
    assert argv_value(cmd, "--hicache-io-backend") == "direct"
    assert argv_value(cmd, "--hicache-mem-layout") == "page_first_direct", "the prefill's layout: one namespace"
    assert argv_value(cmd, "--disaggregation-decode-retraction-backup") == "cpu_tensor"
    assert json.loads(argv_value(cmd, "--hicache-storage-backend-extra-config")) == wiring.SEALED
    assert p.env["PDCLUSTER_CPU_HICACHE"] == "1"
    plain = kv_plan(tmp_path, model_dir, {"decode_offload": False}, role=Role.DECODE)
    assert plain.command[1:3] == ["-m", "sglang.launch_server"] and argv_value(plain.command, "--page-size") == "64"
    assert "--hicache-storage-backend" not in plain.command


def test_kv_store_secret_file_is_passed_by_name_never_by_value(tmp_path, model_dir):
    secret = tmp_path / "kv-secret"
    secret.write_text("do-not-print-me\n")
    for role in (Role.PREFILL, Role.DECODE):
        p = kv_plan(tmp_path, model_dir, {"secret_file": str(secret)}, role=role)
        extra = json.loads(argv_value(sglang_part(p.command), "--hicache-storage-backend-extra-config"))
        assert extra["secret_file"] == str(secret.resolve())
        assert "do-not-print-me" not in p.describe()


def test_kv_store_options_stay_overridable(tmp_path, model_dir):
    p = kv_plan(tmp_path, model_dir, yaml_text="page-size: 16\nhicache-mem-layout: layer_first\n"
                "hicache-write-policy: write_through_selective\n"
                "hicache-storage-backend-extra-config: '{\"prefetch_threshold\": 128}'",
                overrides=["--hicache-ratio", "1.5"])
    cmd = sglang_part(p.command)
    assert argv_value(cmd, "--page-size") == "16" and argv_value(cmd, "--hicache-mem-layout") == "layer_first"
    assert argv_value(cmd, "--hicache-write-policy") == "write_through_selective"  # persists from a page's 2nd use
    assert json.loads(argv_value(cmd, "--hicache-storage-backend-extra-config")) == {"prefetch_threshold": 128,
                                                                                      **wiring.SEALED}
    assert argv_value(cmd, "--hicache-ratio") == "1.5"


def test_kv_store_from_the_command_line(tmp_path, model_dir):
    config = write_config(tmp_path, f"model-path: {model_dir}\nport: 0\ncluster:\n  device: cpu\n")
    kv = str(tmp_path / "cli-kv")
    p = build_plan(prefill.plan, config, [], env={}, cluster_overrides={"kv_store": kv, "kv_store.max_size": "2KiB"})
    assert argv_value(p.command, "--dir") == kv and p.env["SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"] == "2048"
    off = build_plan(prefill.plan, config, [], env={}, cluster_overrides={"kv_store": None})
    assert "--enable-hierarchical-cache" not in off.command and "PDCLUSTER_CPU_HICACHE" not in off.env


@pytest.mark.parametrize(
    ("kv", "yaml_text", "role", "device", "message"),
    [
        ({}, "hicache-write-policy: write_back", Role.PREFILL, "cpu", "write_back leaves a prompt's first pages"),
        ({}, "hicache-io-backend: kernel", Role.PREFILL, "cpu", "hicache-io-backend kernel needs CUDA kernels"),
        ({}, "hicache-io-backend: kernel", Role.DECODE, "cpu", "on CPU use direct"),
        ({}, "hicache-mem-layout: page_head", Role.PREFILL, "cpu", "page_head has no CPU transfer"),
        ({}, "hicache-storage-backend: mooncake", Role.PREFILL, "cuda", "kv_store keeps KV in pdcluster's sealed"),
        ({}, "hicache-storage-backend: file", Role.DECODE, "cpu", "kv_store keeps KV in pdcluster's sealed"),
        ({"secret_file": "/nonexistent/secret"}, "", Role.PREFILL, "cpu", "kv_store.secret_file /nonexistent"),
        ({}, "enable-hierarchical-cache: false", Role.PREFILL, "cpu", "needs SGLang's HiCache"),
        ({}, "disaggregation-decode-retraction-backup: host_pool", Role.DECODE, "cuda", "host_pool cannot run"),
        ({"max_size": "lots"}, "", Role.PREFILL, "cpu", "cluster.kv_store.max_size"),
        ({"prefetch_threshold": 0}, "", Role.PREFILL, "cpu", "cluster.kv_store.prefetch_threshold"),
        ({"dri": "x"}, "", Role.PREFILL, "cpu", "cluster.kv_store.dri: Extra inputs are not permitted"),
    ],
)
def test_kv_store_refusals(tmp_path, model_dir, kv, yaml_text, role, device, message):
    with pytest.raises(ConfigError) as caught:
        kv_plan(tmp_path, model_dir, kv, yaml_text, role=role, device=device)
    assert message in str(caught.value)


def test_kv_store_dir_must_be_creatable_and_writable(tmp_path, model_dir):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match=r"kv_store\.dir .*a-file/kv: cannot create or write it"):
        kv_plan(tmp_path, model_dir, {"dir": str(tmp_path / "a-file" / "kv")})
    if os.geteuid() != 0:  # root writes through permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="cannot create or write it"):
            kv_plan(tmp_path, model_dir, {"dir": str(locked)})


def test_kv_store_refusal_from_the_cli(tmp_path, model_dir):
    config = write_config(tmp_path, f"model-path: {model_dir}\nport: 0\nhicache-write-policy: write_back\n"
                                    f"cluster:\n  device: cpu\n  kv_store: {tmp_path / 'kv'}\n")
    result = subprocess.run([sys.executable, "prefill.py", "--config", config], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("prefill: error: hicache-write-policy write_back")


def test_registration_carries_vocab_size_and_context_length(tmp_path, model_dir):
    (Path(model_dir) / "config.json").write_text('{"vocab_size": 1000, "max_position_embeddings": 2048}')
    reg = plan(tmp_path, model_dir).registration
    assert (reg.vocab_size, reg.context_length) == (1000, 2048)
    assert plan(tmp_path, model_dir, "context-length: 1024").registration.context_length == 1024
    (Path(model_dir) / "config.json").write_text('{"text_config": {"vocab_size": 7}}')
    reg = plan(tmp_path, model_dir).registration
    assert (reg.vocab_size, reg.context_length) == (7, None)
