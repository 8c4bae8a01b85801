"""What a worker with a KV store registers: the namespace its SGLang uses and a keyed proof of the cluster secret it
seals pages with, which the bootstrap service compares between the namespace's workers
(tests/unit/test_bootstrap_kv_secret.py). Never the secret. The kvstore launch step decides both, from SGLang's very
options and environment, and hands them to the launcher's registrar in a file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

import decode.plan
import prefill.plan
from pdcluster.common.protocol import Role, WorkerRegistration
from pdcluster.kvstore import launch
from pdcluster.kvstore.secret_proof import MEMBERSHIP_ENV, secret_proof
from pdcluster.worker.plan import build_plan
from pdcluster.worker.registrar import Registrar
from tests.unit.test_bootstrap_kv_secret import NS, kv_worker

RULES = {Role.PREFILL: prefill.plan, Role.DECODE: decode.plan}
SECRET = "do-not-register-me"


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"vocab_size": 10}')
    return str(tmp_path / "model")


def announced(tmp_path: Path, model_dir: str, monkeypatch, role: Role = Role.PREFILL, disk: str = "kv",
              **kv: object) -> dict:
    """The worker's plan as the launcher decides it, then the launch step's preparation of it: what it announces."""
    config = tmp_path / "worker.yaml"
    config.write_text(f"model-path: {model_dir}\nport: 0\ncluster:\n  device: cpu\n"
                      f"  kv_store: {json.dumps({'dir': str(tmp_path / disk), **kv})}\n")
    command = build_plan(RULES[role], str(config), [], env={"PATH": "/usr/bin"}).command
    target = tmp_path / f"membership-{role.value}.json"
    monkeypatch.setenv(MEMBERSHIP_ENV, str(target))
    env, _extra, fd, _note = launch.prepare(tmp_path / disk, command[command.index("sglang.launch_server") + 1:], 60)
    os.close(fd)
    assert MEMBERSHIP_ENV not in os.environ, "SGLang never sees it"
    text = target.read_text()
    assert SECRET not in text and SECRET.encode().hex() not in text
    return {**json.loads(text), "storage": Path(env[launch.STORAGE_DIR_ENV]).name}


def test_the_launch_step_announces_the_namespace_sglang_uses_and_the_proof_of_its_secret(tmp_path, model_dir,
                                                                                          monkeypatch):
    (tmp_path / "secret").write_text(f"{SECRET}\n")
    prefill_side = announced(tmp_path, model_dir, monkeypatch, secret_file=str(tmp_path / "secret"))
    namespace = prefill_side["namespace"]
    assert namespace == prefill_side["storage"]
    assert prefill_side["secret_proof"] == secret_proof(SECRET.encode(), namespace)
    decode_side = announced(tmp_path, model_dir, monkeypatch, Role.DECODE, secret_file=str(tmp_path / "secret"))
    assert decode_side == prefill_side, "the decode offloads into the same pages, with the same secret"
    assert len(prefill_side["store_id"]) == 32, "the directory's id: the routers credit its pages to its workers"
    elsewhere = announced(tmp_path, model_dir, monkeypatch, disk="other-disk", secret_file=str(tmp_path / "secret"))
    assert elsewhere["namespace"] == namespace and elsewhere["store_id"] != prefill_side["store_id"]
    monkeypatch.setenv("PDCLUSTER_KV_SECRET", SECRET)
    assert announced(tmp_path, model_dir, monkeypatch) == prefill_side, "the secret from the environment proves alike"
    monkeypatch.delenv("PDCLUSTER_KV_SECRET")
    (tmp_path / "other").write_text("another")
    other = announced(tmp_path, model_dir, monkeypatch, secret_file=str(tmp_path / "other"))
    assert other["namespace"] == namespace and other["secret_proof"] not in (None, prefill_side["secret_proof"])
    assert announced(tmp_path, model_dir, monkeypatch)["secret_proof"] is None


def test_the_registrar_registers_what_the_launch_step_announced(tmp_path, caplog):
    plan = SimpleNamespace(registration=WorkerRegistration.model_validate(kv_worker("p1", None) | {"kv_store": None}),
                           command=[], cluster=SimpleNamespace(resolved_token=lambda: None, bootstrap_url=None))
    made = Registrar(plan)  # type: ignore[arg-type]
    assert made.child_env() == {MEMBERSHIP_ENV: str(made.kv_store_file)}
    made._read_kv_store()
    assert made.registration.kv_store is None, "no file: the worker keeps no KV on disk"
    made.kv_store_file.write_text("{not json")
    made._read_kv_store()
    assert made.registration.kv_store is None and "its secret is not checked" in caplog.text
    made.kv_store_file.write_text(json.dumps({"namespace": NS, "secret_proof": secret_proof(b"s", NS),
                                              "store_id": "d" * 32}))
    made._read_kv_store()
    assert made.registration.kv_store is not None and made.registration.kv_store.namespace == NS
    assert made.registration.kv_store.store == f"{NS}/{'d' * 32}"
    assert made.registration.kv_store.secret_proof == secret_proof(b"s", NS)
    made._threads = []  # never started here
    made.stop()
    assert not made.kv_store_file.exists(), "nothing left in the temporary directory"
