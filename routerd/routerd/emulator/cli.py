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
    "--served-model-name": "served_model_name",
    "--profile": "profile",
    "--seed": "seed",
    "--fixed-timing": "fixed_timing",
    "--default-max-tokens": "default_max_tokens",
    "--enable-prefix-caching": "enable_prefix_caching",
    "--kv-events-config": "kv_events_config",
    "--kv-events-layout": "kv_events_layout",
    "--block-size": "block_size",
    "--num-gpu-blocks-override": "num_gpu_blocks_override",
    "--max-model-len": "max_model_len",
    "--lora-modules": "lora_modules",
    "--enable-prompt-tokens-details": "enable_prompt_tokens_details",
    "--tokenizer": "tokenizer",
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
    p.add_argument("--model", default=None,
                   help=f"served model name (default {DEFAULT_MODEL}); with --served-model-name, only the "
                        "'root' /v1/models shows (vLLM's --model path)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name requests use, as vLLM's flag (default: --model)")
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
                        "prompts as given) are cached in full blocks (--block-size, default the profile's "
                        "block_size) and a later request's longest "
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
    p.add_argument("--block-size", default=None, metavar="TOKENS",
                   help="tokens per KV block, as vLLM's flag (default: the profile's, 16 in the shipped "
                        "profiles; vLLM's CPU build uses 128): the simulated cache, the KV events and "
                        "vllm:cache_config_info follow it; the KV capacity in tokens stays the profile's")
    p.add_argument("--num-gpu-blocks-override", default=None, metavar="N",
                   help="KV-cache blocks, as vLLM's flag (capacity N x block size tokens; default: the "
                        "profile's kv_capacity_tokens)")
    p.add_argument("--max-model-len", default=None, metavar="TOKENS",
                   help="longest prompt + output, as vLLM's flag (default: the profile's max_model_len)")
    p.add_argument("--lora-modules", default=None, nargs="+", metavar="NAME=PATH",
                   help="LoRA adapters as vLLM's flag: NAME=PATH or JSON {\"name\", \"path\", "
                        "\"base_model_name\"}; listed in /v1/models, requests for them accepted and their "
                        "KV blocks keyed apart (lora_name/lora_id in KV events); timed as the base model, "
                        "nothing is loaded from PATH. Variable: space-separated")
    p.add_argument("--enable-prompt-tokens-details", action="store_true", default=None,
                   help="usage.prompt_tokens_details.cached_tokens in responses, as vLLM's flag")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a Hugging Face model folder (or tokenizer.json): text prompts tokenized with it and "
                        "chat messages rendered with its chat template, as vLLM; default: the byte tokenizer "
                        "(4 UTF-8 bytes per token, chat as 'role: content' lines)")
    p.add_argument("--kv-events-layout", default=None, choices=("array", "map", "map-batch"),
                   help="msgpack layout of the events: array (vLLM <= 0.23, array_like structs), map "
                        "(default; vLLM >= 0.24: events as tagged maps in a positional batch), map-batch "
                        "(vLLM main: the batch a map too)")


def parse_lora_modules(items: list[str], where: str = "--lora-modules") -> tuple:
    """``--lora-modules`` values (``NAME=PATH`` or vLLM's JSON form) as :class:`LoraModule` entries.

    Raises:
        ConfigError: an entry that is neither, or JSON without ``name`` and ``path`` strings.
    """
    import json

    from routerd.emulator.openai_api import LoraModule

    out = []
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                d = json.loads(item)
            except ValueError as e:
                raise ConfigError(f"{where}: {item!r} is not JSON ({e})") from None
            base = d.get("base_model_name") if isinstance(d, dict) else None
            if not (isinstance(d, dict) and isinstance(d.get("name"), str) and d["name"]
                    and isinstance(d.get("path"), str) and d["path"] and (base is None or isinstance(base, str))):
                raise ConfigError(f"{where}: {item!r} needs string fields name and path (and optionally "
                                  "base_model_name)")
            out.append(LoraModule(d["name"], d["path"], base))
            continue
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"{where}: expected NAME=PATH or a JSON object, got {item!r}")
        out.append(LoraModule(name, path))
    return tuple(out)


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
        elif field == "lora_modules":
            v = parse_lora_modules(v.split() if isinstance(v, str) else list(v), where)
        elif field == "enable_prompt_tokens_details" and isinstance(v, str):
            v = v.strip().lower() in ("1", "true", "yes", "on")
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
    if settings.lora_modules:
        extra += f"; LoRA {', '.join(m.name for m in settings.lora_modules)}"
    print(f"phasewise emulate: serving {settings.served_name!r} on {emu.url} ({mode}; max_model_len "
          f"{p.max_model_len}, KV {p.kv_capacity_tokens} tokens in blocks of {p.block_size}{extra})", flush=True)
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
    from routerd.emulator.server import load_emulator_tokenizer, resolve_profile

    resolve_profile(settings)  # fail before the event loop starts
    load_emulator_tokenizer(settings)
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(settings))
    else:
        uvloop.run(_serve(settings))
    return 0
