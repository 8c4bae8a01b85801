"""A chat's token ids, rendered by the router (router/kv_routing/chat_template.py, router/kv_routing/prompt_ids.py), are
the ones SGLang makes: transformers' apply_chat_template(tokenize=True, add_generation_prompt=True) of the messages as
SGLang hands them over (text parts joined by a space, a last assistant message made a user's, its tools dumped by its
models). Anything the renderer does not follow is None, never an error."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from router.checks.checked import Checked
from router.kv_routing.chat_template import MAX_CHAT_CHARS
from router.kv_routing.prompt_ids import MAX_CHARS, PromptTokens
from router.routing.policy import RoutingView

MODELS = Path(__file__).resolve().parents[2] / "models"
SMOLLM2, TINY = MODELS / "smollm2-135m-instruct", MODELS / "tiny-llama"
UNICODE = "Grüße, 世界! 🧪 naïve café — ŝ̂ e\u0301 ½ ‖ ﬁ"

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of France?"}],
    [{"role": "user", "content": "Hello there"}],  # SmolLM2's template adds its own system prompt
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
    [{"role": "user", "content": UNICODE}, {"role": "assistant", "content": UNICODE[::-1]},
     {"role": "user", "content": "  spaces  \n\n and lines \t"}],
]


def needs(folder: Path) -> None:
    if not (folder / "tokenizer.json").is_file():
        pytest.fail(f"{folder.name} is missing: `make setup` builds it")


@pytest.fixture(scope="module")
def reference():
    """transformers' tokenizer of a folder (imported once: seconds), as SGLang loads it."""
    from transformers import AutoTokenizer

    loaded: dict[Path, Any] = {}

    def get(folder: Path) -> Any:
        if folder not in loaded:
            loaded[folder] = AutoTokenizer.from_pretrained(str(folder))
        return loaded[folder]
    return get


def tokens_for(folder: Path) -> PromptTokens:
    tokens = PromptTokens()
    asyncio.run(tokens.load(str(folder)))
    return tokens


def smollm2_with_template(folder: Path, template: str) -> None:
    """SmolLM2's tokenizer in `folder`, with `template` as its chat template."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SMOLLM2 / name, folder / name)
    (folder / "chat_template.jinja").write_text(template)


def chat(body: dict[str, Any]) -> RoutingView:
    return RoutingView("/v1/chat/completions", body, Checked(None, False, "x"))


def expected(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False,
                                              **kwargs))


@pytest.mark.parametrize("folder", [SMOLLM2, TINY], ids=["smollm2", "tiny-llama"])
def test_the_ids_are_transformers_apply_chat_template(folder: Path, reference):
    needs(folder)
    tokens, tokenizer = tokens_for(folder), reference(folder)
    assert tokens.templates[str(folder)] is not None  # both models have a chat template
    for messages in CONVERSATIONS:
        assert tokens.of(chat({"messages": messages}), str(folder)) == expected(tokenizer, messages)


def test_text_parts_are_joined_by_a_space_as_sglang_flattens_them(reference):
    needs(SMOLLM2)
    parts = [{"type": "text", "text": "Summarize:"}, {"type": "text", "text": UNICODE}]
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": parts}]
    flat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Summarize: {UNICODE}"}]
    assert tokens_for(SMOLLM2).of(chat({"messages": messages}), str(SMOLLM2)) == expected(reference(SMOLLM2), flat)


def test_a_final_assistant_message_is_a_users_or_continued(reference):
    needs(SMOLLM2)
    tokens, tokenizer = tokens_for(SMOLLM2), reference(SMOLLM2)
    messages = [{"role": "user", "content": "Count to 3"}, {"role": "assistant", "content": "1, 2,"}]
    as_user = [messages[0], {"role": "user", "content": "1, 2,"}]
    assert tokens.of(chat({"messages": messages}), str(SMOLLM2)) == expected(tokenizer, as_user)
    continued = tokens.of(chat({"messages": messages, "continue_final_message": True}), str(SMOLLM2))
    assert continued == expected(tokenizer, messages[:1]) + tokenizer.encode("1, 2,")


def test_tools_are_rendered_as_sglang_dumps_them(tmp_path: Path, reference):
    needs(SMOLLM2)
    smollm2_with_template(tmp_path,
        "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}{{ c.function | tojson }}{% endfor %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tools = [{"type": "function", "function": {"parameters": {"type": "object"}, "name": "f"}},
             {"function": {"name": "g", "strict": True, "description": "d"}}]
    messages = [{"role": "user", "content": "call f"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                       "function": {"name": "f", "arguments": '{"x": 1}'}}]},
                {"role": "tool", "content": "r", "tool_call_id": "c1"}, {"role": "user", "content": "thanks"}]
    # What SGLang 0.5.23's models dump (ChatCompletionRequest(...).tools[i].model_dump(), read once from SGLang)
    dumped = [{"type": "function", "function": {"parameters": {"type": "object"}, "name": "f", "description": None},
               "defer_loading": None},
              {"type": "function", "function": {"name": "g", "strict": True, "description": "d", "parameters": None},
               "defer_loading": None}]
    sent = [messages[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "index": None, "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
            {"role": "tool", "content": "r", "tool_call_id": "c1"}, messages[3]]
    tokens, tokenizer = tokens_for(tmp_path), reference(tmp_path)
    got = tokens.of(chat({"messages": messages, "tools": tools}), str(tmp_path))
    assert got == expected(tokenizer, sent, tools=dumped)
    named = {"type": "function", "function": {"name": "g"}}
    got = tokens.of(chat({"messages": messages, "tools": tools, "tool_choice": named}), str(tmp_path))
    assert got == expected(tokenizer, sent, tools=dumped[1:])
    got = tokens.of(chat({"messages": messages, "tools": tools, "tool_choice": "none"}), str(tmp_path))
    assert got == expected(tokenizer, sent)


def test_what_the_renderer_cannot_follow_is_none(tmp_path: Path):
    needs(SMOLLM2)
    tokens = tokens_for(SMOLLM2)
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    assert tokens.of(chat({"messages": [{"role": "user", "content": [image]}]}), str(SMOLLM2)) is None
    assert tokens.of(chat({"messages": [{"role": "user", "content": 7}]}), str(SMOLLM2)) is None
    assert tokens.of(chat({"messages": [{"role": "user", "content": "hi"}]}), "/nowhere") is None  # not loaded
    smollm2_with_template(tmp_path,
        "{% if messages[0].role != 'system' %}{{ raise_exception('a system message first') }}{% endif %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}")
    raising = tokens_for(tmp_path)
    assert raising.of(chat({"messages": [{"role": "user", "content": "hi"}]}), str(tmp_path)) is None
    ok = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}
    assert raising.of(chat(ok), str(tmp_path)) == raising.tokenizers[str(tmp_path)].encode("shi", special=True)
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")  # the sandbox refuses it
    assert tokens_for(tmp_path).of(chat(ok), str(tmp_path)) is None
    (tmp_path / "chat_template.jinja").write_text("{% for %}")  # does not compile: no template, text still works
    broken = tokens_for(tmp_path)
    assert broken.templates[str(tmp_path)] is None and broken.tokenizers[str(tmp_path)] is not None
    assert broken.of(chat(ok), str(tmp_path)) is None


def test_a_long_chat_gives_the_ids_of_its_first_characters(reference):
    needs(SMOLLM2)
    long = [{"role": "system", "content": "A shared prefix. " * (MAX_CHARS // 8)}, {"role": "user", "content": "q?"}]
    ids = tokens_for(SMOLLM2).of(chat({"messages": long}), str(SMOLLM2))
    full = expected(reference(SMOLLM2), long)
    assert ids and len(ids) < len(full) and full[:len(ids)] == ids
    huge = [{"role": "user", "content": "x" * (MAX_CHAT_CHARS + 1)}]  # not rendered at all: bounded work
    assert tokens_for(SMOLLM2).of(chat({"messages": huge}), str(SMOLLM2)) is None


def test_a_template_that_wants_tools_flat_is_tried_again_with_them(tmp_path: Path, reference):
    needs(SMOLLM2)
    smollm2_with_template(tmp_path,  # as Mistral's: tools without OpenAI's wrapper
        "{% for t in tools %}{% if t.function is defined %}{{ raise_exception('flat tools only') }}{% endif %}"
        "[{{ t.name }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    got = tokens_for(tmp_path).of(chat({"messages": [{"role": "user", "content": "hi"}], "tools": tools}),
                                  str(tmp_path))
    flat = [{"name": "f", "parameters": {"type": "object"}, "description": None}]
    assert got == expected(reference(tmp_path), [{"role": "user", "content": "hi"}], tools=flat)


def test_cache_aware_routes_a_chat_by_its_ids():
    needs(SMOLLM2)
    from pdcluster.common.protocol import ModelIdentity, Role
    from router.fleet.workers import Worker
    from router.kv_routing.cache_aware import CacheAware
    from router.kv_routing.kv_wire import Stored
    from router.pd.policies import make_policy
    from tests.unit.test_cache_aware import choose

    identity = ModelIdentity(model_path=str(SMOLLM2), served_model_name="m", page_size=4, kv_cache_dtype="auto",
                             transfer_backend="mooncake")
    workers = [Worker(f"p{i}", Role.PREFILL, f"http://p{i}", "h", 9000 + i, identity=identity) for i in range(3)]
    policy = make_policy("cache_aware")
    assert isinstance(policy, CacheAware)
    asyncio.run(policy.tokens.load(str(SMOLLM2)))
    body = {"messages": CONVERSATIONS[2]}
    ids = policy.tokens.of(chat(body), str(SMOLLM2))
    assert ids is not None
    for worker_id in ("p0", "p1"):
        policy.index.open(worker_id, 4)  # indexed, holding nothing
    pages = len(ids) // 4
    policy.index.open("p2", 4).apply(Stored(tuple(range(1, pages + 1)), None, tuple(ids[:pages * 4]), 4, "GPU"))
    assert all(choose(policy, workers, chat(body)).prefill.worker_id == "p2" for _ in range(5))


def test_the_reasoning_switches_and_an_assistants_reasoning_are_rendered_as_sglang_passes_them(tmp_path, reference):
    """chat_template_kwargs' switches are the template's variables, and reasoning_content a message's field (as
    Qwen3's template reads them)."""
    needs(SMOLLM2)
    smollm2_with_template(tmp_path,
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
        "</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "A"
                 " greeting."}, {"role": "user", "content": "How are you?"}]
    tokens, tokenizer = tokens_for(tmp_path), reference(tmp_path)
    off = tokens.of(chat({"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}), str(tmp_path))
    assert off == expected(tokenizer, messages, enable_thinking=False)
    assert tokens.of(chat({"messages": messages}), str(tmp_path)) == expected(tokenizer, messages) != off
