"""OpenAI's Conversations API on the router's store (router/openai/conversations_routes.py), with the official openai
client against fake workers, on SQLite and a real PostgreSQL: a conversation's items are the turns before a response's
input, and the response's input and output are added to it; items listed in order (both ways, by page), added, read and
deleted; each owner's conversations its own; bad bodies a 400 naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest

from router.config import StoreConfig
from tests.fakes import Behaviour, FakeWorker
from tests.unit.test_responses import client, router


@pytest.fixture(scope="module")
def stored_url(tmp_path_factory):
    """One router with a store for the tests that only send refused bodies."""
    folder = tmp_path_factory.mktemp("store")
    with router(store=StoreConfig(url=f"sqlite+aiosqlite:///{folder}/responses.db")) as url:
        yield url


def text(item) -> str:
    """An item's text: as given (a string), or its first part's."""
    return item.content if isinstance(item.content, str) else item.content[0].text


def test_a_conversation_holds_the_turns_of_its_responses(store_config):
    decode = FakeWorker(Behaviour(tokens=["Paris"]))
    with router(decode, store_config) as url:
        alice = client(url)
        conversation = alice.conversations.create(items=[{"type": "message", "role": "user", "content": "Hi"}],
                                                  metadata={"topic": "geo"})
        assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "geo"}
        first = alice.responses.create(model="m", input="Capital of France?", conversation=conversation.id)
        assert first.conversation.id == conversation.id
        second = alice.responses.create(model="m", input="And Italy?", conversation={"id": conversation.id},
                                        stream=True)
        *_, last = second
        assert last.response.output_text == "Paris"
        assert decode.received[1]["messages"] == [
            {"role": "user", "content": "Hi"}, {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris"}, {"role": "user", "content": "And Italy?"}]

        oldest_first = alice.conversations.items.list(conversation.id, order="asc").data
        assert [(item.role, text(item)) for item in oldest_first] == [
            ("user", "Hi"), ("user", "Capital of France?"), ("assistant", "Paris"), ("user", "And Italy?"),
            ("assistant", "Paris")]
        assert all(item.type == "message" and item.id.startswith("msg_") for item in oldest_first)
        newest_first = alice.conversations.items.list(conversation.id, limit=2)
        assert [item.id for item in newest_first.data] == [item.id for item in oldest_first[::-1][:2]]
        assert newest_first.has_more
        rest = alice.conversations.items.list(conversation.id, after=newest_first.data[-1].id).data
        assert [item.id for item in rest] == [item.id for item in oldest_first[::-1][2:]]

        added = alice.conversations.items.create(conversation.id, items=[
            {"type": "message", "role": "user", "content": "Thanks"}]).data
        assert alice.conversations.items.retrieve(added[0].id, conversation_id=conversation.id).content == "Thanks"
        assert alice.conversations.items.delete(added[0].id, conversation_id=conversation.id).id == conversation.id
        with pytest.raises(openai.NotFoundError):
            alice.conversations.items.retrieve(added[0].id, conversation_id=conversation.id)
        assert alice.conversations.retrieve(conversation.id).metadata == {"topic": "geo"}
        assert alice.conversations.delete(conversation.id).deleted
        with pytest.raises(openai.NotFoundError):
            alice.conversations.retrieve(conversation.id)
        with pytest.raises(openai.NotFoundError) as gone:
            alice.responses.create(model="m", input="x", conversation=conversation.id)
        assert gone.value.body["param"] == "conversation"


def test_another_owners_conversation_is_not_found(tmp_path):
    with router(store=StoreConfig(url=f"sqlite+aiosqlite:///{tmp_path}/responses.db")) as url:
        alice, bob = client(url, "alice"), client(url, "bob")
        conversation = alice.conversations.create()
        item = {"type": "message", "role": "user", "content": "x"}
        for attempt in (lambda: bob.conversations.retrieve(conversation.id),
                        lambda: bob.conversations.delete(conversation.id),
                        lambda: bob.conversations.items.list(conversation.id),
                        lambda: bob.conversations.items.create(conversation.id, items=[item]),
                        lambda: bob.responses.create(model="m", input="x", conversation=conversation.id)):
            with pytest.raises(openai.NotFoundError):
                attempt()
        assert alice.conversations.items.list(conversation.id).data == []  # nothing was added


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/conversations", {"items": [{"type": "reasoning"}]}, "items[0].type"),
    ("/v1/conversations", {"items": [{"role": "user", "content": "x"}] * 21}, "items"),
    ("/v1/conversations", {"metadata": {"k": 1}}, "metadata"),
    ("/v1/conversations", {"name": "x"}, "name"),
    ("/v1/conversations/conv_1/items", {}, "items"),
    ("/v1/responses", {"input": "x", "conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation"),
])
def test_a_bad_body_is_a_400_naming_the_field(stored_url, path, body, param):
    answer = httpx.post(f"{stored_url}{path}", json=body, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
