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

Precise mode (a tokenizer loaded, :mod:`routerd.prefix.tokenize`): prompts become blocks of
the token ids the engine caches, typed :class:`EngineKeyed`, and each endpoint's view answers
``engine_cached_blocks`` for them from its KV-event index (:mod:`routerd.prefix.engine_index`,
fed by :mod:`routerd.daemon.kv_events`). What precise mode cannot key falls back to the
policies' approximate index, said once in the log: no tokenizer (none configured, the
``tokenizers`` package missing, a bad file), and chat requests with a model's tokenizer (the
``tokenizers`` package cannot render the model's chat template, so their ids would not be
vLLM's; with the emulator's ``bytes`` tokenizer both sides render chat with
:func:`routerd.tokens.chat_prompt_text`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Sequence

import numpy as np

from routerd.errors import ConfigError
from routerd.prefix.chain import PrefixBlocks
from routerd.prefix.text import text_prefix_blocks, token_prefix_blocks
from routerd.prefix.tokenize import BYTES, Tokenizer, TokenizerUnavailable, load_tokenizer
from routerd.tokens import BYTES_PER_TOKEN

if TYPE_CHECKING:
    from routerd.daemon.config import PrefixConfig

log = logging.getLogger("routerd.prefix")

PrefixSource = Literal["approximate", "precise"]

#: What a request's prompt is for its prefix: text, token ids, or nothing (no identity).
PromptInput = str | Sequence[int] | np.ndarray | None


@dataclass(frozen=True, slots=True)
class EngineKeyed(PrefixBlocks):
    """A prompt's blocks keyed from the token ids the engine caches (:func:`token_prefix_blocks`),
    so comparable with the keys an engine index derives from vLLM's ``BlockStored`` events. Only
    these are matched against an endpoint's KV-event index; text-chunk identities never are."""


def _engine_keyed(p: PrefixBlocks) -> EngineKeyed:
    return EngineKeyed(p.extents, p.num_blocks, p.tail, p.unit)


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
        self.source: PrefixSource | None = (None if cfg.mode == "off" else
                                            "precise" if self.tokenizer is not None else "approximate")
        self.chat_keyed = self.tokenizer is not None and self.tokenizer.name == BYTES
        """Whether chat requests get engine keys: only with the emulator's tokenizer, whose chat
        template (:func:`routerd.tokens.chat_prompt_text`) routerd renders too."""
        self._said_chat = False
        self.max_tokens = cfg.max_prompt_tokens
        self.max_blocks = cfg.max_prompt_tokens // block_size
        self._text_blocks = self.max_blocks // self.chunk_blocks * self.chunk_blocks
        self._text_bytes = self._text_blocks * block_size * BYTES_PER_TOKEN
        self._token_limit = self.max_blocks * block_size

    @property
    def enabled(self) -> bool:
        """Whether prompts get a prefix at all (mode not ``off``)."""
        return self.mode != "off"

    def blocks_for(self, prompt: PromptInput, chat: bool = False) -> PrefixBlocks | None:
        """The prompt's leading KV blocks: text (``str``; ``chat``: a chat request's rendered
        messages) or token ids (a list of ints or an integer ndarray). Token blocks are
        :class:`EngineKeyed`. None for mode ``off``, no prompt, or token ids outside 0 .. 2^32 - 1
        (vLLM refuses those itself; the request is routed on load). Never raises."""
        if self.mode == "off" or prompt is None:
            return None
        bs = self.block_size
        if isinstance(prompt, str):
            tok = self.tokenizer
            if tok is not None and chat and not self.chat_keyed:
                if not self._said_chat:
                    self._said_chat = True
                    log.warning("prefix.mode precise: chat requests are matched against the approximate index "
                                "(the tokenizer %s cannot render the model's chat template, so their token ids "
                                "would not be the engine's); completions use the KV events", tok.name)
                tok = None
            if tok is None:
                # Cut before encoding: each character is >= 1 byte, so this many characters
                # hold at least the bytes hashed (all of them when the text is shorter).
                return text_prefix_blocks(prompt[: self._text_bytes], bs, self._text_blocks,
                                          chunk_blocks=self.chunk_blocks)
            try:
                # vLLM adds special tokens (BOS) to completions prompts, not to chat (its template does).
                ids = tok.encode(prompt, self._token_limit, add_special_tokens=not chat)
            except Exception as e:  # noqa: BLE001 - a tokenizer failure must not fail the request
                log.warning("prefix tokenizer %s failed (%s: %s); this request has no prefix", tok.name,
                            type(e).__name__, e)
                return None
            prompt = ids
        try:
            return _engine_keyed(token_prefix_blocks(prompt[: self._token_limit], bs, self.max_blocks))
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
    """Precise mode's tokenizer from ``cfg.tokenizer`` (:func:`routerd.prefix.tokenize.load_tokenizer`:
    ``bytes`` or a ``tokenizer.json``); None outside precise mode, or when none can be loaded: then
    prompts are hashed as text chunks and matched as ``approximate`` mode does, said in the log if
    ``say`` (why, in one line)."""
    if cfg.mode != "precise":
        return None
    try:
        return load_tokenizer(cfg.tokenizer)
    except TokenizerUnavailable as e:
        if say:
            log.warning("prefix.mode precise: %s; matching prompt text against the approximate index instead, "
                        "as prefix.mode approximate does", e)
        return None


def build_prefix_identity(cfg: "PrefixConfig", profile_block_size: int, profile_name: str, *,
                          say: bool = True) -> PrefixIdentity:
    """The :class:`PrefixIdentity` of ``cfg`` for a profile; ``say``: log what precise mode lacks
    (once per start, and per reload that changes the ``prefix`` settings).

    Raises:
        ConfigError: see :func:`prefix_block_size`.
    """
    bs = prefix_block_size(cfg, profile_block_size, profile_name)
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
