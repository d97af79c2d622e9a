"""``phasewise emulate``: serve the OpenAI API like vLLM, with simulated timing and no GPU."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from pydantic import ValidationError

from routerd.errors import ConfigError

ENV_PREFIX = "PHASEWISE_EMULATOR_"

#: flag -> (settings field, environment variable)
_FIELDS = {
    "--host": "host",
    "--port": "port",
    "--model": "model",
    "--profile": "profile",
    "--seed": "seed",
    "--fixed-timing": "fixed_timing",
    "--default-max-tokens": "default_max_tokens",
    "--enable-prefix-caching": "enable_prefix_caching",
    "--kv-events-config": "kv_events_config",
    "--kv-events-layout": "kv_events_layout",
}


def _env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``emulate`` subcommand (every flag also reads ``PHASEWISE_EMULATOR_<FLAG>``)."""
    from routerd.emulator.server import DEFAULT_MAX_TOKENS, DEFAULT_MODEL, DEFAULT_PROFILE

    p = sub.add_parser(
        "emulate",
        help="serve the OpenAI API like vLLM, timed by the instance simulator (no GPU)",
        description="An OpenAI-compatible server shaped like vLLM's (completions, chat completions, "
        "streaming, /v1/models, /health, vLLM-named /metrics) whose token timing comes from the "
        "instance simulator driven in real time with a hardware profile: continuous batching, KV "
        "blocks, preemption. Each flag can also be set with the environment variable "
        f"{ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}PORT, {ENV_PREFIX}FIXED_TIMING); flags win.",
    )
    p.add_argument("--host", default=None, help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", default=None, help="TCP port (default 8000; 0 picks a free one, printed at start)")
    p.add_argument("--model", default=None, help=f"served model name (default {DEFAULT_MODEL})")
    p.add_argument("--profile", default=None,
                   help=f"hardware profile name or YAML path (default {DEFAULT_PROFILE})")
    p.add_argument("--seed", default=None, help="seed of the filler text (default 0)")
    p.add_argument("--fixed-timing", default=None, metavar="TTFT_S,TPOT_S",
                   help="fixed time to first token and time per output token in seconds, e.g. 0.02,0.005, "
                        "whatever the load (instead of the simulator)")
    p.add_argument("--default-max-tokens", default=None,
                   help=f"output tokens of requests without max_tokens (default {DEFAULT_MAX_TOKENS}); "
                        "outputs always run to max_tokens, as with vLLM's ignore_eos")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="automatic prefix caching, as vLLM V1 (default: the profile's prefix_caching, on in "
                        "every shipped profile): a prompt's token ids (the byte tokenizer's, 4 UTF-8 bytes per "
                        "token, of the prompt text or a chat request's 'role: content' lines; token-id "
                        "prompts as given) are cached in full blocks (the profile's block_size, 16) and a later request's longest "
                        "cached prefix skips its prefill (the last prompt token is always computed); "
                        "counted in vllm:prefix_cache_queries/hits. Blocks of generated tokens are not "
                        "cached (vLLM caches them too; the emulator's filler output has no token ids to "
                        "share)")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="vLLM's KV-cache events, same keys: e.g. '{\"enable_kv_cache_events\": true}' "
                        "publishes BlockStored/BlockRemoved/AllBlocksCleared msgpack batches on a ZMQ PUB "
                        "socket (endpoint default tcp://*:5557, topic \"\", hwm 100000), one batch per "
                        "engine step that changed the cache; block hashes are seeded per process (key "
                        "blocks by their token ids). replay_endpoint is not emulated. POST "
                        "/reset_prefix_cache publishes AllBlocksCleared")
    p.add_argument("--kv-events-layout", default=None, choices=("array", "map", "map-batch"),
                   help="msgpack layout of the events: array (vLLM <= 0.23, array_like structs), map "
                        "(default; vLLM >= 0.24: events as tagged maps in a positional batch), map-batch "
                        "(vLLM main: the batch a map too)")


def settings_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None):
    """:class:`EmulatorSettings` from flags, then ``PHASEWISE_EMULATOR_*`` variables, then defaults.

    Raises:
        ConfigError: a value that does not parse or is out of range (names the flag and variable).
    """
    from routerd.emulator.server import EmulatorSettings

    env = os.environ if environ is None else environ
    values: dict[str, object] = {}
    source: dict[str, str] = {}
    for flag, field in _FIELDS.items():
        v = getattr(args, field, None)
        where = flag
        if v is None and _env_name(field) in env:
            v, where = env[_env_name(field)], _env_name(field)
        if v is None:
            continue
        source[field] = where
        if field == "kv_events_config":
            from routerd.emulator.kv_events import parse_kv_events_config

            v = parse_kv_events_config(str(v), where)
        elif field == "fixed_timing":
            parts = str(v).split(",")
            try:
                if len(parts) != 2:
                    raise ValueError
                v = (float(parts[0]), float(parts[1]))
            except ValueError:
                raise ConfigError(f"{where}: expected TTFT_S,TPOT_S in seconds (e.g. 0.02,0.005), got {v!r}") \
                    from None
        values[field] = v
    try:
        return EmulatorSettings(**values)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "?"
        where = source.get(field, field)
        raise ConfigError(f"{where}: {err['msg']} (got {err.get('input')!r})") from None


async def _serve(settings) -> None:
    from routerd.emulator.server import start_emulator

    emu = await start_emulator(settings)
    p = emu.profile
    mode = (f"fixed timing TTFT {settings.fixed_timing[0]} s, TPOT {settings.fixed_timing[1]} s"
            if settings.fixed_timing else f"profile {p.name}")
    extra = ""
    if settings.fixed_timing is None:
        extra = f"; prefix caching {'on' if p.prefix_caching else 'off'}"
    if emu.kv_events is not None:
        extra += f"; KV events {emu.kv_events.endpoint} topic {settings.kv_events_config.topic!r}"
    print(f"phasewise emulate: serving {settings.model!r} on {emu.url} ({mode}; max_model_len "
          f"{p.max_model_len}, KV {p.kv_capacity_tokens} tokens{extra})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        print("phasewise emulate: shutting down", file=sys.stderr, flush=True)
        await emu.close()


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; returns 0. Raises :class:`ConfigError` for bad settings."""
    settings = settings_from_args(args)
    from routerd.emulator.server import load_profile

    load_profile(settings.profile)  # fail before the event loop starts
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(settings))
    else:
        uvloop.run(_serve(settings))
    return 0
