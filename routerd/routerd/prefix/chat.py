"""A model's chat template, rendered as vLLM renders it, so routerd keys chat requests on vLLM's token ids.

vLLM's ``/v1/chat/completions`` turns the request's ``messages`` into one prompt text with the
model's Jinja chat template, then tokenizes that text without adding special tokens (the template
writes them). Precise prefix routing must see the same token ids, so routerd renders the same
template the same way:

* **where the template comes from** (as ``transformers`` 5 loads a tokenizer folder):
  ``chat_template.jinja`` in the model folder, else ``tokenizer_config.json``'s ``chat_template``
  (a string, or a list of ``{"name", "template"}`` whose ``"default"`` entry is used). The
  special tokens the template may use (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``,
  ``sep_token``, ``cls_token``, ``mask_token``, ``additional_special_tokens``) come from
  ``tokenizer_config.json`` (strings, or ``{"content": ...}`` objects).
* **how it is rendered** (``transformers/utils/chat_template_utils.py``,
  ``_compile_jinja_template`` and ``render_jinja_template``): Jinja2's
  ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
  ``loopcontrols`` extension, a ``tojson`` filter that does not escape HTML
  (``json.dumps(x, ensure_ascii=False, ...)``), the globals ``raise_exception`` and
  ``strftime_now``; variables ``messages``, ``tools``, ``documents``, ``add_generation_prompt``
  and the special tokens; ``continue_final_message`` cuts the text right after the last
  message's content.
* **what vLLM passes** (``vllm/renderers/hf.py``, ``vllm/renderers/chat_utils.py``,
  ``vllm/entrypoints/openai/chat_completion/protocol.py``): ``add_generation_prompt`` (default
  true), ``continue_final_message`` (default false), ``documents``, the request's ``tools``, and
  its ``chat_template_kwargs`` (the request's values win over the defaults, except None and
  ``"auto"``); only the variables the template uses (or transformers' standard ones) reach it.
  Each message keeps ``role``, ``name``, ``tool_call_id``, ``tool_calls`` (string ``arguments``
  parsed as JSON), ``reasoning``; its content becomes one string, its text parts joined with
  ``"\\n"``, unless the template iterates over a message's content (vLLM's content-format
  detection, ``_detect_content_format``): then the content stays a list of ``{"type": "text",
  "text": ...}`` parts. A ``developer`` message becomes ``system`` when the template never names
  the developer role.

What is not reproduced (the request is then not keyed precisely; see :class:`ChatUnsupported`):
multimodal parts (images, audio: vLLM expands them into placeholder tokens and salts blocks
with their hashes), templates that need Python-side helpers beyond the globals above, and
``--chat-template`` overrides given to vLLM (give routerd the same template file then).

Pure Python with Jinja2 (a core dependency); no transformers, no I/O beyond loading the folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError", "ChatUnsupported", "load_chat_template"]

#: Keys of ``tokenizer_config.json`` whose values the template may use as variables.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                      "mask_token", "additional_special_tokens")
#: Parameters of transformers' ``apply_chat_template`` that vLLM lets through whatever the template
#: declares (``_get_hf_base_chat_template_params``).
_HF_PARAMS = frozenset(("conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                        "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                        "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"))
#: transformers' marker appended to the final message under ``continue_final_message``.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
#: Content part types that carry text.
_TEXT_PARTS = frozenset(("text", "input_text", "output_text", "refusal"))


class ChatTemplateError(ValueError):
    """A chat template that cannot be loaded or rendered; the message is one line naming the file
    or the template's own reason."""


class ChatUnsupported(ValueError):
    """A chat request whose prompt routerd cannot reproduce (e.g. an image part); one line."""


def _token_text(v: Any) -> Any:
    if isinstance(v, Mapping):
        return v.get("content")
    if isinstance(v, list):
        return [_token_text(x) for x in v]
    return v


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Generation(jinja2.ext.Extension):
    """transformers' ``{% generation %}`` tag (marks assistant text for training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _is_access(node: jinja2.nodes.Node, name: str, attr: str | None = None) -> bool:
    """``node`` is ``name`` (or ``name.attr`` / ``name['attr']`` when ``attr`` is given)."""
    if attr is None:
        return isinstance(node, jinja2.nodes.Name) and node.name == name
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == attr and _is_access(node.node, name)
    if isinstance(node, jinja2.nodes.Getitem):
        arg = node.arg
        return isinstance(arg, jinja2.nodes.Const) and arg.value == attr and _is_access(node.node, name)
    return False


def _iterates_content(ast: jinja2.nodes.Template) -> bool:
    """Whether the template loops over a message's content (vLLM's "openai" content format).

    A simplification of ``vllm/renderers/hf.py`` ``_detect_content_format``: a ``for`` over
    ``messages`` (or a variable assigned from it) binds a message variable; a ``for`` over that
    variable's ``content``, or over a variable assigned from it, or over a variable named
    ``content`` outside macros, means the template reads content parts.
    """
    msg_lists = {"messages"}
    for a in ast.find_all(jinja2.nodes.Assign):
        if isinstance(a.target, jinja2.nodes.Name) and any(_is_access(n, "messages") for n in a.node.find_all(
                jinja2.nodes.Name)):
            msg_lists.add(a.target.name)
    msg_vars = set()
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        if any(_is_access(it, v) or (isinstance(it, (jinja2.nodes.Getitem, jinja2.nodes.Getattr))
                                     and _is_access(it.node, v)) for v in msg_lists):
            if isinstance(loop.target, jinja2.nodes.Name):
                msg_vars.add(loop.target.name)
    content_vars = {"content"}
    for a in ast.find_all(jinja2.nodes.Assign):
        if isinstance(a.target, jinja2.nodes.Name) and any(_is_access(a.node, v, "content") for v in msg_vars):
            content_vars.add(a.target.name)
    in_macros = {id(loop) for m in ast.find_all(jinja2.nodes.Macro) for loop in m.find_all(jinja2.nodes.For)}
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        if any(_is_access(it, v, "content") for v in msg_vars):
            return True
        if isinstance(it, jinja2.nodes.Name) and it.name in content_vars and id(loop) not in in_macros:
            return True
    return False


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the variables it is rendered with.

    Attributes:
        source: where it was read (for messages).
        text: the Jinja source.
        special_tokens: ``bos_token`` and the other special tokens' text, as template variables.
    """

    source: str
    text: str
    special_tokens: Mapping[str, Any]

    @property
    def _compiled(self) -> tuple[jinja2.Template, frozenset[str], bool, bool]:
        return _compile(self.text)

    def render(self, messages: Sequence[Mapping[str, Any]], request: Mapping[str, Any] | None = None) -> str:
        """The prompt text vLLM renders for a chat request's ``messages``.

        Args:
            messages: the request's ``messages`` (OpenAI chat format).
            request: the rest of the request body (``add_generation_prompt``,
                ``continue_final_message``, ``documents``, ``tools``, ``chat_template_kwargs``);
                None: vLLM's defaults.

        Raises:
            ChatUnsupported: a message part routerd cannot reproduce (an image, audio, a file).
            ChatTemplateError: the template raised (``raise_exception``) or failed; the message
                is the template's own reason, one line.
        """
        template, declared, openai_content, developer = self._compiled
        req = request or {}
        conversation = _conversation(messages, openai_content)
        if not developer and any(m["role"] == "developer" for m in conversation):
            conversation = _developer_to_system(conversation)
        kwargs: dict[str, Any] = dict(req.get("chat_template_kwargs") or {})
        extra = {"add_generation_prompt": req.get("add_generation_prompt", True),
                 "continue_final_message": req.get("continue_final_message", False),
                 "documents": req.get("documents")}
        kwargs.update({k: v for k, v in extra.items() if v is not None and v != "auto"})
        kwargs = {k: v for k, v in kwargs.items() if k in declared or k in _HF_PARAMS}
        for k in ("chat_template", "tokenize", "conversation", "return_dict", "padding", "truncation", "max_length",
                  "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs"):
            kwargs.pop(k, None)
        add_generation_prompt = bool(kwargs.pop("add_generation_prompt", True))
        cont = kwargs.pop("continue_final_message", False)
        documents = kwargs.pop("documents", None)
        tools = req.get("tools")
        final = None
        if cont:
            field = cont if isinstance(cont, str) else "content"
            conversation = [dict(m) for m in conversation]
            last = conversation[-1] if conversation else {}
            value = last.get(field)
            if value is None:
                raise ChatTemplateError(f"continue_final_message is set but the final message has no {field!r}")
            if isinstance(value, list):
                parts = [dict(p) for p in value]
                for p in reversed(parts):
                    if "text" in p:
                        final = p["text"]
                        p["text"] = p["text"] + _CONTINUE_TAG
                        break
                else:
                    raise ChatTemplateError("continue_final_message is set but the final message has no text")
                last[field] = parts
            else:
                final = str(value)
                last[field] = final + _CONTINUE_TAG
        variables = {**self.special_tokens, **kwargs}
        try:
            text = template.render(messages=conversation, tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template {self.source}: {_one_line(e)}") from None
        except Exception as e:  # noqa: BLE001 - any failure inside a user's template is one line
            raise ChatTemplateError(f"chat template {self.source}: {type(e).__name__}: {_one_line(e)}") from None
        if cont:
            tag = _CONTINUE_TAG.strip()
            if tag not in text or (final or "").strip() not in text:
                raise ChatTemplateError(f"chat template {self.source}: continue_final_message is set but the template "
                                        "dropped part of the final message")
            loc = text.rindex(tag)
            text = text[:loc] if text[loc:loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:loc].rstrip()
        return text


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


@lru_cache(maxsize=16)
def _compile(text: str) -> tuple[jinja2.Template, frozenset[str], bool, bool]:
    env = _environment()
    try:
        ast = env.parse(text)
        template = env.from_string(text)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {_one_line(e)}") from None
    declared = frozenset(jinja2.meta.find_undeclared_variables(ast))
    developer = '"developer"' in text or "'developer'" in text
    return template, declared, _iterates_content(ast), developer


def _conversation(messages: Sequence[Mapping[str, Any]], openai_content: bool) -> list[dict[str, Any]]:
    """vLLM's parsed conversation (``vllm/renderers/chat_utils.py``), text only.

    Raises:
        ChatUnsupported: a non-text part, or a message that is not an object with a string role.
    """
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ChatUnsupported(f"messages[{i}] is not an object with a string 'role'")
        role = m["role"]
        content = m.get("content")
        if content is None:
            parts: list[str] = []
        elif isinstance(content, str):
            parts = [content]
        elif isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if isinstance(p, str):
                    parts.append(p)
                    continue
                kind = p.get("type") if isinstance(p, Mapping) else None
                if kind in _TEXT_PARTS or (kind is None and isinstance(p, Mapping) and "text" in p):
                    t = p.get("text", p.get(kind) if kind == "refusal" else None)
                    if not isinstance(t, str):
                        raise ChatUnsupported(f"messages[{i}].content[{j}] has no string text")
                    parts.append(t)
                else:
                    raise ChatUnsupported(f"messages[{i}].content[{j}] is a {kind!r} part (not text)")
        else:
            raise ChatUnsupported(f"messages[{i}].content is neither a string nor a list of parts")
        msg: dict[str, Any] = {"role": role,
                               "content": [{"type": "text", "text": t} for t in parts] if openai_content
                               else "\n".join(parts)}
        if role == "assistant":
            calls = m.get("tool_calls")
            if isinstance(calls, list) and calls:
                msg["tool_calls"] = [_tool_call(c) for c in calls]
            if m.get("reasoning") is not None:
                msg["reasoning"] = msg["reasoning_content"] = m["reasoning"]
        elif role == "tool":
            if "tool_call_id" in m:
                msg["tool_call_id"] = m["tool_call_id"]
            if openai_content:
                msg["content"] = "\n".join(parts)
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if role == "developer":
            msg["tools"] = m.get("tools")
        out.append(msg)
    return out


def _tool_call(c: Any) -> Any:
    if not isinstance(c, Mapping):
        return c
    c = dict(c)
    fn = c.get("function")
    if isinstance(fn, Mapping):
        fn = dict(fn)
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args) if args else {}
            except ValueError:
                fn["arguments"] = {}
        elif not args:
            fn["arguments"] = {}
        c["function"] = fn
    return c


def _developer_to_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's ``_convert_developer_to_system`` then ``_consolidate_system_messages``."""
    conv = []
    for m in conversation:
        if m["role"] == "developer":
            m = {k: v for k, v in m.items() if k != "tools"}
            m["role"] = "system"
        conv.append(m)
    systems, rest, merge = [], [], False
    for i, m in enumerate(conv):
        if m["role"] == "system":
            if i > 0 or systems:
                merge = True
            c = m.get("content", "")
            if isinstance(c, list):
                c = "\n".join(p["text"] for p in c if isinstance(p, Mapping) and "text" in p)
            if c:
                systems.append(c)
        else:
            rest.append(m)
    if not merge:
        return conv
    return [{"role": "system", "content": "\n\n".join(systems)}, *rest]


def load_chat_template(folder: str | Path) -> ChatTemplate | None:
    """The chat template of a Hugging Face model folder, or None when it has none.

    Raises:
        ChatTemplateError: a ``chat_template.jinja`` or ``tokenizer_config.json`` that cannot be
            read, is not UTF-8 / JSON, or holds a template that does not compile (one line,
            naming the file).
    """
    folder = Path(folder).expanduser()
    cfg_path = folder / "tokenizer_config.json"
    cfg: dict[str, Any] = {}
    if cfg_path.is_file():
        try:
            loaded = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ChatTemplateError(f"{cfg_path} cannot be read as JSON ({type(e).__name__}: {_one_line(e)})") from None
        if isinstance(loaded, dict):
            cfg = loaded
    text: Any = None
    source = ""
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        try:
            text = jinja_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"{jinja_path} cannot be read ({type(e).__name__}: {_one_line(e)})") from None
        source = str(jinja_path)
    else:
        text = cfg.get("chat_template")
        source = f"{cfg_path} (chat_template)"
        if isinstance(text, list):
            named = {t.get("name"): t.get("template") for t in text if isinstance(t, Mapping)}
            text = named.get("default")
    if text is None:
        return None
    if not isinstance(text, str):
        raise ChatTemplateError(f"{source}: the chat template is not a string")
    try:
        _compile(text)
    except ChatTemplateError as e:
        raise ChatTemplateError(f"{source}: {e}") from None
    specials = {k: _token_text(cfg[k]) for k in SPECIAL_TOKEN_KEYS if k in cfg}
    return ChatTemplate(source, text, specials)
