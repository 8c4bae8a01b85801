"""A stored conversation in a real PostgreSQL (the session's, tests/conftest.py) through the real PD pair, as routers
sharing one store serve it (the chart's replicas, `store.backend: postgresql`): a chain of 10 turns by
`previous_response_id`, whose router process is restarted in the middle and which a second router process over the
same workers and database then continues. Every turn answers with what the same conversation gets sent whole (its
items as input, nothing stored), token for token at temperature 0: each turn's input was rebuilt exactly, whichever
router stored the turns before it. Each turn is found by either router and by no other tenant, and the prefill's radix
cache holds the conversation's earlier turns (cached tokens)."""

from __future__ import annotations

import hashlib
import itertools
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from pdcluster.local.process import Process
from tests.e2e_smollm2.conftest import BOOTSTRAP_PORT, REPO, healthy_workers
from tests.e2e_smollm2.test_tools import MODEL
from tests.e2e_smollm2.traffic import PAGE
from tests.helpers import until

PORTS = {"store-a": 12002, "store-b": 12003}
KEYS = {"alice": "alice-key", "bob": "bob-key"}
QUESTIONS = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?", "Name a river there.",
             "How long is it?", "Name a famous painter from Italy.", "What did he paint?", "Where is it now?",
             "Can I visit it?", "Thank you. Say goodbye."]
RESTART_BEFORE, SECOND_FROM = 4, 7  # turn 4: the first router restarted; from turn 7: the second router
# Sent with every turn, as agents send theirs (they are not carried over): every prompt is more than a page.
INSTRUCTIONS = ("You are a friendly travel guide for Europe. Answer each question of the visitor in one short "
                "sentence, with the names of places, rivers and people as they are written in English, and never ask "
                "a question back. When the visitor thanks you, wish them a good trip.")
TURN = {"model": MODEL, "temperature": 0, "max_output_tokens": 16, "instructions": INSTRUCTIONS}


class StoreRouter:
    """A router process of its own over the cluster's workers, whose store is the test's PostgreSQL database."""

    def __init__(self, name: str, config: Path, log_dir: Path) -> None:
        self.url = f"http://127.0.0.1:{PORTS[name]}"
        self.process = Process(name, [sys.executable, "-m", "router", "--config", str(config), "--host", "127.0.0.1",
                                      "--port", str(PORTS[name]), "--bootstrap-url",
                                      f"http://127.0.0.1:{BOOTSTRAP_PORT}"], log_dir / f"{name}.log")

    def start(self) -> None:
        self.process.start()
        with httpx.Client(base_url=self.url, timeout=30) as client:
            assert until(lambda: len(healthy_workers(client)) == 2, 300, 0.5), self.process.tail(40)

    def stop(self) -> None:
        if not self.process.running:
            return
        self.process.signal(signal.SIGTERM)
        try:
            self.process.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.popen.kill()
            self.process.popen.wait()

    def client(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=300)


@pytest.fixture
def routers(cluster, postgres, tmp_path):
    """Two routers' processes (not started), one config: the shipped router's, its store a fresh database of the
    session's PostgreSQL, two tenants by key."""
    config = yaml.safe_load((REPO / "configs" / "router.yaml").read_text())
    config["store"] = {"backend": "postgresql", "url": postgres.new_database()}
    config["tenants"] = {name: {"key_sha256": [hashlib.sha256(key.encode()).hexdigest()]} for name, key in KEYS.items()}
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    both = [StoreRouter(name, path, cluster.log_dir) for name in PORTS]
    yield both
    for one in both:
        one.stop()


def test_a_ten_turn_chain_in_postgresql_survives_a_restart_and_continues_on_a_second_router(cluster, routers):
    first, second = routers
    first.start()
    turns, previous = [], None
    for i, question in enumerate(QUESTIONS):
        if i == RESTART_BEFORE:  # the same database: the chain goes on
            first.stop()
            first.start()
        if i == SECOND_FROM:
            second.start()
        via = second if i >= SECOND_FROM else first
        turn = via.client("alice").responses.create(input=question, previous_response_id=previous, store=True, **TURN)
        assert turn.output_text.strip(), (i, turn)
        turns.append(turn)
        previous = turn.id

    for router in (first, second):
        for turn in turns:
            assert router.client("alice").responses.retrieve(turn.id).output_text == turn.output_text
        with pytest.raises(openai.NotFoundError):
            router.client("bob").responses.retrieve(turns[-1].id)
    with pytest.raises(openai.NotFoundError):  # nor can another tenant continue it
        second.client("bob").responses.create(input="Go on.", previous_response_id=turns[-1].id, **TURN)

    # The same conversation sent whole each turn (the outputs given back as items, as clients do), nothing stored.
    items: list[dict] = []
    whole = openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="unused", max_retries=0, timeout=300)
    for i, (question, turn) in enumerate(zip(QUESTIONS, turns, strict=True)):
        items.append({"role": "user", "content": question})
        reference = whole.responses.create(input=items, store=False, **TURN)
        assert (turn.output_text, turn.usage.input_tokens, turn.usage.output_tokens) == (
            reference.output_text, reference.usage.input_tokens, reference.usage.output_tokens), i
        items += [item.model_dump(exclude_none=True) for item in turn.output]

    # Each turn's prompt starts with the one before it, which the prefill computed a moment ago: its radix cache holds
    # that prompt's whole pages (across the router's restart and on the second router: the workers kept them).
    for i, (before, turn) in enumerate(itertools.pairwise(turns), start=1):
        cached, earlier = turn.usage.input_tokens_details.cached_tokens, before.usage.input_tokens
        print(f"turn {i}: {cached} of {turn.usage.input_tokens} prompt tokens cached; the turn before had {earlier}")
        assert earlier // PAGE * PAGE <= cached < turn.usage.input_tokens and cached > 0, (i, cached, earlier)
