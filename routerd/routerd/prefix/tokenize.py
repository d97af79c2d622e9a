"""Prompt text to token ids for precise prefix routing: the emulator's byte tokenizer or a model's own.

Precise mode keys a request by the token ids the engine will cache
(:func:`routerd.prefix.text.token_prefix_blocks`), so routerd must tokenize as the engine does:

* ``"bytes"``: the emulator's deterministic tokenizer (:func:`routerd.prefix.text.byte_token_array`,
  4 UTF-8 bytes per token), what ``phasewise emulate`` caches and publishes;
* a path to a Hugging Face ``tokenizer.json``, or a model folder holding one (the folder vLLM
  serves, or a copy of its tokenizer files), the file vLLM's fast tokenizer loads, read with the
  optional ``tokenizers`` package (``pip install 'phasewise[tokenizer]'``), imported only here
  and only when asked for. A folder's chat template (``chat_template.jinja`` or
  ``tokenizer_config.json``'s ``chat_template``, :mod:`routerd.prefix.chat`) is loaded with it,
  so chat requests are keyed on the ids vLLM renders and tokenizes.

Special tokens: vLLM's completions API adds them by default (``add_special_tokens: bool = True`` in
``vllm/entrypoints/openai/completion/protocol.py``, e.g. a BOS token), its chat API does not (the
chat template writes them; ``add_special_tokens`` defaults to False in
``vllm/entrypoints/openai/chat_completion/protocol.py``). :meth:`Tokenizer.encode` defaults to the
completions rule; pass ``add_special_tokens=False`` for text a chat template rendered
(:attr:`HFTokenizer.chat_template` renders it).

Bounded work: ``max_tokens`` limits the ids returned and, for long texts, the text tokenized: only
a prefix of ``max_tokens * 8`` characters is encoded first (no tokenizer in common use averages 8
characters per token on text; byte-level BPE vocabularies average 3 to 5), and the longer text
only if that prefix gave fewer than ``max_tokens + 64`` ids. Cutting a text changes only the tokens
next to the cut (pre-tokenizers split at whitespace and punctuation; BPE, WordPiece and Unigram
merge neighbouring symbols), so the 64 ids of margin keep them out of the result: the ids are the
first ``max_tokens`` of the whole text's encoding (checked against the whole encoding in
``tests/test_prefix_tokenize.py``, with and without a pre-tokenizer). A 1 MB prompt thus costs what its first
``max_tokens`` tokens cost.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from routerd.prefix.text import byte_token_array
from routerd.tokens import BYTES_PER_TOKEN

__all__ = ["BYTES", "ByteTokenizer", "HFTokenizer", "Tokenizer", "TokenizerUnavailable", "load_tokenizer"]

#: The spec naming the emulator's byte tokenizer.
BYTES = "bytes"
#: Characters per token assumed when cutting a long text (an upper bound for real tokenizers).
CHARS_PER_TOKEN_BOUND = 8
#: Ids beyond ``max_tokens`` that a cut text must still give for its cut to be trusted.
CUT_MARGIN_TOKENS = 64


class TokenizerUnavailable(RuntimeError):
    """A tokenizer that cannot be loaded; the message is one line naming the file and why."""


class Tokenizer(Protocol):
    """What precise prefix routing needs from a tokenizer."""

    name: str
    """``"bytes"`` or the ``tokenizer.json`` path, for logs and metrics."""

    def encode(self, text: str, max_tokens: int | None = None, *, add_special_tokens: bool = True) -> np.ndarray:
        """Token ids of ``text`` (uint32, 1-D), at most ``max_tokens`` of them (None: all).

        Raises:
            ValueError: ``text`` is not a str, ``max_tokens < 0``, or the tokenizer failed.
        """
        ...


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _check(text: Any, max_tokens: int | None) -> None:
    if not isinstance(text, str):
        raise ValueError(f"can only tokenize text (str), got {type(text).__name__}")
    if max_tokens is not None and max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0 or None, got {max_tokens}")


class ByteTokenizer:
    """The emulator's tokenizer (:func:`routerd.prefix.text.byte_token_array`); it has no special
    tokens, so ``add_special_tokens`` changes nothing."""

    name = BYTES

    def encode(self, text: str, max_tokens: int | None = None, *, add_special_tokens: bool = True) -> np.ndarray:
        _check(text, max_tokens)
        if max_tokens is None:
            return byte_token_array(text)
        if max_tokens == 0:
            return np.zeros(0, dtype=np.uint32)
        # Every character is at least one UTF-8 byte (a lone surrogate becomes one "?"), so the
        # first max_tokens * 4 characters hold at least the first max_tokens * 4 bytes.
        return byte_token_array(text[: max_tokens * BYTES_PER_TOKEN])[:max_tokens]


class HFTokenizer:
    """A Hugging Face fast tokenizer loaded from ``tokenizer.json`` (see :func:`load_tokenizer`).

    Attributes:
        chat_template: the model folder's chat template (:class:`routerd.prefix.chat.ChatTemplate`),
            or None: a bare ``tokenizer.json``, a folder without one, or one that failed to load.
        chat_template_error: why the folder's template could not be loaded (one line), or None.
    """

    def __init__(self, inner: Any, name: str, chat_template: Any = None, chat_template_error: str | None = None) -> None:
        self._tok = inner
        self.name = name
        self.chat_template = chat_template
        self.chat_template_error = chat_template_error

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as e:  # tokenizers raises plain Exception from Rust
            raise ValueError(f"tokenizer {self.name} failed to encode: {_first_line(e)}") from None

    def encode(self, text: str, max_tokens: int | None = None, *, add_special_tokens: bool = True) -> np.ndarray:
        _check(text, max_tokens)
        if max_tokens is None:
            return np.asarray(self._ids(text, add_special_tokens), dtype=np.uint32)
        if max_tokens == 0:
            return np.zeros(0, dtype=np.uint32)
        cut = max_tokens * CHARS_PER_TOKEN_BOUND
        while True:
            whole = cut >= len(text)
            ids = self._ids(text if whole else text[:cut], add_special_tokens)
            if whole or len(ids) >= max_tokens + CUT_MARGIN_TOKENS:
                return np.asarray(ids[:max_tokens], dtype=np.uint32)
            cut *= 4


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer ``spec`` names: ``"bytes"``, or a ``tokenizer.json`` file or a model folder
    holding one (with its chat template, when the folder has one).

    Raises:
        TokenizerUnavailable: an empty spec, the ``tokenizers`` package missing, or a file that is
            missing, unreadable, not JSON or not a tokenizer; one line, naming the file. A chat
            template that cannot be loaded is not an error here: the tokenizer loads without it
            and says why in :attr:`HFTokenizer.chat_template_error`.
    """
    spec = spec.strip()
    if spec == BYTES:
        return ByteTokenizer()
    if not spec:
        raise TokenizerUnavailable("no tokenizer configured (set prefix.tokenizer to 'bytes', a model folder or the "
                                   "path of a tokenizer.json)")
    path = Path(spec).expanduser()
    folder = path if path.is_dir() else path.parent
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise TokenizerUnavailable(f"model folder {folder} has no tokenizer.json (routerd reads Hugging Face fast "
                                       "tokenizers)")
    if not path.is_file():
        raise TokenizerUnavailable(f"tokenizer file {path} does not exist")
    try:
        data = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = f"{type(e).__name__}: {_first_line(e)}"
        raise TokenizerUnavailable(f"tokenizer file {path} cannot be read ({why})") from None
    try:
        json.loads(data)
    except ValueError as e:
        raise TokenizerUnavailable(f"tokenizer file {path} is not JSON ({_first_line(e)})") from None
    try:
        from tokenizers import Tokenizer as _HF
    except ImportError:
        raise TokenizerUnavailable(
            f"the 'tokenizers' package is not installed, needed for {path} (pip install 'phasewise[tokenizer]')"
        ) from None
    try:
        inner = _HF.from_str(data)
    except Exception as e:  # tokenizers raises plain Exception for a file it cannot parse
        why = _first_line(e)
        raise TokenizerUnavailable(f"tokenizer file {path} is not a Hugging Face tokenizer.json ({why})") from None
    # A tokenizer.json may carry padding and truncation settings (sentence-embedding models pad
    # and cut to 128): vLLM's tokenizer applies neither to a prompt, so neither is kept here.
    inner.no_padding()
    inner.no_truncation()
    from routerd.prefix.chat import ChatTemplateError, load_chat_template

    template, why = None, None
    try:
        template = load_chat_template(folder)
    except ChatTemplateError as e:
        why = str(e)
    if template is None and why is None:
        why = f"{folder} has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json)"
    return HFTokenizer(inner, str(path), template, why)
