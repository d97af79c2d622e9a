"""``phasewise serve``: run routerd (the OpenAI-compatible proxy and the gRPC router API)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from routerd.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    p = sub.add_parser(
        "serve",
        help="run routerd: the OpenAI-compatible routing proxy and gRPC router API",
        description="Route OpenAI API requests to vLLM instances with a routing policy. Settings come from "
        "--config (YAML), then PHASEWISE_* environment variables (nested with __), then these flags. "
        "SIGHUP (or a change of the config file) reloads; SIGTERM drains and exits.",
    )
    p.add_argument("--config", "-c", metavar="FILE", help="YAML config file")
    p.add_argument("--host", help="HTTP listen address (http.host)")
    p.add_argument("--port", type=int, help="HTTP listen port, 0 = any free port (http.port)")
    p.add_argument("--grpc-host", help="gRPC listen address (grpc.host)")
    p.add_argument("--grpc-port", type=int, help="gRPC listen port, 0 = any free port (grpc.port)")
    p.add_argument("--no-grpc", action="store_true", help="do not serve the gRPC API (grpc.enabled=false)")
    p.add_argument("--endpoint", action="append", metavar="NAME=URL[,STATE_ADDR]",
                   help="a static instance, repeatable; replaces the config file's endpoints")
    p.add_argument("--model", action="append", metavar="NAME", help="a served model name, repeatable (models)")
    p.add_argument("--policy", metavar="SPEC", help="routing policy, name or name:key=value,... (policy)")
    p.add_argument("--profile", help="hardware profile name or YAML path (profile)")
    p.add_argument("--predictor", metavar="SPEC",
                   help="length predictor: default (the shipped n-gram model, the default), none, a baseline "
                        "name or a folder saved by 'phasewise predictor train' (predictor)")
    p.add_argument("--prefix-mode", choices=["off", "approximate", "precise"],
                   help="prefix-cache-aware routing: off, approximate (prompt text hashed, each policy's own "
                        "dispatch history; the default) or precise (the engines' KV events) (prefix.mode)")
    p.add_argument("--prefix-tokenizer", metavar="NAME_OR_PATH",
                   help="precise mode's tokenizer: bytes (the emulator's) or a Hugging Face tokenizer.json "
                        "(prefix.tokenizer)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log level (log_level)")


def parse_endpoint_flag(text: str) -> dict[str, Any]:
    """``NAME=URL[,STATE_ADDR]`` -> an endpoint mapping. Raises ConfigError naming the flag."""
    name, eq, rest = text.partition("=")
    if not eq or not name.strip() or not rest.strip():
        raise ConfigError(f"flag --endpoint: expected NAME=URL[,STATE_ADDR], got {text!r}")
    url, _, state = rest.partition(",")
    out: dict[str, Any] = {"name": name.strip(), "url": url.strip()}
    if state.strip():
        out["state_address"] = state.strip()
    return out


def overrides_from_args(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """(nested setting overrides, top-level key -> flag) from the parsed flags."""
    front: list[tuple[str, tuple[str, ...], Any]] = [
        ("--host", ("http", "host"), args.host), ("--port", ("http", "port"), args.port),
        ("--grpc-host", ("grpc", "host"), args.grpc_host), ("--grpc-port", ("grpc", "port"), args.grpc_port),
        ("--no-grpc", ("grpc", "enabled"), False if args.no_grpc else None)]
    return overrides_with(args, front)


def overrides_with(args: argparse.Namespace,
                   front: list[tuple[str, tuple[str, ...], Any]]) -> tuple[dict[str, Any], dict[str, str]]:
    """(nested setting overrides, top-level key -> flag) of ``front`` (a command's own flags:
    ``(flag, settings path, value or None when not given)``) and the routing flags every front
    shares (``--endpoint``, ``--model``, ``--policy``, ``--profile``, ``--predictor``,
    ``--prefix-mode`` where the command has it, ``--log-level``).

    Raises:
        ConfigError: a ``--policy`` spec that does not parse (naming the flag).
    """
    from routerd.policies.registry import PolicyError, parse_policy_spec

    o: dict[str, Any] = {}
    flags: dict[str, str] = {}

    def put(path: tuple[str, ...], value: Any, flag: str) -> None:
        d = o
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = value
        flags.setdefault(path[0], flag)

    for flag, path, value in front:
        if value is not None:
            put(path, value, flag)
    if args.endpoint:
        put(("endpoints",), [parse_endpoint_flag(e) for e in args.endpoint], "--endpoint")
    if args.model:
        put(("models",), list(args.model), "--model")
    if args.policy is not None:
        try:
            name, params = parse_policy_spec(args.policy)
        except PolicyError as e:
            raise ConfigError(f"flag --policy: {e}") from None
        put(("policy",), {"name": name, "params": params}, "--policy")
    if args.profile is not None:
        put(("profile",), args.profile, "--profile")
    if args.predictor is not None:
        put(("predictor",), args.predictor, "--predictor")
    if getattr(args, "prefix_mode", None) is not None:
        put(("prefix", "mode"), args.prefix_mode, "--prefix-mode")
    if getattr(args, "prefix_tokenizer", None) is not None:
        put(("prefix", "tokenizer"), args.prefix_tokenizer, "--prefix-tokenizer")
    if args.log_level is not None:
        put(("log_level",), args.log_level, "--log-level")
    return o, flags


def _new_loop(kind: str):
    import asyncio

    if kind in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise ConfigError("event_loop: uvloop is not installed (pip install uvloop)") from None
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(args: argparse.Namespace) -> int:
    """Run ``phasewise serve`` until SIGTERM/SIGINT; returns the exit code (0 after a drain).

    Raises:
        ConfigError: bad config file, environment variable or flag (printed on one line, exit 2).
    """
    from routerd.daemon.app import Daemon
    from routerd.daemon.config import load_settings

    overrides, flags = overrides_from_args(args)
    settings = load_settings(args.config, overrides=overrides, override_flags=flags)
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    daemon = Daemon(settings, config_path=args.config, reload_overrides=overrides, reload_override_flags=flags)
    loop = _new_loop(settings.event_loop)
    try:
        return loop.run_until_complete(daemon.serve_forever())
    except OSError as e:
        # A listen address in use or not available: a configuration problem, not a crash.
        raise ConfigError(f"cannot listen: {e.strerror or e}") from None
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
