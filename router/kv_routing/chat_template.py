"""A chat request's prompt as SGLang 0.5.23 renders it, for its token ids (router/kv_routing/prompt_ids.py).

SGLang (serving_chat.py's `_apply_jinja_template`) turns each message into the dict its pydantic model dumps, with
the keys of no value left out; a list of text parts becomes one text, the parts joined by a space, unless the
template iterates a message's content (its "openai" content format: then the parts stay a list; a tool message's
are joined all the same); the arguments of an assistant's tool calls are parsed from their JSON text; a last
assistant message becomes a user's, or, with `continue_final_message`, is taken out and its text encoded after the
rendered prompt (without a BOS). Then transformers' `apply_chat_template(..., add_generation_prompt=True,
tools=...)` renders the model's Jinja template, with its named special tokens as variables, and encodes the text
with no special tokens added. A template that fails with the tools is tried again with each tool's function alone.

Done here with jinja2 and the `tokenizers` library, not transformers (seconds to import, and its memory), in the
environment transformers builds (`_compile_jinja_template`): sandboxed (the template is the model folder's, data to
this router), trim_blocks and lstrip_blocks, loop controls, its `tojson`, `raise_exception` and `strftime_now`.
Anything this cannot follow gives None, never an error: the request is routed by its text.

Not followed (a wrong guess costs a worse route, never an answer): a model SGLang gives a built-in template by its
path, `--chat-template`, and the templates SGLang replaces with Python code (GLM-5.3).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import orjson
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger("pdcluster.router")

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the special tokens a template reads by name
# A chat with more text is not rendered (None: routed by its text): rendering is linear in it (~3 ms a MiB), on the
# event loop, and a body may hold 16 MiB. Only the first MAX_CHARS of the rendered text are encoded in any case.
MAX_CHAT_CHARS = 1 << 20
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TEXT_PART_TYPES = ("text", "input_text")


@dataclass(frozen=True)
class Rendered:
    text: str
    continued: str | None  # the final assistant message's text, continued (encoded after `text`, without a BOS)


@dataclass(frozen=True)
class ChatTemplate:
    templates: dict[str, jinja2.Template]  # by name: "default", and "tool_use" if the model has one
    special: dict[str, str]  # bos_token ... as text
    parts_list: bool  # the template iterates a message's content: text parts stay a list (SGLang's "openai" format)
    reads_call_ids: bool  # SGLang may reorder the tool results of such a template: not followed

    def render(self, body: Mapping[str, Any]) -> Rendered | None:
        try:
            return self._render(body)
        except Exception:  # a template's raise_exception, a sandbox refusal, a body this module does not follow
            return None

    def _render(self, body: Mapping[str, Any]) -> Rendered | None:
        dumped = [_message(m, self.parts_list) for m in body["messages"]]
        messages = [m for m in dumped if m is not None]
        if len(messages) < len(dumped) or (self.reads_call_ids and any(m["role"] == "tool" for m in messages)):
            return None
        if sum(map(_chars, messages)) > MAX_CHAT_CHARS:
            return None
        continued = None
        last = messages[-1]
        if last["role"] == "assistant" and isinstance(last["content"], str):
            if body.get("continue_final_message"):
                continued = last["content"]
                messages.pop()
            else:
                messages[-1] = {"role": "user", "content": last["content"]}
        if not messages:
            return None  # transformers refuses an empty conversation
        tools = _tools(body)
        switches = body.get("chat_template_kwargs") or {}  # enable_thinking, thinking (SGLang passes them on)
        template = self.templates["tool_use" if tools is not None and "tool_use" in self.templates else "default"]
        try:
            text = self._with(template, messages, tools, switches)
        except Exception:
            if not tools:
                raise
            text = self._with(template, messages, [t.get("function", t) for t in tools], switches)
        return Rendered(text, continued)

    def _with(self, template: jinja2.Template, messages: list, tools: list[dict] | None, switches: dict) -> str:
        return template.render(messages=messages, tools=tools, documents=None, add_generation_prompt=True,
                               **switches, **self.special)


def _message(message: Any, parts_list: bool) -> dict[str, Any] | None:
    """The dict SGLang's message model dumps, None values left out (process_content_for_template_format)."""
    if not isinstance(message, dict) or not isinstance(role := message.get("role"), str):
        return None
    content = message.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        texts = [p["text"] for p in content
                 if isinstance(p, dict) and p.get("type") in TEXT_PART_TYPES and isinstance(p.get("text"), str)]
        if len(texts) != len(content):
            return None  # an image or another part: not a text-only prompt
        content = ([{"type": "text", "text": t} for t in texts] if parts_list and role != "tool"
                   else " ".join(texts))
    elif not isinstance(content, str):
        return None
    if role == "user":  # its model has no other field
        return {"role": role, "content": content}
    if any(message.get(k) is not None for k in ("phase", "tools", "prefix")):
        return None  # the router refuses these; a template reads them in ways not followed here
    out: dict[str, Any] = {"role": role, "content": content}
    for key in ("tool_call_id", "name", "reasoning_content"):
        if message.get(key) is not None:
            out[key] = message[key]
    if message.get("tool_calls") is not None:
        out["tool_calls"] = [_call(call) for call in message["tool_calls"]]
    if isinstance(content, list):
        out["content"] = out.pop("content")  # SGLang puts a list of parts last (a template may render the dict)
    return out


def _chars(message: dict[str, Any]) -> int:
    content = message["content"]
    return len(content) if isinstance(content, str) else sum(len(part["text"]) for part in content)


def _call(call: dict[str, Any]) -> dict[str, Any]:
    """A ToolCall dumped, its arguments parsed (SGLang's normalize_assistant_tool_call_arguments)."""
    function = call["function"]
    arguments = orjson.loads(function["arguments"])
    if not isinstance(arguments, dict):
        raise ValueError("arguments: not a JSON object")  # a 400 from SGLang
    return {"id": call.get("id"), "index": call.get("index"), "type": call.get("type", "function"),
            "function": {"name": function.get("name"), "arguments": arguments}}


def _tools(body: Mapping[str, Any]) -> list[dict] | None:
    """The request's tools as SGLang dumps them for the template: none when tool_choice is none, the named one."""
    tools, choice = body.get("tools"), body.get("tool_choice", "auto")
    if not tools or choice == "none":
        return None
    if isinstance(choice, dict):
        tools = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
    return [_tool(t) for t in tools] or None


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    """SGLang's Tool dumped: its function's fields in the client's order, `strict` only if given a value, the missing
    fields of description, name and parameters after them as null, and the tool's own `defer_loading`."""
    given = tool["function"]
    function = {k: v for k, v in given.items() if v is not None or k not in ("strict", "defer_loading")}
    for key in ("description", "name", "parameters"):
        function.setdefault(key, None)
    return {"type": tool.get("type", "function"), "function": function, "defer_loading": None}


# --- loading ---------------------------------------------------------------------------------------------------------

class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}` block (it marks the assistant's tokens): rendered as its body."""

    tags = {"generation"}  # noqa: RUF012  # jinja2's own declaration: a set on the class

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env


def load(folder: Path) -> ChatTemplate | None:
    """The folder's chat template, compiled (once per model: PromptTokens keeps it), or None if it has none."""
    config = _json(folder / "tokenizer_config.json")
    sources = _sources(folder, config)
    if "default" not in sources:
        return None
    env = _environment()
    special = {**_special(_json(folder / "special_tokens_map.json")), **_special(config)}
    default = sources["default"]
    return ChatTemplate({name: env.from_string(text) for name, text in sources.items()}, special,
                        _iterates_content(env, default), "tool_call_id" in default)


def _sources(folder: Path, config: dict[str, Any]) -> dict[str, str]:
    """As transformers reads them: chat_template.jinja (and additional_chat_templates/), else tokenizer_config's."""
    if (file := folder / "chat_template.jinja").is_file():
        extra = folder / "additional_chat_templates"
        named = {p.stem: p.read_text() for p in sorted(extra.glob("*.jinja"))} if extra.is_dir() else {}
        return {**named, "default": file.read_text()}
    template = config.get("chat_template")
    if isinstance(template, str):
        return {"default": template}
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template if isinstance(t, dict)}
    return {}


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _special(config: dict[str, Any]) -> dict[str, str]:
    """Named special tokens, as text (a saved AddedToken is a dict with its `content`)."""
    out = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[name] = value
    return out


def _iterates_content(env: jinja2.Environment, source: str) -> bool:
    """SGLang's detect_jinja_template_content_format: "openai" for a template naming a medium, or looping over
    `message.content` (or msg's, m's); "string" otherwise."""
    if any(word in source for word in ("image", "audio", "video", "vision")):
        return True
    try:
        tree = env.parse(source)
    except jinja2.TemplateError:
        return False
    return any(_content_of(loop.iter) for loop in tree.find_all(jinja2.nodes.For))


def _content_of(node: jinja2.nodes.Node) -> bool:
    if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
        return _content_of(node.node)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _content_of(node.node)
    if isinstance(node, jinja2.nodes.Getitem):
        named = isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    elif isinstance(node, jinja2.nodes.Getattr):
        named = node.attr == "content"
    else:
        return False
    return named and isinstance(node.node, jinja2.nodes.Name) and node.node.name in ("message", "msg", "m")
