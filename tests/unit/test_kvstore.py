"""pdcluster.kvstore: fingerprints of model content and KV format, namespaces, orphan cleanup, the list/clear CLI."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdcluster.kvstore import cli, fingerprint, launch, namespace
from pdcluster.kvstore.fingerprint import DigestCache, effective_layout, kv_identity, weights_identity

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def make_model(path: Path, weights: bytes = b"\x01" * 4096) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama", "vocab_size": 1000}')
    (path / "model.safetensors").write_bytes(weights)
    (path / "tokenizer.json").write_text("{}")  # not a weight file: not read
    return path


def options(**changes) -> SimpleNamespace:
    values = dict(model_path="m", served_model_name="tiny", dtype="float32", kv_cache_dtype="auto", quantization=None,
                  load_format="auto", json_model_override_args="{}", page_size=64, tp_size=1, pp_size=1,
                  hicache_mem_layout="page_first_direct", hicache_io_backend="direct", device="cpu")
    return SimpleNamespace(**{**values, **changes})


def fp_of(model: Path, cache_file: Path | None = None, **changes) -> str:
    weights = weights_identity(model, DigestCache(cache_file))
    return fingerprint.fingerprint(kv_identity(options(**changes), weights))


def test_fingerprint_follows_what_decides_a_page_and_not_the_folder(tmp_path):
    model = make_model(tmp_path / "a" / "model")
    base = fp_of(model)
    assert len(base) == 16 and base == fp_of(model)
    for change in ({"dtype": "bfloat16"}, {"kv_cache_dtype": "fp8_e4m3"}, {"page_size": 32},
                   {"hicache_mem_layout": "layer_first"}, {"tp_size": 2}, {"pp_size": 2},
                   {"served_model_name": "other"}, {"quantization": "fp8"}, {"device": None}):
        assert fp_of(model, **change) != base, change
    moved = tmp_path / "elsewhere" / "renamed"
    moved.parent.mkdir()
    model.rename(moved)
    assert fp_of(moved) == base, "the weights' content decides, not the folder's name or place"
    data = bytearray((moved / "model.safetensors").read_bytes())
    data[1000] ^= 1
    (moved / "model.safetensors").write_bytes(bytes(data))
    assert fp_of(moved) != base, "one weight byte changed"
    (moved / "model.safetensors").write_bytes(b"\x01" * 4096)
    (moved / "config.json").write_text('{"model_type": "llama", "vocab_size": 1001}')
    assert fp_of(moved) != base, "config.json changed"


def test_layout_is_the_one_sglang_really_uses():
    assert effective_layout("page_first", "direct") == "page_first_direct"
    assert effective_layout("page_first", "kernel") == "page_first"
    assert fp_of_options(hicache_mem_layout="page_first") == fp_of_options(hicache_mem_layout="page_first_direct")


def fp_of_options(**changes) -> str:
    return fingerprint.fingerprint(kv_identity(options(**changes), {"files": {}}))


def safetensors(tensors: int, tensor_bytes: int) -> tuple[bytearray, int]:
    header = {f"t{i}": {"dtype": "U8", "shape": [tensor_bytes], "data_offsets": [i * tensor_bytes,
                                                                                (i + 1) * tensor_bytes]}
              for i in range(tensors)}
    head = json.dumps(header).encode()
    data = bytearray(len(head).to_bytes(8, "little") + head + bytes(tensors * tensor_bytes))
    return data, 8 + len(head)


def test_big_files_are_sampled_per_tensor(tmp_path):
    """A fine-tune that rewrote one tensor outside the first, middle and last MiB still changes the digest."""
    data, base = safetensors(6, MiB)
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    before = fingerprint.file_digest(path)
    data[base + MiB + MiB // 2] = 7  # the middle of tensor t1: between the first and the middle MiB
    path.write_bytes(data)
    assert fingerprint.file_digest(path) != before


def test_digests_are_remembered_by_path_size_and_mtime(tmp_path, monkeypatch):
    model = make_model(tmp_path / "model")
    cache_file = tmp_path / "kv" / namespace.DIGEST_CACHE
    cache_file.parent.mkdir()
    reads = []
    real = fingerprint.file_digest
    monkeypatch.setattr(fingerprint, "file_digest", lambda p: reads.append(p.name) or real(p))
    first = fp_of(model, cache_file)
    assert reads == ["model.safetensors"]
    assert fp_of(model, cache_file) == first and reads == ["model.safetensors"], "read again despite the cache"
    os.utime(model / "model.safetensors", ns=(1, 1))
    assert fp_of(model, cache_file) == first and len(reads) == 2, "a new mtime must be read again"
    moved = model.rename(tmp_path / "moved")
    assert fp_of(moved, cache_file) == first and len(reads) == 3
    assert list(json.loads(cache_file.read_text())) == [str((moved / "model.safetensors").resolve())]


def test_namespace_record_and_reuse(tmp_path):
    identity = {"dtype": "float32", "page_size": 64, "served_model_name": "tiny"}
    path, fd, removed = namespace.open_namespace(tmp_path, "0123456789abcdef", identity, "models/x", 600, now=1000.0)
    os.close(fd)
    record = json.loads((path / "namespace.json").read_text())
    assert record == {"fingerprint": "0123456789abcdef", "identity": identity, "model_path": "models/x",
                      "created": "1970-01-01T00:16:40Z", "last_used": "1970-01-01T00:16:40Z"}
    _, fd, _ = namespace.open_namespace(tmp_path, "0123456789abcdef", identity, "models/y", 600, now=2000.0)
    os.close(fd)
    record = json.loads((path / "namespace.json").read_text())
    assert record["created"] == "1970-01-01T00:16:40Z" and record["last_used"] == "1970-01-01T00:33:20Z"
    assert record["model_path"] == "models/y" and removed == 0


def test_the_store_id_names_the_directory_once_for_every_replica_that_mounts_it(tmp_path, monkeypatch):
    path, fd, _ = namespace.open_namespace(tmp_path / "disk1", "0123456789abcdef", {}, "m", 600)
    os.close(fd)
    first = namespace.store_id(path)
    assert first is not None and len(first) == 32 and namespace.store_id(path) == first, "one id per directory"
    assert sorted(p.name for p in path.iterdir()) == [".lock", "namespace.json", "store-id"], "no temp file left"
    other, fd, _ = namespace.open_namespace(tmp_path / "disk2", "0123456789abcdef", {}, "m", 600)
    os.close(fd)
    assert namespace.store_id(other) not in (None, first), "the same namespace on another disk: another store"
    assert namespace.remove(path) and not path.exists()  # `clear`
    path.mkdir()
    assert namespace.store_id(path) not in (None, first), "a cleared namespace's pages are gone: another store"
    real_link = os.link

    def raced(source, target):  # another replica linked its id between our look and our link
        (path / "store-id.theirs").write_text("e" * 32 + "\n")
        real_link(path / "store-id.theirs", target)
        real_link(source, target)

    (path / "store-id").unlink()
    monkeypatch.setattr(namespace.os, "link", raced)
    assert namespace.store_id(path) == "e" * 32
    (path / "store-id").write_text("not an id")
    assert namespace.store_id(path) is None, "unreadable: no shared credit rather than a wrong one"


def orphan(path: Path, age: float, now: float) -> Path:
    tmp = path / f".{os.urandom(16).hex()}.tmp"
    tmp.write_bytes(b"half a page")
    os.utime(tmp, (now - age, now - age))
    return tmp


def test_orphan_temp_files_alone_all_with_a_running_replica_only_old_ones(tmp_path):
    now = time.time()
    path = tmp_path / "0123456789abcdef"
    path.mkdir()
    keep = [path / "x.tmp", path / "namespace.json.77.new", path / "page_tiny_0_1.bin"]
    for file in keep:
        file.write_bytes(b"")
    fresh, old = orphan(path, 5, now), orphan(path, 3600, now)
    replica = os.open(path / namespace.LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(replica, fcntl.LOCK_SH)  # another prefill runs and may be writing `fresh` right now
    _, fd, removed = namespace.open_namespace(tmp_path, path.name, {}, "m", orphan_tmp_age=600)
    assert removed == 1 and fresh.exists() and not old.exists()
    os.close(fd)
    os.close(replica)
    _, fd, removed = namespace.open_namespace(tmp_path, path.name, {}, "m", orphan_tmp_age=600)
    assert removed == 1 and not fresh.exists(), "no other writer: every temp file is an orphan"
    assert all(file.exists() for file in keep)
    assert namespace.in_use(path), "the starting worker holds its shared lock"
    os.close(fd)
    assert not namespace.in_use(path)


def populate(base: Path, fp: str, pages: int, model: str = "tiny") -> Path:
    identity = {"served_model_name": model, "dtype": "float32", "kv_cache_dtype": "auto", "page_size": 64}
    path, fd, _ = namespace.open_namespace(base, fp, identity, "models/tiny", 600)
    os.close(fd)
    for i in range(pages):
        (path / f"{i:064x}_{model}_0_1.bin").write_bytes(b"\0" * 1024)
    return path


def test_cli_list_and_clear(tmp_path, capsys):
    a = populate(tmp_path, "aaaaaaaaaaaaaaaa", 3)
    b = populate(tmp_path, "bbbbbbbbbbbbbbbb", 1, model="other")
    (tmp_path / "not-a-namespace").mkdir()
    assert cli.main(["list", "--dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["FINGERPRINT", "MODEL", "DTYPE", "KV"] and len(lines) == 3
    assert lines[1].split()[:7] == ["aaaaaaaaaaaaaaaa", "tiny", "float32", "auto", "64", "3", "3.0KiB"]
    assert lines[1].split()[-1] == "idle" and lines[2].split()[1] == "other"
    assert cli.main(["list", "--dir", str(tmp_path), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["fingerprint"], r["files"], r["bytes"]) for r in rows] == [("aaaaaaaaaaaaaaaa", 3, 3072),
                                                                            ("bbbbbbbbbbbbbbbb", 1, 1024)]

    assert cli.main(["clear", "--dir", str(tmp_path), "--namespace", "cccccccccccccccc"]) == 1
    assert cli.main(["clear", "--dir", str(tmp_path), "--namespace", "../etc"]) == 1
    assert cli.main(["clear", "--dir", str(tmp_path), "--namespace", "aaaaaaaaaaaaaaaa"]) == 0
    assert not a.exists() and b.exists()
    worker = os.open(b / namespace.LOCK, os.O_RDONLY)
    fcntl.flock(worker, fcntl.LOCK_SH)
    assert cli.main(["clear", "--dir", str(tmp_path), "--all"]) == 1, "a running worker's namespace stays"
    assert b.exists() and "in use by a running worker" in capsys.readouterr().err
    os.close(worker)
    assert cli.main(["clear", "--dir", str(tmp_path), "--all"]) == 0
    assert not b.exists() and (tmp_path / "not-a-namespace").exists()


def test_cli_as_a_module(tmp_path):
    populate(tmp_path, "aaaaaaaaaaaaaaaa", 2)
    result = subprocess.run([sys.executable, "-m", "pdcluster.kvstore", "list", "--dir", str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "aaaaaaaaaaaaaaaa" in result.stdout, result.stderr


def test_hub_models_are_known_by_commit_and_pinned(tmp_path, monkeypatch):
    import huggingface_hub

    snapshot = tmp_path / "hub" / "snapshots" / ("c0ffee" * 6 + "beef")
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, revision=None, allow_patterns=None: calls.append((repo, revision, allow_patterns))
                        or str(snapshot))
    weights, pin = launch.resolve_weights("org/model", None, DigestCache(None))
    assert calls == [("org/model", None, ["config.json"])], "only config.json is fetched before SGLang starts"
    assert weights["hub"] == "org/model" and weights["commit"] == snapshot.name and pin == snapshot.name


def test_compiler_missing_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(launch.LaunchError, match="install g\\+\\+ and libssl-dev"):
        launch.build_page_hash_extension()


def test_launch_prepares_the_namespace_then_execs(tmp_path):
    """The real path: SGLang's options parsed, the namespace opened, the page-hash extension built, then exec with
    the namespace as SGLang's storage directory and the lock handed on."""
    model = make_model(tmp_path / "model")
    base = tmp_path / "kv"
    probe = ("import fcntl, os\n"
             "d = os.environ['SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR']\n"
             "print(d)\n"
             "try:\n"
             "    fcntl.flock(open(os.path.join(d, '.lock')), fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
             "    print('free')\n"
             "except BlockingIOError:\n"
             "    print('held')\n")

    def run(model_path: Path) -> subprocess.CompletedProcess:
        argv = ["launch", "--role", "prefill", "--dir", str(base), "--", sys.executable, "-c", probe,
                "sglang.launch_server", "--model-path", str(model_path), "--served-model-name", "tiny",
                "--device", "cpu", "--page-size", "64", "--hicache-io-backend", "direct"]
        return subprocess.run([sys.executable, "-m", "pdcluster.kvstore", *argv], cwd=REPO, capture_output=True,
                              text=True, timeout=300)

    result = run(model)
    assert result.returncode == 0, result.stderr
    storage_dir, lock = result.stdout.splitlines()
    [ns] = namespace.scan(base)
    assert storage_dir == str(ns.path) and lock == "held", "SGLang's process must hold the namespace's lock"
    identity = ns.record["identity"]
    assert (identity["served_model_name"], identity["page_size"], identity["layout"]) == ("tiny", 64,
                                                                                       "page_first_direct")
    assert "prefill: KV namespace" in result.stderr and "page-hash extension ready" in result.stderr

    result = run(tmp_path / "missing-model")
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"prefill: error: kv_store: model-path {tmp_path}/missing-model is not a folder"


def test_sglang_runs_in_the_launchers_interpreter_as_its_main_module(tmp_path, monkeypatch):
    """`python -m sglang.launch_server` is run in-process (no second import of torch): as `__main__`, with its
    arguments, the namespace in its environment, and its exit status returned."""
    (tmp_path / "fake_sglang_main.py").write_text(
        "import os, sys\n"
        "if __name__ == '__main__':\n"
        "    print(sys.argv[1:], os.environ['SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR'])\n"
        "    sys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(launch, "SGLANG_MAIN", "fake_sglang_main")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv(launch.STORAGE_DIR_ENV, "before")  # restored after the test: the launcher overwrites it
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = launch.run_sglang_here(["--port", "1"], {launch.STORAGE_DIR_ENV: "/kv/ns"})
    assert code == 3
    assert out.getvalue().strip() == "['--port', '1'] /kv/ns"


def test_a_directory_where_no_store_id_can_be_made_costs_the_credit_not_the_start(tmp_path):
    path = tmp_path / "ns"
    path.mkdir()
    path.chmod(0o500)  # read-only (as a full disk refuses the write too)
    try:
        if os.access(path, os.W_OK):  # root writes anyway: make the write itself fail
            (path / namespace.STORE_ID).mkdir()
        assert namespace.store_id(path) is None
    finally:
        path.chmod(0o700)
