"""Start and stop an emulator: settings, engine, metrics and the aiohttp server together."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, field_validator

from routerd.cli import DEFAULT_PROFILE
from routerd.emulator.engine import Engine, FixedTimingEngine, SimEngine
from routerd.emulator.kv_events import KVEventsConfig, ZmqEventPublisher
from routerd.emulator.metrics import EmulatorMetrics
from routerd.emulator.openai_api import ApiSettings, build_app
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
    """Served model name."""
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
    kv_events_layout: Literal["array", "map", "map-batch"] = "map"
    """Wire layout of the events (:mod:`routerd.prefix.kv_wire`): ``array`` as vLLM up to v0.23,
    ``map`` as vLLM from v0.24 (tagged-map events), ``map-batch`` as vLLM main (the batch a map too)."""

    @field_validator("fixed_timing")
    @classmethod
    def _finite_timing(cls, v: tuple[float, float] | None) -> tuple[float, float] | None:
        if v is not None and not all(math.isfinite(x) and x >= 0 for x in v):
            raise ValueError("TTFT_S and TPOT_S must be finite numbers of seconds >= 0")
        return v


def load_profile(name_or_path: str) -> HardwareProfile:
    """The profile of ``--profile``; raises :class:`ConfigError` naming the flag."""
    try:
        return get_profile(name_or_path)
    except ProfileError as e:
        raise ConfigError(f"--profile: {e}") from None


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
    profile = load_profile(settings.profile)
    if settings.enable_prefix_caching is not None:
        profile = profile.model_copy(update={"prefix_caching": settings.enable_prefix_caching})
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
    metrics = EmulatorMetrics(settings.model, profile.max_model_len, profile.block_size, profile.num_blocks,
                              caching)
    engine: Engine
    if settings.fixed_timing is not None:
        ttft, tpot = settings.fixed_timing
        engine = FixedTimingEngine(ttft, tpot, profile, metrics)
    else:
        engine = SimEngine(profile, metrics, publisher)
    metrics.attach(engine.stats)
    if publisher is not None:
        metrics.attach_kv_events(publisher)
    app = build_app(engine, metrics, ApiSettings(settings.model, profile.max_model_len,
                                                 settings.default_max_tokens, settings.seed))
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
