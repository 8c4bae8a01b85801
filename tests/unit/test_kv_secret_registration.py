"""What a worker with a KV store registers (pdcluster/worker/checks.py): the namespace its SGLang will use, and a
keyed proof of the cluster secret it seals pages with, which the bootstrap service compares between the namespace's
workers (tests/unit/test_bootstrap_kv_secret.py). Never the secret."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import decode.plan
import prefill.plan
from pdcluster.kvstore import launch
from pdcluster.kvstore.secret_proof import secret_proof
from pdcluster.protocol import Role
from pdcluster.worker.plan import LaunchPlan, build_plan

RULES = {Role.PREFILL: prefill.plan, Role.DECODE: decode.plan}
SECRET = "do-not-register-me"


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"vocab_size": 10}')
    return str(tmp_path / "model")


def kv_plan(tmp_path: Path, model_dir: str, role: Role = Role.PREFILL, env: dict[str, str] | None = None,
            **kv: object) -> LaunchPlan:
    config = tmp_path / "worker.yaml"
    kv = {"dir": str(tmp_path / "kv"), **kv}
    config.write_text(f"model-path: {model_dir}\nport: 0\ncluster:\n  device: cpu\n  kv_store: {json.dumps(kv)}\n")
    return build_plan(RULES[role], str(config), [], env={"PATH": "/usr/bin", **(env or {})})


def secret_file(tmp_path: Path, value: str, name: str = "kv-secret") -> str:
    (tmp_path / name).write_text(f"{value}\n")
    return str(tmp_path / name)


def test_the_registered_namespace_is_the_one_sglang_will_use(tmp_path, model_dir):
    p = kv_plan(tmp_path, model_dir, secret_file=secret_file(tmp_path, SECRET))
    command = p.command[p.command.index("--") + 1:]
    env, _extra, fd, _note = launch.prepare(tmp_path / "kv", command[command.index("sglang.launch_server") + 1:], 60)
    os.close(fd)
    assert p.registration.kv_store is not None
    assert p.registration.kv_store.namespace == Path(env[launch.STORAGE_DIR_ENV]).name
    decode_side = kv_plan(tmp_path, model_dir, Role.DECODE, secret_file=secret_file(tmp_path, SECRET))
    assert decode_side.registration.kv_store == p.registration.kv_store, "the decode offloads into the same pages"


def test_the_proof_is_the_same_for_the_same_secret_and_never_the_secret(tmp_path, model_dir):
    by_file = kv_plan(tmp_path, model_dir, secret_file=secret_file(tmp_path, SECRET)).registration
    by_env = kv_plan(tmp_path, model_dir, env={"PDCLUSTER_KV_SECRET": SECRET}).registration
    other = kv_plan(tmp_path, model_dir, secret_file=secret_file(tmp_path, "another", "other")).registration
    none = kv_plan(tmp_path, model_dir).registration
    assert by_file.kv_store and by_env.kv_store and other.kv_store and none.kv_store
    namespace = by_file.kv_store.namespace
    assert by_file.kv_store.secret_proof == by_env.kv_store.secret_proof == secret_proof(SECRET.encode(), namespace)
    assert other.kv_store.secret_proof not in (None, by_file.kv_store.secret_proof)
    assert none.kv_store.secret_proof is None and none.kv_store.namespace == namespace
    for registration in (by_file, by_env):
        sent = registration.model_dump_json()
        assert SECRET not in sent and SECRET.encode().hex() not in sent


def test_a_worker_that_keeps_no_kv_on_disk_registers_no_namespace(tmp_path, model_dir):
    assert kv_plan(tmp_path, model_dir, Role.DECODE, decode_offload=False).registration.kv_store is None
    config = tmp_path / "plain.yaml"
    config.write_text(f"model-path: {model_dir}\nport: 0\ncluster:\n  device: cpu\n")
    assert build_plan(prefill.plan, str(config), [], env={"PATH": "/usr/bin"}).registration.kv_store is None
