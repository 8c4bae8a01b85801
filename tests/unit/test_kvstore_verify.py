"""`python -m pdcluster.kvstore verify`: every page's seal checked offline, the bad ones listed by reason and removed
only when asked, with the secret from --secret-file or the environment."""

from __future__ import annotations

import json

import pytest
import torch

from pdcluster.kvstore import cli
from pdcluster.kvstore.page_seal import SECRET_ENV
from tests.unit.test_kv_seal import NAMESPACE, PAGE_VALUES, page, store


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    ns = tmp_path / "kv" / NAMESPACE
    (tmp_path / "secret").write_text("verify secret")
    s = store(ns, tmp_path / "secret")
    s.batch_set([f"k{i}" for i in range(4)], [page(i) for i in range(4)])
    (ns / "namespace.json").write_text(json.dumps({"fingerprint": NAMESPACE, "identity": {}}))
    return tmp_path


def verify(base, *args):
    return cli.main(["verify", "--dir", str(base / "kv"), *args])


def test_verify_lists_bad_pages_by_reason_and_removes_them_only_when_asked(base, capsys):
    ns = base / "kv" / NAMESPACE
    secret = ["--secret-file", str(base / "secret")]
    assert verify(base, *secret) == 0
    assert "4 pages checked, 0 bad (none), 0 removed" in capsys.readouterr().out
    (ns / "k1_tiny_0_1.bin").write_bytes((ns / "k1_tiny_0_1.bin").read_bytes()[:100])
    data = bytearray((ns / "k2_tiny_0_1.bin").read_bytes())
    data[10] ^= 1
    (ns / "k2_tiny_0_1.bin").write_bytes(bytes(data))
    assert verify(base, *secret) == 1
    out = capsys.readouterr().out
    assert f"would remove {ns / 'k1_tiny_0_1.bin'} (size)" in out and "(digest)" in out
    assert "4 pages checked, 2 bad (digest: 1, size: 1), 0 removed" in out
    assert len(list(ns.glob("*.bin"))) == 4
    assert verify(base, *secret, "--namespace", NAMESPACE, "--remove") == 0
    assert "2 removed" in capsys.readouterr().out
    assert sorted(f.name for f in ns.glob("*.bin")) == ["k0_tiny_0_1.bin", "k3_tiny_0_1.bin"]
    assert torch.equal(store(ns, base / "secret").get("k3", torch.zeros(PAGE_VALUES)), page(3))


def test_verify_without_the_secret_says_so(base, capsys, monkeypatch):
    assert verify(base) == 1
    out = capsys.readouterr().out
    assert "4 bad (secret: 4)" in out and "sealed with another secret" in out
    monkeypatch.setenv(SECRET_ENV, "verify secret")
    assert verify(base) == 0
    assert verify(base, "--namespace", "ffffffffffffffff") == 1
