"""routerd's prefix identity: a live request's prompt as the :class:`PrefixBlocks` the policies read.

The one place where routerd turns what the OpenAI API gives into KV blocks (settings ``prefix``,
:class:`~routerd.daemon.config.PrefixConfig`), once per request at parse:

* a completions ``prompt`` string (or the first string of a list), a chat request's messages
  rendered by :func:`routerd.tokens.chat_prompt_text` (the emulator's chat template), a gRPC
  ``RouteRequest.prompt``: **text**, hashed in chunks of ``chunk_blocks * block_size * 4`` UTF-8
  bytes (:func:`routerd.prefix.text.text_prefix_blocks`, llm-d's approximate producer), or, with
  a tokenizer (precise mode), tokenized and hashed per block of token ids;
* a completions prompt of token ids (or the first list of a batch of them): one block per
  ``block_size`` ids (:func:`routerd.prefix.text.token_prefix_blocks`), as vLLM caches them.

Only the first ``max_prompt_tokens`` tokens' worth is hashed: the text is cut to that many
bytes' worth of characters *before* it is encoded (a character is at least one byte), so a 1 MB
prompt costs what ``max_prompt_tokens`` tokens cost. Keys start from root 0, as
:func:`routerd.prefix.text.stored_block_keys` chains a vLLM ``BlockStored`` event without a
parent, so precise mode's engine index and these blocks agree.

Precise mode is not wired to the engines' KV events yet: :func:`build_prefix_identity` says so
once and matches as approximate mode does (with the ``bytes`` tokenizer, on token blocks). The
engine index plugs in here: :attr:`PrefixIdentity.source` becomes ``"precise"`` and the views
answer ``engine_cached_blocks``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal, Protocol, Sequence

import numpy as np

from routerd.errors import ConfigError
from routerd.prefix.chain import PrefixBlocks
from routerd.prefix.text import byte_token_array, text_prefix_blocks, token_prefix_blocks
from routerd.tokens import BYTES_PER_TOKEN

if TYPE_CHECKING:
    from routerd.daemon.config import PrefixConfig

log = logging.getLogger("routerd.prefix")

PrefixSource = Literal["approximate", "precise"]

#: What a request's prompt is for its prefix: text, token ids, or nothing (no identity).
PromptInput = str | Sequence[int] | np.ndarray | None


class Tokenizer(Protocol):
    """A prompt tokenizer for precise mode."""

    name: str
    max_chars_per_token: int
    """Most characters one token covers: the text is cut to ``max_prompt_tokens`` times this many
    characters before it is tokenized (bounding the cost of huge prompts)."""

    def encode(self, text: str) -> Sequence[int] | np.ndarray:
        """Token ids of ``text``."""
        ...


class ByteTokenizer:
    """The emulator's deterministic tokenizer (:func:`routerd.prefix.text.byte_token_array`):
    4 UTF-8 bytes per token, so a token covers at most 4 characters."""

    name = "bytes"
    max_chars_per_token = BYTES_PER_TOKEN

    def encode(self, text: str) -> np.ndarray:
        return byte_token_array(text)


class PrefixIdentity:
    """How routerd turns prompts into :class:`PrefixBlocks` (settings ``prefix``).

    Args:
        cfg: the ``prefix`` settings.
        block_size: KV block size (tokens): ``cfg.block_size`` or the profile's.
        tokenizer: precise mode's tokenizer; None: text chunks (approximate identity).

    Attributes:
        mode: ``off``, ``approximate`` or ``precise`` (the setting).
        source: where matches are believed from: ``approximate`` (each policy's dispatch
            history) until the engine index is wired, then ``precise``; None when ``off``.
            It labels ``phasewise_prefix_match_blocks``.
        identity: ``text`` (chunks of UTF-8 bytes) or ``tokens`` (blocks of token ids) for text
            prompts; token-id prompts are always blocks of token ids.
        max_blocks: blocks hashed at most per prompt (``max_prompt_tokens // block_size``, whole
            chunks for text).
    """

    def __init__(self, cfg: "PrefixConfig", block_size: int, tokenizer: Tokenizer | None = None) -> None:
        self.mode = cfg.mode
        self.block_size = block_size
        self.chunk_blocks = cfg.chunk_blocks
        self.tokenizer = tokenizer if cfg.mode == "precise" else None
        self.identity: Literal["text", "tokens"] = "tokens" if self.tokenizer is not None else "text"
        self.source: PrefixSource | None = None if cfg.mode == "off" else "approximate"
        self.max_tokens = cfg.max_prompt_tokens
        self.max_blocks = cfg.max_prompt_tokens // block_size
        self._text_blocks = self.max_blocks // self.chunk_blocks * self.chunk_blocks
        self._text_bytes = self._text_blocks * block_size * BYTES_PER_TOKEN
        self._token_limit = self.max_blocks * block_size

    @property
    def enabled(self) -> bool:
        """Whether prompts get a prefix at all (mode not ``off``)."""
        return self.mode != "off"

    def blocks_for(self, prompt: PromptInput) -> PrefixBlocks | None:
        """The prompt's leading KV blocks: text (``str``) or token ids (a list of ints or an
        integer ndarray); None for mode ``off``, no prompt, or token ids outside 0 .. 2^32 - 1
        (vLLM refuses those itself; the request is routed on load). Never raises."""
        if self.mode == "off" or prompt is None:
            return None
        bs = self.block_size
        if isinstance(prompt, str):
            tok = self.tokenizer
            if tok is None:
                # Cut before encoding: each character is >= 1 byte, so this many characters
                # hold at least the bytes hashed (all of them when the text is shorter).
                return text_prefix_blocks(prompt[: self._text_bytes], bs, self._text_blocks,
                                          chunk_blocks=self.chunk_blocks)
            try:
                ids = tok.encode(prompt[: self.max_tokens * tok.max_chars_per_token])
            except Exception as e:  # noqa: BLE001 - a tokenizer failure must not fail the request
                log.warning("prefix tokenizer %s failed (%s: %s); this request has no prefix", tok.name,
                            type(e).__name__, e)
                return None
            prompt = ids
        try:
            return token_prefix_blocks(prompt[: self._token_limit], bs, self.max_blocks)
        except (ValueError, TypeError):
            return None


def prefix_block_size(cfg: "PrefixConfig", profile_block_size: int, profile_name: str) -> int:
    """The block size prefixes are hashed with: ``cfg.block_size`` or the profile's.

    Raises:
        ConfigError: ``prefix.block_size`` differs from the profile's (the policies count a
            match's tokens in the profile's blocks).
    """
    bs = cfg.block_size
    if bs is None or bs == profile_block_size:
        return profile_block_size
    raise ConfigError(f"prefix.block_size: {bs} differs from the block_size {profile_block_size} of profile "
                      f"{profile_name!r}; the policies count cached tokens in the profile's blocks: give a profile "
                      "with vLLM's --block-size, or leave prefix.block_size unset")


def resolve_tokenizer(cfg: "PrefixConfig", *, say: bool = True) -> Tokenizer | None:
    """Precise mode's tokenizer from ``cfg.tokenizer``: ``bytes`` -> :class:`ByteTokenizer`;
    ``""`` or a tokenizer file -> None (not wired yet: text chunks), said in the log if ``say``."""
    if cfg.mode != "precise":
        return None
    spec = cfg.tokenizer
    if spec == "bytes":
        return ByteTokenizer()
    if say and spec:
        log.warning("prefix.tokenizer %r: Hugging Face tokenizers are not wired into routerd yet; hashing prompt "
                    "text in chunks as prefix.mode approximate does", spec)
    elif say:
        log.warning("prefix.mode precise without prefix.tokenizer: hashing prompt text in chunks as prefix.mode "
                    "approximate does")
    return None


def build_prefix_identity(cfg: "PrefixConfig", profile_block_size: int, profile_name: str, *,
                          say: bool = True) -> PrefixIdentity:
    """The :class:`PrefixIdentity` of ``cfg`` for a profile; ``say``: log what precise mode lacks
    (once per start, and per reload that changes the ``prefix`` settings).

    Raises:
        ConfigError: see :func:`prefix_block_size`.
    """
    bs = prefix_block_size(cfg, profile_block_size, profile_name)
    if cfg.mode != "precise":
        return PrefixIdentity(cfg, bs)
    if say:
        # The one place the engine index is to be wired (issue 14): until then, precise mode
        # is approximate matching, said once.
        log.warning("prefix.mode precise: routerd does not read the instances' KV events yet; each policy "
                    "matches prompts against its own approximate index")
    return PrefixIdentity(cfg, bs, resolve_tokenizer(cfg, say=say))


def kv_events_address(url_host: str, configured: str | None, port: int) -> str | None:
    """The ZMQ address of an endpoint's KV-event publisher: ``configured`` when given (``""``:
    none), else ``tcp://<the URL's host>:<port>`` (vLLM's default ``tcp://*:5557``, dialled at
    the instance)."""
    if configured is not None:
        return configured or None
    if not url_host:
        return None
    host = f"[{url_host}]" if ":" in url_host and not url_host.startswith("[") else url_host
    return f"tcp://{host}:{port}"
