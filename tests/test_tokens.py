"""Prompt-token estimate: ceil(bytes / 4), chat messages flattened."""

import re

import pytest

from routerd.tokens import chat_prompt_text, count_text_tokens


@pytest.mark.parametrize("text,expected", [("", 1), ("abcd", 1), ("abcde", 2), ("é" * 4, 2), ("x" * 4000, 1000)])
def test_count_text_tokens(text, expected):
    # "é" is two UTF-8 bytes: 8 bytes -> 2 tokens.
    assert count_text_tokens(text) == expected


def test_chat_prompt_text_joins_roles_and_text_parts():
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "image_url"}, {"type": "text", "text": "there"}]}]
    assert chat_prompt_text(msgs) == "system: be brief\nuser: hi there"


@pytest.mark.parametrize("msgs,where", [([1], "messages[0]"), ([{"content": 5}], "messages[0].content"),
                                        ([{"content": [3]}], "messages[0].content[0]")])
def test_chat_prompt_text_names_the_bad_message(msgs, where):
    with pytest.raises(ValueError, match="^" + re.escape(where) + " must"):
        chat_prompt_text(msgs)
