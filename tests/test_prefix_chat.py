"""routerd's chat template renderer (routerd.prefix.chat), checked against texts written by hand
from the templates' own definitions; tests/realvllm/test_prefix_precise_real.py checks the same
renderer token for token against a real vLLM."""

from __future__ import annotations

import json

import pytest

from routerd.prefix.chat import ChatTemplateError, ChatUnsupported, load_chat_template

LLAMAISH = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
            "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# Iterates over content parts: vLLM keeps content as a list of {"type": "text"} parts for it.
PARTS = ("{% for m in messages %}[{{ m.role }}]{% for c in m.content %}({{ c.text }}){% endfor %}"
         "{% endfor %}")
STRICT = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
          "{{ raise_exception('role ' + m['role'] + ' is not allowed') }}{% endif %}{{ m['content'] }}|{% endfor %}")
TOOLS = "{{ tools | tojson }}/{{ documents | tojson }}/{{ flavour }}/{% for m in messages %}{{ m.content }}{% endfor %}"


def _folder(tmp_path, template=None, *, jinja=None, cfg_extra=None):
    cfg = {"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False}, **(cfg_extra or {})}
    if template is not None:
        cfg["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return tmp_path


def test_renders_messages_with_special_tokens_and_generation_prompt(tmp_path):
    t = load_chat_template(_folder(tmp_path, LLAMAISH))
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    # String content format: text parts joined with a newline; eos_token given as an AddedToken object.
    assert t.render(msgs) == "<s><|system|>\nbe brief</s>\n<|user|>\na\nb</s>\n<|assistant|>\n"
    assert t.render(msgs, {"add_generation_prompt": False}) == "<s><|system|>\nbe brief</s>\n<|user|>\na\nb</s>\n"


def test_chat_template_jinja_wins_over_the_config_and_lists_pick_default(tmp_path):
    folder = _folder(tmp_path, [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}])
    assert load_chat_template(folder).render([{"role": "user", "content": "x"}]) == "D"
    (folder / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert load_chat_template(folder).render([{"role": "user", "content": "x"}]) == "Jx"


def test_a_template_iterating_content_gets_parts(tmp_path):
    t = load_chat_template(_folder(tmp_path, PARTS))
    assert t.render([{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
                     ]) == "[user](hi)[assistant](a)(b)"


def test_continue_final_message_cuts_after_the_last_content(tmp_path):
    t = load_chat_template(_folder(tmp_path, LLAMAISH))
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "partial"}]
    assert t.render(msgs, {"add_generation_prompt": False, "continue_final_message": True}) == \
        "<s><|user|>\nq</s>\n<|assistant|>\npartial"


def test_developer_becomes_system_when_the_template_does_not_name_it(tmp_path):
    t = load_chat_template(_folder(tmp_path, LLAMAISH))
    got = t.render([{"role": "user", "content": "q"}, {"role": "developer", "content": "rules"}],
                   {"add_generation_prompt": False})
    # Converted, then every system message merged into one at the front (vLLM's consolidation).
    assert got == "<s><|system|>\nrules</s>\n<|user|>\nq</s>\n"


def test_request_options_reach_the_template_only_when_it_uses_them(tmp_path):
    t = load_chat_template(_folder(tmp_path, TOOLS))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    got = t.render([{"role": "user", "content": "x"}],
                   {"tools": tools, "documents": [{"title": "t", "text": "é"}],
                    "chat_template_kwargs": {"flavour": "mint", "unused": 1}})
    # tojson keeps non-ASCII and HTML characters as they are (transformers' filter).
    assert got == json.dumps(tools) + '/[{"title": "t", "text": "é"}]/mint/x'


def test_errors_are_one_line_and_name_the_cause(tmp_path):
    t = load_chat_template(_folder(tmp_path, STRICT))
    with pytest.raises(ChatTemplateError, match="role system is not allowed"):
        t.render([{"role": "system", "content": "x"}])
    with pytest.raises(ChatUnsupported, match=r"messages\[0\]\.content\[1\] is a 'image_url' part"):
        t.render([{"role": "user", "content": [{"type": "text", "text": "x"},
                                               {"type": "image_url", "image_url": {"url": "data:"}}]}])
    with pytest.raises(ChatUnsupported, match=r"messages\[0\] is not an object"):
        t.render(["hello"])
    with pytest.raises(ChatTemplateError) as e:
        load_chat_template(_folder(tmp_path, "{% for x in %}"))
    assert "tokenizer_config.json (chat_template)" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ChatTemplateError, match="tokenizer_config.json cannot be read as JSON"):
        load_chat_template(tmp_path)


def test_a_folder_without_a_template_has_none(tmp_path):
    assert load_chat_template(_folder(tmp_path)) is None
    assert load_chat_template(tmp_path / "missing") is None


def test_the_sandbox_refuses_unsafe_attribute_access(tmp_path):
    t = load_chat_template(_folder(tmp_path, "{{ messages.__class__.__mro__ }}"))
    with pytest.raises(ChatTemplateError):
        t.render([{"role": "user", "content": "x"}])
