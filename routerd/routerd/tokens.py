"""Prompt-token counting shared by routerd and the emulator, without a tokenizer.

Routers that do not run the model's tokenizer estimate prompt length from the text
size (llm-d's endpoint picker and vLLM production-stack estimate ~4 bytes per token
for English BPE vocabularies; Llama-2's tokenizer averages 3.6-4.2 characters per
token on English chat text). One estimator used on both sides keeps routerd's
bookkeeping and the emulator's KV accounting consistent.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

#: UTF-8 bytes per token of the estimate.
BYTES_PER_TOKEN = 4


def count_text_tokens(text: str) -> int:
    """Estimated tokens of ``text`` (>= 1): ceil(UTF-8 bytes / :data:`BYTES_PER_TOKEN`)."""
    n = len(text.encode("utf-8", errors="replace"))
    return max(1, -(-n // BYTES_PER_TOKEN))


def chat_prompt_text(messages: Iterable[Mapping[str, Any]]) -> str:
    """The text a chat template would feed the model, approximated as ``role: content`` lines.

    ``content`` may be a string or a list of OpenAI content parts; only ``text``
    parts count. Raises ``ValueError`` naming the message index when a message is not
    an object or its content has the wrong type.
    """
    lines: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be an object")
        content = m.get("content", "")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, Mapping):
                    raise ValueError(f"messages[{i}].content[{j}] must be an object")
                if part.get("type") == "text":
                    text = part.get("text", "")
                    if not isinstance(text, str):
                        raise ValueError(f"messages[{i}].content[{j}].text must be a string")
                    parts.append(text)
            content = "".join(parts)
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts")
        lines.append(f"{m.get('role', 'user')}: {content}")
    return "\n".join(lines)
