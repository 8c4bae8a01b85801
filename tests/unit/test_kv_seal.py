"""The sealed KV store (pdcluster/kvstore/backend.py) on SGLang's real HiCacheFile, no worker: every kind of damage
reads as a miss with its reason counted and the file removed, a good page round-trips, a keyed page is refused by a
worker without the secret (and the reverse), and a write that fails is counted and leaves nothing behind."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from pdcluster.kvstore import metrics
from pdcluster.kvstore.backend import SealedFileStorage
from pdcluster.kvstore.page_seal import SECRET_ENV, TRAILER_SIZE, PageSeal, SecretError, load_secret

NAMESPACE = "0123456789abcdef"
PAGE_VALUES = 1024  # float32: 4 KiB pages


@pytest.fixture(autouse=True)
def _no_ambient(monkeypatch):
    for var in ("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE", SECRET_ENV,
                "PROMETHEUS_MULTIPROC_DIR"):
        monkeypatch.delenv(var, raising=False)


def store(path, secret_file=None) -> SealedFileStorage:
    extra = {"file_storage_path": str(path), **({"secret_file": str(secret_file)} if secret_file else {})}
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                  model_name="tiny", extra_config=extra)
    return SealedFileStorage(config, {})


def page(seed: int) -> torch.Tensor:
    return torch.randn(PAGE_VALUES, generator=torch.Generator().manual_seed(seed))


def rejected(reason: str) -> float:
    return metrics.counters()["rejected"].labels(reason=reason)._value.get()


def write_failures(reason: str) -> float:
    return metrics.counters()["write_failed"].labels(reason=reason)._value.get()


def read(s: SealedFileStorage, key: str) -> torch.Tensor | None:
    return s.batch_get([key], [torch.zeros(PAGE_VALUES)])[0]


@pytest.fixture
def ns(tmp_path):
    return tmp_path / NAMESPACE


def test_a_page_round_trips_with_a_trailer_and_is_found(ns):
    s = store(ns)
    assert s.batch_set(["k1", "k2"], [page(1), page(2)])
    files = sorted(ns.glob("*.bin"))
    assert [f.name for f in files] == ["k1_tiny_0_1.bin", "k2_tiny_0_1.bin"]
    assert all(f.stat().st_size == PAGE_VALUES * 4 + TRAILER_SIZE for f in files)
    assert s.batch_exists(["k1", "k2", "k3"]) == 2
    assert torch.equal(read(s, "k1"), page(1)) and torch.equal(read(s, "k2"), page(2))
    assert torch.equal(store(ns).get("k2", torch.zeros(PAGE_VALUES)), page(2)), "a restarted worker reads it"


def damage_overwrite(ns, s):
    f = ns / "k1_tiny_0_1.bin"
    data = bytearray(f.read_bytes())
    half = PAGE_VALUES * 4 // 2
    data[half:PAGE_VALUES * 4] = os.urandom(PAGE_VALUES * 4 - half)  # same size, trailer untouched
    f.write_bytes(bytes(data))


def damage_truncate(ns, s):
    f = ns / "k1_tiny_0_1.bin"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def damage_swap(ns, s):
    a, b = ns / "k1_tiny_0_1.bin", ns / "k2_tiny_0_1.bin"
    tmp = ns / "swap"
    os.replace(a, tmp)
    os.replace(b, a)
    os.replace(tmp, b)


def damage_raw(ns, s):  # what SGLang's own file storage writes: the page without a seal
    (ns / "k1_tiny_0_1.bin").write_bytes(page(9).numpy().tobytes() + b"\0" * TRAILER_SIZE)


def damage_other_namespace(ns, s):  # a good page of the same key, sealed for another namespace
    other = ns.parent / "fedcba9876543210"
    store(other).set("k1", page(1))
    shutil.copy(other / "k1_tiny_0_1.bin", ns / "k1_tiny_0_1.bin")


@pytest.mark.parametrize(("damage", "reason"), [
    (damage_overwrite, "digest"), (damage_truncate, "size"), (damage_swap, "digest"), (damage_raw, "format"),
    (damage_other_namespace, "digest"),
])
def test_a_damaged_page_is_a_miss_counted_and_removed(ns, damage, reason):
    s = store(ns)
    s.batch_set(["k1", "k2"], [page(1), page(2)])
    damage(ns, s)
    before = rejected(reason)
    assert read(s, "k1") is None
    assert rejected(reason) == before + 1
    assert not (ns / "k1_tiny_0_1.bin").exists(), "removed: recomputed and rewritten next time"
    assert s.batch_exists(["k1"]) == 0
    assert s.set("k1", page(1)) and torch.equal(read(s, "k1"), page(1))


def test_a_batch_rejects_every_bad_page_not_just_the_first(ns):
    s = store(ns)
    keys = [f"p{i}" for i in range(4)]
    s.batch_set(keys, [page(i) for i in range(4)])
    for key in keys[1:]:
        f = ns / f"{key}_tiny_0_1.bin"
        f.write_bytes(os.urandom(f.stat().st_size))
    before = rejected("format") + rejected("secret") + rejected("digest")
    got = s.batch_get(keys, [torch.zeros(PAGE_VALUES) for _ in keys])
    assert torch.equal(got[0], page(0)) and got[1:] == [None, None, None]
    assert rejected("format") + rejected("secret") + rejected("digest") == before + 3
    assert sorted(f.name for f in ns.glob("*.bin")) == ["p0_tiny_0_1.bin"]


def test_with_a_secret_only_its_holders_pages_are_served(ns, tmp_path):
    secret, other = tmp_path / "secret", tmp_path / "other"
    secret.write_bytes(os.urandom(32).hex().encode() + b"\n")
    other.write_text("another secret")
    keyed = store(ns, secret)
    keyed.set("k1", page(1))
    assert torch.equal(read(store(ns, secret), "k1"), page(1))
    before = rejected("secret")
    assert read(store(ns, other), "k1") is None and rejected("secret") == before + 1
    store(ns).set("k2", page(2))  # a writer without the secret
    assert read(keyed, "k2") is None and rejected("secret") == before + 2
    # A forger who copies the key id but not the secret: its digest cannot match.
    forged = PageSeal(NAMESPACE, b"guess")
    forged.key_id = keyed.seal.key_id
    data = page(3).numpy().tobytes()
    (ns / "k3_tiny_0_1.bin").write_bytes(data + forged.trailer("k3_tiny_0_1", data))
    digest = rejected("digest")
    assert read(keyed, "k3") is None and rejected("digest") == digest + 1


def test_a_failed_write_is_counted_and_leaves_no_file(ns):
    s = store(ns)
    shutil.rmtree(ns)  # the directory gone under the worker
    before = write_failures("ENOENT")
    assert s.set("k1", page(1)) is False
    assert write_failures("ENOENT") == before + 1
    ns.mkdir()
    if os.geteuid() != 0:  # root writes through permission bits
        ns.chmod(0o555)
        assert s.set("k1", page(1)) is False and write_failures("EACCES") >= 1
        ns.chmod(0o755)
    assert not list(ns.iterdir())
    assert s.set("k1", page(1)) and torch.equal(read(s, "k1"), page(1))


def test_the_bound_still_evicts_least_recently_used_pages(ns, monkeypatch):
    page_file = PAGE_VALUES * 4 + TRAILER_SIZE
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE", str(3 * page_file))
    s = store(ns)
    for i in range(5):
        assert s.set(f"k{i}", page(i))
    assert sorted(f.name for f in ns.glob("*.bin")) == [f"k{i}_tiny_0_1.bin" for i in (2, 3, 4)]


def test_the_secret_comes_from_its_file_or_the_environment(tmp_path):
    assert load_secret(None, env={}) is None
    assert load_secret(None, env={SECRET_ENV: " s3cret \n"}) == b"s3cret"
    (tmp_path / "s").write_text("from-file\n")
    assert load_secret(str(tmp_path / "s"), env={SECRET_ENV: "env"}) == b"from-file"
    (tmp_path / "empty").write_text("\n")
    for bad in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(SecretError):
            load_secret(str(bad))


def test_sglangs_backend_factory_loads_it_from_the_workers_extra_config(ns, tmp_path):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from pdcluster.kvstore import wiring

    extra = {**wiring.extra_config('{"prefetch_threshold": 64}', None), "file_storage_path": str(ns)}
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                  model_name="tiny", extra_config=extra)
    backend = StorageBackendFactory.create_backend(wiring.BACKEND, config, None)
    assert isinstance(backend, SealedFileStorage) and backend.seal.namespace == NAMESPACE
    assert backend.set("k1", page(1)) and torch.equal(read(backend, "k1"), page(1))
