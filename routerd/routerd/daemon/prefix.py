"""routerd's prefix identity: a live request's prompt as the :class:`PrefixBlocks` the policies read.

The one place where routerd turns what the OpenAI API gives into KV blocks (settings ``prefix``,
:class:`~routerd.daemon.config.PrefixConfig`), once per request at parse, from a
:class:`PrefixInput` (:func:`routerd.daemon.proxy.prompt_of` builds it):

* a completions ``prompt`` string (or the first string of a list), a chat request's messages, a
  gRPC ``RouteRequest.prompt``: **text**, hashed in chunks of ``chunk_blocks * block_size * 4``
  UTF-8 bytes (:func:`routerd.prefix.text.text_prefix_blocks`, llm-d's approximate producer;
  chat as :func:`routerd.tokens.chat_prompt_text` renders it), or, with a tokenizer (precise
  mode), tokenized and hashed per block of token ids;
* a completions prompt of token ids (or the first list of a batch of them): one block per
  ``block_size`` ids (:func:`routerd.prefix.text.token_prefix_blocks`), as vLLM caches them.

Only the first ``max_prompt_tokens`` tokens' worth is hashed: the text is cut to that many
bytes' worth of characters *before* it is encoded (a character is at least one byte), so a 1 MB
prompt costs what ``max_prompt_tokens`` tokens cost. Keys start from root 0, as
:func:`routerd.prefix.text.stored_block_keys` chains a vLLM ``BlockStored`` event without a
parent, so precise mode's engine index and these blocks agree.

Precise mode (a tokenizer loaded, :mod:`routerd.prefix.tokenize`): prompts become blocks of the
token ids the engine caches, typed :class:`EngineKeyed`, and each endpoint's view answers
``engine_cached_blocks`` for them from its KV-event index (:mod:`routerd.prefix.engine_index`,
fed by :mod:`routerd.daemon.kv_events`), keyed in that engine's own block size
(:meth:`EngineKeyed.at`). Chat requests are rendered with the model's chat template
(:mod:`routerd.prefix.chat`, from the tokenizer's model folder) and tokenized without special
tokens, as vLLM does; with the emulator's ``bytes`` tokenizer both sides render chat with
:func:`routerd.tokens.chat_prompt_text`. What precise mode cannot key falls back to the
policies' approximate index, said once in the log and counted in
``phasewise_prefix_identity_problems_total{reason}``: no tokenizer (``no_tokenizer``: none
configured, the ``tokenizers`` package missing, a missing or bad file), a model folder without a usable chat template
(``chat_template``), a template that fails to render a request (``chat_render``), a chat message
part that is not text (``chat_unsupported``: vLLM salts image blocks with their hashes), a
tokenizer failure (``tokenizer``).

**What may share KV.** vLLM salts a block's hash with the LoRA adapter serving the request and
the request's ``cache_salt`` (:func:`routerd.prefix.text.request_extra_keys`); keys here carry
the same salts, so requests that cannot share KV never score each other's blocks, in the engine
indexes and in the policies' approximate indexes alike. Whether a request's ``model`` is an
adapter is :attr:`PrefixIdentity.lora_of`'s answer (routerd's model lists: an id whose
``/v1/models`` card has a ``parent``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Sequence

import numpy as np
import xxhash

from routerd.prefix.chain import PrefixBlocks
from routerd.prefix.text import request_extra_keys, text_prefix_blocks, token_prefix_blocks
from routerd.prefix.tokenize import BYTES, Tokenizer, TokenizerUnavailable, load_tokenizer
from routerd.tokens import BYTES_PER_TOKEN

if TYPE_CHECKING:
    from routerd.daemon.config import PrefixConfig

log = logging.getLogger("routerd.prefix")

PrefixSource = Literal["approximate", "precise"]

#: Why a request's prompt was not keyed as precise mode keys it (``phasewise_prefix_identity_problems_total``).
PROBLEM_REASONS = ("no_tokenizer", "chat_template", "chat_render", "chat_unsupported", "tokenizer")


@dataclass(frozen=True, slots=True)
class PrefixInput:
    """What a request's prefix is computed from (:func:`routerd.daemon.proxy.prompt_of`).

    Attributes:
        prompt: a completions prompt: text, or token ids; None for chat.
        messages: a chat request's ``messages`` (None for completions).
        request: the chat request's body, for its template options (``add_generation_prompt``,
            ``continue_final_message``, ``chat_template_kwargs``, ``tools``, ``documents``).
        chat_text: the chat messages as :func:`routerd.tokens.chat_prompt_text` renders them (the
            approximate identity and the emulator's template).
        model: the request's ``model`` (an adapter's name salts its blocks).
        cache_salt: the request's ``cache_salt`` (vLLM salts its first block with it).
    """

    prompt: str | Sequence[int] | np.ndarray | None = None
    messages: Sequence[Mapping[str, Any]] | None = None
    request: Mapping[str, Any] | None = None
    chat_text: str | None = None
    model: str | None = None
    cache_salt: str | None = None

    @property
    def chat(self) -> bool:
        return self.messages is not None


#: What a request's prompt is for its prefix: a :class:`PrefixInput`, or (the gRPC front, tests)
#: bare text or token ids, or nothing (no identity).
PromptInput = PrefixInput | str | Sequence[int] | np.ndarray | None


@dataclass(frozen=True, slots=True)
class EngineKeyed(PrefixBlocks):
    """A prompt's blocks keyed from the token ids the engine caches (:func:`token_prefix_blocks`, with
    the request's extra keys), so comparable with the keys an engine index derives from vLLM's
    ``BlockStored`` events. Only these are matched against an endpoint's KV-event index; text-chunk
    identities never are.

    The extents are in routerd's block size (the profile's: what the policies count a match in);
    :meth:`at` keys the same tokens in another block size, an engine's own.
    """

    ids: Any = field(default=None, compare=False)
    """The prompt's leading token ids (uint32 array, at most ``prefix.max_prompt_tokens``)."""
    block_size: int = field(default=0, compare=False)
    """Tokens per block of :attr:`extents`."""
    lora: str | None = field(default=None, compare=False)
    """The LoRA adapter the request names (None: the base model)."""
    salt: str | None = field(default=None, compare=False)
    """The request's ``cache_salt`` (None: none)."""
    prompt_tokens: int | None = field(default=None, compare=False)
    """The prompt's exact token count when the whole prompt was tokenized (None: cut, or unknown)."""
    _sizes: dict = field(default_factory=dict, compare=False, repr=False)

    def at(self, block_size: int) -> PrefixBlocks:
        """The same tokens keyed in blocks of ``block_size`` tokens (cached per size; ``self`` for
        its own size). Never raises for a size >= 1."""
        if block_size == self.block_size or self.ids is None:
            return self
        got = self._sizes.get(block_size)
        if got is None:
            n = len(self.ids) // block_size
            got = self._sizes[block_size] = token_prefix_blocks(
                self.ids, block_size, n, extra_keys=request_extra_keys(self.lora, self.salt, n))
        return got


def _token_ids(ids: Any) -> np.ndarray:
    """``ids`` as a flat uint32 array.

    Raises:
        ValueError: not a flat sequence of integers in 0 .. 2^32 - 1.
    """
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError("token ids must be a flat sequence")
    if not arr.size:
        return np.zeros(0, dtype=np.uint32)
    if arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) >= 1 << 32:
        raise ValueError("token ids must be integers in 0 .. 2**32 - 1")
    return arr.astype(np.uint32, copy=False)


def _approximate_root(lora: str | None, salt: str | None) -> int:
    """The chain root of an approximate identity: 0 for plain requests, else a hash of the adapter
    and salt (their text-chunk keys then never meet a plain request's)."""
    if not lora and not salt:
        return 0
    return xxhash.xxh64_intdigest(repr(("lora", lora, "cache_salt", salt)).encode("utf-8", "backslashreplace"))


class PrefixIdentity:
    """How routerd turns prompts into :class:`PrefixBlocks` (settings ``prefix``).

    Args:
        cfg: the ``prefix`` settings.
        block_size: KV block size (tokens) of the policies' view: the profile's.
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
        lora_of: ``lora_of(model)``: the adapter a request for ``model`` runs under (its name),
            or None for a base model. Set by the daemon from its model lists; default: none.
        on_problem: called with one of :data:`PROBLEM_REASONS` when a request could not be keyed
            as precise mode keys it (the daemon counts it).
    """

    def __init__(self, cfg: "PrefixConfig", block_size: int, tokenizer: Tokenizer | None = None) -> None:
        self.mode = cfg.mode
        self.block_size = block_size
        self.chunk_blocks = cfg.chunk_blocks
        self.tokenizer = tokenizer if cfg.mode == "precise" else None
        self.identity: Literal["text", "tokens"] = "tokens" if self.tokenizer is not None else "text"
        self.source: PrefixSource | None = (None if cfg.mode == "off" else
                                            "precise" if self.tokenizer is not None else "approximate")
        tok = self.tokenizer
        self.chat_template = getattr(tok, "chat_template", None)
        self.chat_keyed = tok is not None and (tok.name == BYTES or self.chat_template is not None)
        """Whether chat requests get engine keys: with the emulator's tokenizer (whose chat template,
        :func:`routerd.tokens.chat_prompt_text`, routerd renders too) or a model folder's template."""
        self.lora_of: Callable[[str], str | None] = lambda model: None
        self.on_problem: Callable[[str], None] | None = None
        # A model folder without a usable chat template is said when the tokenizer loads
        # (resolve_tokenizer); its chat requests are only counted.
        self._said: set[str] = {"chat_template"} if getattr(tok, "chat_template_error", None) else set()
        self.max_tokens = cfg.max_prompt_tokens
        self.max_blocks = cfg.max_prompt_tokens // block_size
        self._text_blocks = self.max_blocks // self.chunk_blocks * self.chunk_blocks
        self._text_bytes = self._text_blocks * block_size * BYTES_PER_TOKEN
        self._token_limit = self.max_blocks * block_size

    @property
    def enabled(self) -> bool:
        """Whether prompts get a prefix at all (mode not ``off``)."""
        return self.mode != "off"

    def _problem(self, reason: str, message: str) -> None:
        if self.on_problem is not None:
            self.on_problem(reason)
        if reason not in self._said:
            self._said.add(reason)
            log.warning("prefix.mode precise: %s; such requests are matched against the approximate index "
                        "(phasewise_prefix_identity_problems_total{reason=\"%s\"}; said once)", message, reason)

    def _text(self, text: str, root: int) -> PrefixBlocks:
        # Cut before encoding: each character is >= 1 byte, so this many characters hold at
        # least the bytes hashed (all of them when the text is shorter).
        return text_prefix_blocks(text[: self._text_bytes], self.block_size, self._text_blocks, root=root,
                                  chunk_blocks=self.chunk_blocks)

    def blocks_for(self, prompt: PromptInput, chat: bool = False) -> PrefixBlocks | None:
        """The prompt's leading KV blocks. ``prompt``: a :class:`PrefixInput`, or bare text (``chat``:
        a chat request's rendered messages) or token ids (a list of ints or an integer ndarray).
        Token blocks are :class:`EngineKeyed`. None for mode ``off``, no prompt, or token ids outside
        0 .. 2^32 - 1 (vLLM refuses those itself; the request is routed on load). Never raises."""
        if self.mode == "off" or prompt is None:
            return None
        if self.mode == "precise" and self.tokenizer is None and self.on_problem is not None:
            self.on_problem("no_tokenizer")  # said once at start (resolve_tokenizer)
        inp = prompt if isinstance(prompt, PrefixInput) else (
            PrefixInput(chat_text=prompt, messages=()) if chat and isinstance(prompt, str) else PrefixInput(prompt))
        lora = self.lora_of(inp.model) if inp.model else None
        salt = inp.cache_salt if isinstance(inp.cache_salt, str) and inp.cache_salt else None
        if inp.chat:
            text, tok = self._chat_text(inp)
        elif isinstance(inp.prompt, str):
            text, tok = inp.prompt, self.tokenizer
        else:
            text, tok = None, None  # token ids (or none)
        if text is not None:
            if tok is None:
                return self._text(text, _approximate_root(lora, salt))
            try:
                # vLLM adds special tokens (BOS) to completions prompts, not to chat (its template does).
                ids: Any = tok.encode(text, self._token_limit, add_special_tokens=not inp.chat)
            except Exception as e:  # noqa: BLE001 - a tokenizer failure must not fail the request
                self._problem("tokenizer", f"the tokenizer {tok.name} failed ({type(e).__name__}: {e})")
                return self._text(text, _approximate_root(lora, salt))
        elif inp.prompt is None:
            return None
        else:
            ids = inp.prompt
        try:
            arr = _token_ids(ids[: self._token_limit])
            bs = self.block_size
            n = min(len(arr) // bs, self.max_blocks)
            pb = token_prefix_blocks(arr, bs, self.max_blocks, extra_keys=request_extra_keys(lora, salt, n))
        except (ValueError, TypeError, OverflowError):
            return None
        exact = len(arr) if len(arr) < self._token_limit else None
        return EngineKeyed(pb.extents, pb.num_blocks, pb.tail, pb.unit, arr, bs, lora, salt, exact)

    def _chat_text(self, inp: PrefixInput) -> tuple[str, Tokenizer | None]:
        """A chat request's prompt text and the tokenizer to key it with (None: match it as text):
        the model's template rendering with a model tokenizer (counted and said when it cannot),
        :func:`routerd.tokens.chat_prompt_text`'s with the emulator's ``bytes`` (its template)."""
        text, tok = inp.chat_text or "", self.tokenizer
        if tok is None or tok.name == BYTES:
            return text, tok
        template = self.chat_template
        if template is None:
            self._problem("chat_template", f"the tokenizer {tok.name} comes without a usable chat template "
                          f"({getattr(tok, 'chat_template_error', None) or 'none found'}), so chat requests' "
                          "token ids would not be the engine's")
            return text, None
        if not inp.messages:
            return text, tok
        from routerd.prefix.chat import ChatTemplateError, ChatUnsupported

        try:
            return template.render(inp.messages, inp.request), tok
        except ChatUnsupported as e:
            self._problem("chat_unsupported", f"a chat request routerd cannot render ({e})")
        except ChatTemplateError as e:
            self._problem("chat_render", f"the chat template failed to render a request ({e})")
        return text, None


def resolve_tokenizer(cfg: "PrefixConfig", *, say: bool = True) -> Tokenizer | None:
    """Precise mode's tokenizer from ``cfg.tokenizer`` (:func:`routerd.prefix.tokenize.load_tokenizer`:
    ``bytes``, a model folder or a ``tokenizer.json``); None outside precise mode, or when none can be loaded: then
    prompts are hashed as text chunks and matched as ``approximate`` mode does, said in the log if
    ``say`` (why, in one line)."""
    if cfg.mode != "precise":
        return None
    try:
        tok = load_tokenizer(cfg.tokenizer)
    except TokenizerUnavailable as e:
        if say:
            log.warning("prefix.mode precise: prefix.tokenizer: %s; matching prompt text against the approximate "
                        "index instead, as prefix.mode approximate does (each such request is counted in "
                        "phasewise_prefix_identity_problems_total{reason=\"no_tokenizer\"})", e)
        return None
    why = getattr(tok, "chat_template_error", None)
    if say and why:
        log.warning("prefix.mode precise: prefix.tokenizer %s: %s; chat requests are matched against the approximate "
                    "index (completions are keyed on the tokenizer's ids)", cfg.tokenizer, why)
    return tok


def build_prefix_identity(cfg: "PrefixConfig", profile_block_size: int, profile_name: str, *,
                          say: bool = True) -> PrefixIdentity:
    """The :class:`PrefixIdentity` of ``cfg`` for a profile (prompts keyed in the profile's block
    size, what the policies count in; engines' own sizes are :meth:`EngineKeyed.at`'s business);
    ``say``: log what precise mode lacks (once per start, and per reload that changes the
    ``prefix`` settings)."""
    return PrefixIdentity(cfg, profile_block_size, resolve_tokenizer(cfg, say=say))


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
