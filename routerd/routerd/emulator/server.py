"""Start and stop an emulator: settings, engine, metrics and the aiohttp server together."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from routerd.cli import DEFAULT_PROFILE
from routerd.emulator.engine import Engine, FixedTimingEngine, SimEngine
from routerd.emulator.kv_events import KVEventsConfig, ZmqEventPublisher
from routerd.emulator.metrics import EmulatorMetrics
from routerd.emulator.openai_api import ApiSettings, LoraModule, build_app
from routerd.errors import ConfigError
from routerd.profiles import HardwareProfile, ProfileError, get_profile

log = logging.getLogger(__name__)

DEFAULT_MODEL = "llama-2-7b"
DEFAULT_MAX_TOKENS = 256
#: Seconds in-flight requests get to finish after SIGTERM before the server closes.
SHUTDOWN_TIMEOUT_S = 5.0


class EmulatorSettings(BaseModel):
    """Settings of ``phasewise emulate`` (flags or ``PHASEWISE_EMULATOR_*`` variables)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "0.0.0.0"
    """Address to listen on (vLLM's server listens on every interface by default)."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port; 0 picks a free one (printed at start)."""
    model: str = Field(default=DEFAULT_MODEL, min_length=1)
    """Served model name, unless ``served_model_name`` is set (then only ``root`` in ``/v1/models``,
    as vLLM's ``--model`` path)."""
    served_model_name: str | None = Field(default=None, min_length=1)
    """vLLM's ``--served-model-name``: the name requests use; None: ``model``."""
    profile: str = DEFAULT_PROFILE
    """Hardware profile: a shipped name or a YAML path (see :mod:`routerd.profiles`)."""
    seed: int = 0
    """Seeds the filler text."""
    fixed_timing: tuple[float, float] | None = None
    """``(ttft_s, tpot_s)``: fixed latencies instead of the simulator (load benchmarks)."""
    default_max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, ge=1)
    """Output length (tokens) of requests without ``max_tokens``."""
    enable_prefix_caching: bool | None = None
    """vLLM's ``--enable-prefix-caching`` / ``--no-enable-prefix-caching``; None: the profile's
    ``prefix_caching`` (on in every shipped profile, as in vLLM V1). No effect with ``fixed_timing``."""
    kv_events_config: KVEventsConfig | None = None
    """vLLM's ``--kv-events-config`` (publish KV-cache events over ZMQ); None: no events."""
    block_size: int | None = Field(default=None, ge=1)
    """vLLM's ``--block-size`` (tokens per KV block); None: the profile's. The KV capacity in tokens
    stays the profile's (rounded down to whole blocks) unless ``num_gpu_blocks_override`` is set."""
    num_gpu_blocks_override: int | None = Field(default=None, ge=1)
    """vLLM's ``--num-gpu-blocks-override``: KV-cache blocks (capacity = this x block size)."""
    max_model_len: int | None = Field(default=None, ge=1)
    """vLLM's ``--max-model-len``; None: the profile's."""
    lora_modules: tuple[LoraModule, ...] = ()
    """vLLM's ``--lora-modules``: adapters served besides the model (listed in ``/v1/models``,
    their blocks keyed apart, timed as the base model)."""
    enable_prompt_tokens_details: bool = False
    """vLLM's ``--enable-prompt-tokens-details``: ``usage.prompt_tokens_details.cached_tokens``."""
    tokenizer: str | None = None
    """A Hugging Face model folder or ``tokenizer.json``: prompts tokenized (and chat templates
    rendered) as vLLM would; None: the byte tokenizer (4 UTF-8 bytes per token)."""
    kv_events_layout: Literal["array", "map", "map-batch"] = "map"
    """Wire layout of the events (:mod:`routerd.prefix.kv_wire`): ``array`` as vLLM up to v0.23,
    ``map`` as vLLM from v0.24 (tagged-map events), ``map-batch`` as vLLM main (the batch a map too)."""

    @field_validator("fixed_timing")
    @classmethod
    def _finite_timing(cls, v: tuple[float, float] | None) -> tuple[float, float] | None:
        if v is not None and not all(math.isfinite(x) and x >= 0 for x in v):
            raise ValueError("TTFT_S and TPOT_S must be finite numbers of seconds >= 0")
        return v

    @field_validator("lora_modules")
    @classmethod
    def _unique_adapters(cls, v: tuple[LoraModule, ...]) -> tuple[LoraModule, ...]:
        names = [m.name for m in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"adapter name(s) given twice: {', '.join(dup)}")
        return v

    @property
    def served_name(self) -> str:
        """The model name requests and responses use."""
        return self.served_model_name or self.model


def load_profile(name_or_path: str) -> HardwareProfile:
    """The profile of ``--profile``; raises :class:`ConfigError` naming the flag."""
    try:
        return get_profile(name_or_path)
    except ProfileError as e:
        raise ConfigError(f"--profile: {e}") from None


def resolve_profile(settings: EmulatorSettings) -> HardwareProfile:
    """``--profile`` with the vLLM-style overrides applied: ``--block-size``,
    ``--num-gpu-blocks-override``, ``--max-model-len``, ``--[no-]enable-prefix-caching``.

    The profile's checks run again on the result (the cache must hold one ``max_model_len``
    request, as vLLM checks at start).

    Raises:
        ConfigError: unknown profile, or overrides the profile cannot take (names the flags).
    """
    profile = load_profile(settings.profile)
    upd: dict[str, object] = {}
    bs = settings.block_size or profile.block_size
    if settings.block_size is not None:
        upd["block_size"] = bs
        upd["kv_capacity_tokens"] = profile.kv_capacity_tokens // bs * bs
    if settings.num_gpu_blocks_override is not None:
        upd["kv_capacity_tokens"] = settings.num_gpu_blocks_override * bs
    if settings.max_model_len is not None:
        upd["max_model_len"] = settings.max_model_len
    if settings.enable_prefix_caching is not None:
        upd["prefix_caching"] = settings.enable_prefix_caching
    if not upd:
        return profile
    try:
        return HardwareProfile.model_validate({**profile.model_dump(), **upd})
    except ValidationError as e:
        flags = [f for f, k in (("--block-size", "block_size"), ("--num-gpu-blocks-override", "kv_capacity_tokens"),
                                ("--max-model-len", "max_model_len")) if k in upd]
        msg = e.errors()[0]["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{'/'.join(flags) or '--profile'}: profile {profile.name} cannot take it: {msg}") from None


def load_emulator_tokenizer(settings: EmulatorSettings):
    """The tokenizer of ``--tokenizer`` (:func:`routerd.prefix.tokenize.load_tokenizer`), or None.

    Raises:
        ConfigError: a folder or file that is not a Hugging Face tokenizer (names the flag).
    """
    if settings.tokenizer is None:
        return None
    from routerd.prefix.tokenize import TokenizerUnavailable, load_tokenizer

    try:
        return load_tokenizer(settings.tokenizer)
    except TokenizerUnavailable as e:
        raise ConfigError(f"--tokenizer: {e}") from None


@dataclass
class RunningEmulator:
    """A started emulator; ``await close()`` stops it."""

    runner: web.AppRunner
    engine: Engine
    metrics: EmulatorMetrics
    profile: HardwareProfile
    host: str
    port: int
    kv_events: ZmqEventPublisher | None = None
    """The KV-event publisher (``kv_events.endpoint``: where it is bound), or None."""

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8000`` (``0.0.0.0`` shown as ``127.0.0.1``)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    async def close(self) -> None:
        """Stop accepting, let in-flight requests finish (up to the shutdown timeout), stop the engine."""
        await self.runner.cleanup()
        if self.kv_events is not None:
            self.kv_events.close()


async def start_emulator(settings: EmulatorSettings) -> RunningEmulator:
    """Build the engine and start serving; call inside the event loop that will run it.

    Raises:
        ConfigError: unknown profile, a port or KV-event endpoint that cannot be bound, or KV
            events with ``fixed_timing`` (message names the flag).
    """
    profile = resolve_profile(settings)
    tokenizer = load_emulator_tokenizer(settings)
    caching = profile.prefix_caching and settings.fixed_timing is None
    kv = settings.kv_events_config
    publisher = None
    if kv is not None and kv.active:
        if settings.fixed_timing is not None:
            raise ConfigError("--kv-events-config: KV events need the simulator's prefix cache, not --fixed-timing")
        if not caching:
            # vLLM's warning for the same configuration (vllm/config/vllm.py).
            log.warning("KV cache events are on, but prefix caching is not enabled. "
                        "Use --enable-prefix-caching to enable.")
        publisher = ZmqEventPublisher(kv, settings.kv_events_layout)
    metrics = EmulatorMetrics(settings.served_name, profile.max_model_len, profile.block_size, profile.num_blocks,
                              caching, settings.num_gpu_blocks_override)
    engine: Engine
    if settings.fixed_timing is not None:
        ttft, tpot = settings.fixed_timing
        engine = FixedTimingEngine(ttft, tpot, profile, metrics)
    else:
        engine = SimEngine(profile, metrics, publisher)
    metrics.attach(engine.stats)
    if publisher is not None:
        metrics.attach_kv_events(publisher)
    app = build_app(engine, metrics, ApiSettings(settings.served_name, profile.max_model_len,
                                                 settings.default_max_tokens, settings.seed, settings.model,
                                                 settings.lora_modules, settings.enable_prompt_tokens_details,
                                                 tokenizer))
    # handler_cancellation: a client that disconnects cancels its handler, which aborts
    # the request in the engine (vLLM aborts on disconnect too).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
    except OSError as e:
        await runner.cleanup()
        if publisher is not None:
            publisher.close()
        raise ConfigError(f"--host/--port: cannot listen on {settings.host}:{settings.port} "
                          f"({e.strerror or e})") from None
    port = runner.addresses[0][1]
    return RunningEmulator(runner, engine, metrics, profile, settings.host, port, publisher)
