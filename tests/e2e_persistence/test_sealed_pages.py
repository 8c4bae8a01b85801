"""A KV page on disk that went bad never changes an answer. The prefill runs with a cluster secret; prompts are stored,
then every page of two prompts is damaged in each way (the second half of the file overwritten with random bytes of
the same size, the file cut to half, pages swapped between two prompts, another prompt's KV written under the page's
name by a writer without the secret, with another secret, and with the cluster's key id but a guessed secret). Asked
again with the prefill's memory flushed, every answer is token for token the undamaged one, each damaged page was
rejected once with its reason on the prefill's /metrics, and the pages were written again, sealed, and serve the
next request from disk.

One restart of both workers (to give them the secret), on whatever model the cluster runs: the decode writes no page
here (8 generated tokens complete none), but it shares the prefill's namespace, whose workers the bootstrap service
admits only with one secret (bootstrap/registry.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdcluster.kvstore.page_seal import TRAILER_SIZE, PageSeal
from tests.e2e.reference import ReferenceModel, assert_matches
from tests.e2e_persistence.conftest import PAGE, greedy_ids, prompt_ids

MAX_NEW = 8
PAGES = 600 // PAGE  # whole pages of a 600-token prompt
SECRET = b"e2e cluster secret " + os.urandom(16).hex().encode()


def overwrite_half(files: list[Path], seal: PageSeal, donor: list[bytes]) -> None:
    for f in files:
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2] + os.urandom(len(data) - len(data) // 2))


def truncate(files: list[Path], seal: PageSeal, donor: list[bytes]) -> None:
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def reseal(key: bytes | None, forge_key_id: bool = False):
    """Another prompt's KV under each page's name, sealed by a writer holding `key` instead of the cluster secret."""

    def damage(files: list[Path], seal: PageSeal, donor: list[bytes]) -> None:
        writer = PageSeal(seal.namespace, key)
        if forge_key_id:
            writer.key_id = seal.key_id  # copied from any stored page's trailer
        for f, body in zip(files, donor, strict=True):
            f.write_bytes(body + writer.trailer(f.name.removesuffix(".bin"), body))

    return damage


# name -> (damage of one prompt's pages, the reason each page is rejected for); "swap" pairs its two prompts.
DAMAGES = {
    "overwrite": (overwrite_half, "format"),  # the trailer is in the second half: no seal left
    "truncate": (truncate, "size"),
    "swap": (None, "digest"),
    "unkeyed": (reseal(None), "secret"),
    "other-secret": (reseal(b"not the cluster secret"), "secret"),
    "forged": (reseal(b"a guess", forge_key_id=True), "digest"),
}


@pytest.fixture(scope="module")
def secret_file(pc) -> Path:
    path = pc.root / "kv-secret"
    path.write_bytes(SECRET)
    return path


@pytest.fixture(scope="module")
def reference(pc) -> ReferenceModel:
    return ReferenceModel(str(pc.model_target()))


def bins(pc) -> set[Path]:
    return {f for ns in pc.namespaces() for f in ns.iterdir() if f.name.endswith(".bin")}


def rejected(pc) -> dict[str, float]:
    text = httpx.get(f"{pc.url('prefill-0')}/metrics", timeout=30).text
    return {sample.labels["reason"]: sample.value for family in text_string_to_metric_families(text)
            if family.name == "pdcluster_kv_store_pages_rejected" for sample in family.samples
            if sample.name.endswith("_total")}


def flush(pc) -> None:
    pc.settle()  # pages still being written would land after the flush
    response = httpx.post(f"{pc.url('prefill-0')}/flush_cache", params={"timeout": 30}, timeout=60)
    assert response.status_code == 200, response.text


def test_damaged_pages_never_change_an_answer(pc, reference, secret_file):
    with_secret = ("--cluster", f"kv_store.secret_file={secret_file}")
    pc.ensure({"prefill-0": with_secret, "decode-0": with_secret}, model=pc.model_target())
    tok = reference.tokenizer
    prompts = {f"{name}-{i}": prompt_ids(tok, f"sealed-{name}-{i}", 600) for name in ["donor", *DAMAGES]
               for i in range(1 if name == "donor" else 2)}
    answers, pages = {}, {}
    for tag, ids in prompts.items():
        before = bins(pc)
        answers[tag] = pc.generate(ids, MAX_NEW).output_ids
        assert_matches(answers[tag], greedy_ids(reference, ids, MAX_NEW), reference.eos)
        pc.wait_pages(len(before) + PAGES)
        pc.settle()
        pages[tag] = sorted(bins(pc) - before)
        assert len(pages[tag]) == PAGES, (tag, pages[tag])
    seal = PageSeal(pages["donor-0"][0].parent.name, SECRET)
    assert all(seal.check_file(f) is None for f in pages["donor-0"]), "pages are sealed with the cluster secret"
    donor = [f.read_bytes()[:-TRAILER_SIZE] for f in pages["donor-0"]]

    expected: dict[str, int] = {}
    for name, (damage, reason) in DAMAGES.items():
        expected[reason] = expected.get(reason, 0) + 2 * PAGES
        if damage is None:  # page i of one prompt and page i of the other trade files
            for a, b in zip(pages[f"{name}-0"], pages[f"{name}-1"], strict=True):
                data = a.read_bytes()
                a.write_bytes(b.read_bytes())
                b.write_bytes(data)
        else:
            for i in range(2):
                damage(pages[f"{name}-{i}"], seal, donor)
    flush(pc)
    before = rejected(pc)

    damaged = [tag for tag in prompts if not tag.startswith("donor")]
    for tag in damaged:
        again = pc.generate(prompts[tag], MAX_NEW)
        assert again.output_ids == answers[tag], (tag, again)
        assert again.storage == 0, (tag, again)  # the first page of each is bad: nothing of it came from disk
    after = rejected(pc)
    assert {r: after.get(r, 0) - before.get(r, 0) for r in after if after.get(r, 0) != before.get(r, 0)} == expected

    # Recomputed and written again, sealed: the next time each comes from disk.
    flush(pc)
    for tag in damaged:
        assert all(f.exists() and seal.check_file(f) is None for f in pages[tag]), tag
        healed = pc.generate(prompts[tag], MAX_NEW)
        assert healed.storage >= (PAGES - 1) * PAGE and healed.output_ids == answers[tag], (tag, healed)
    assert rejected(pc) == after
