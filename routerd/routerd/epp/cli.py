"""``phasewise epp``: run the endpoint picker (or print the Envoy configuration Phasewise ships)."""

from __future__ import annotations

import argparse
import logging
import sys

from routerd.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``epp`` subcommand."""
    p = sub.add_parser(
        "epp",
        help="run the Gateway API Inference Extension endpoint picker (Envoy ext_proc) over routerd's router",
        description="Pick an endpoint for each request Envoy sends over ext_proc (Endpoint Picker protocol "
        "v1.0), with the same router, predictor and policies as 'phasewise serve'. Settings: the same file as "
        "'phasewise serve' (--config) plus its epp: section, then PHASEWISE_* environment variables, then these "
        "flags. SIGHUP (or a change of the file) reloads; SIGTERM drains and exits. --print-envoy-config "
        "prints the Envoy bootstrap for Envoy beside the picker and exits.",
    )
    p.add_argument("--config", "-c", metavar="FILE", help="YAML config file (routerd's, with an epp: section)")
    p.add_argument("--host", help="listen address of the ext_proc, health and metrics ports (epp.host)")
    p.add_argument("--port", type=int, help="ext_proc gRPC port, default 9002, 0 = any free port (epp.port)")
    p.add_argument("--health-port", type=int,
                   help="gRPC health port, default 9003; 0 = on the ext_proc port (epp.health_port)")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port, default 9090 (epp.metrics_port)")
    p.add_argument("--endpoint", action="append", metavar="NAME=URL[,STATE_ADDR]",
                   help="a static instance, repeatable; replaces the config file's endpoints")
    p.add_argument("--model", action="append", metavar="NAME", help="a served model name, repeatable (models)")
    p.add_argument("--policy", metavar="SPEC", help="routing policy, name or name:key=value,... (policy)")
    p.add_argument("--profile", help="hardware profile name or YAML path (profile)")
    p.add_argument("--predictor", metavar="SPEC", help="length predictor, as for 'phasewise serve' (predictor)")
    p.add_argument("--mode", choices=["full-duplex", "efficient"],
                   help="full-duplex (what gateways configure) or efficient (only with the Envoy configuration "
                        "Phasewise ships: the response never passes through the picker) (epp.mode)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log level (log_level)")
    g = p.add_argument_group("--print-envoy-config", "print the standalone Envoy bootstrap (YAML) and exit")
    g.add_argument("--print-envoy-config", action="store_true", help="print the Envoy bootstrap and exit")
    g.add_argument("--envoy-listen-port", type=int, default=8081, help="Envoy's client port (8081)")
    g.add_argument("--envoy-listen-address", default=None, metavar="IP",
                   help="Envoy's client address (default: epp.host if it is a concrete address, else 0.0.0.0)")
    g.add_argument("--picker-address", default=None,
                   help="host:port where Envoy reaches the picker (default 127.0.0.1:<epp.port>)")
    g.add_argument("--failure-mode", choices=["FailClose", "FailOpen"], default="FailClose",
                   help="picker down or failing: FailClose (5xx) or FailOpen (route to --fail-open-endpoint)")
    g.add_argument("--fail-open-endpoint", action="append", default=[], metavar="IP:PORT",
                   help="an engine FailOpen routes to round robin, repeatable")
    g.add_argument("--admin-port", type=int, default=9901, help="Envoy admin port on 127.0.0.1 (9901; 0: none)")


def overrides_from_args(args: argparse.Namespace) -> tuple[dict, dict[str, str]]:
    """(nested setting overrides, top-level key -> flag); ``serve``'s shared flags plus ``epp.*``."""
    from routerd.daemon.cli import overrides_with

    return overrides_with(args, [("--" + attr.replace("_", "-"), ("epp", attr), getattr(args, attr))
                                 for attr in ("host", "port", "health_port", "metrics_port", "mode")])


def print_envoy_config(args: argparse.Namespace, settings) -> int:
    """Print the standalone bootstrap for ``settings.epp`` and the flags (YAML on stdout)."""
    from routerd.epp.envoy_config import build_envoy_config

    import ipaddress

    epp = settings.epp
    host = args.envoy_listen_address
    if host is None:
        host = "0.0.0.0"
        try:
            if not ipaddress.ip_address(epp.host.strip("[]")).is_unspecified:
                host = epp.host.strip("[]")
        except ValueError:
            pass  # a host name: Envoy needs an address
    # Each builder argument's flag, for the one-line error.
    flag_of = {"listen_port": "--envoy-listen-port", "listen_host": "--envoy-listen-address",
               "admin_port": "--admin-port", "fail_open_endpoints": "--fail-open-endpoint",
               "picker_address": "--picker-address", "failure_mode": "--failure-mode", "mode": "--mode"}
    try:
        cfg = build_envoy_config(listen_port=args.envoy_listen_port, listen_host=host,
                                 picker_address=args.picker_address or f"127.0.0.1:{epp.port}",
                                 mode=epp.mode, failure_mode=args.failure_mode,
                                 fail_open_endpoints=args.fail_open_endpoint,
                                 admin_port=args.admin_port or None,
                                 picker_ports={"epp.port": epp.port, "epp.health_port": epp.health_port,
                                               "epp.metrics_port": epp.metrics_port})
    except ValueError as e:
        msg = str(e)
        arg = next((a for a in sorted(flag_of, key=len, reverse=True) if msg.startswith(a)), None)
        if arg is None:
            arg = next((a for a in flag_of if a in msg), None)
        raise ConfigError(f"{flag_of.get(arg, '--print-envoy-config')}: {msg}") from None
    sys.stdout.write(render_yaml(cfg))
    return 0


def render_yaml(cfg: dict) -> str:
    """The bootstrap as YAML, as ``deploy/envoy/standalone.yaml`` holds it."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        pass

    def _str(dumper, data: str):
        # The Lua source as a block, readable in the file.
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)

    _Dumper.add_representer(str, _str)
    return yaml.dump(cfg, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def run(args: argparse.Namespace) -> int:
    """Run ``phasewise epp`` until SIGTERM/SIGINT; returns the exit code (0 after a drain).

    Raises:
        ConfigError: bad config file, environment variable or flag (one line, exit 2), or a
            port that cannot be bound.
    """
    from routerd.daemon.config import load_settings

    overrides, flags = overrides_from_args(args)
    settings = load_settings(args.config, overrides=overrides, override_flags=flags)
    if args.print_envoy_config:
        return print_envoy_config(args, settings)
    import importlib.util

    try:
        found = importlib.util.find_spec("envoy.service.ext_proc.v3") is not None
    except ModuleNotFoundError:  # no 'envoy' package at all
        found = False
    if not found:
        raise ConfigError("phasewise epp needs the Python package 'xds-protos' (Envoy's ext_proc stubs): "
                          "pip install xds-protos")
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from routerd.daemon.cli import _new_loop

    loop = _new_loop(settings.event_loop)
    try:
        return loop.run_until_complete(serve_forever(settings, args.config, overrides, flags))
    except OSError as e:
        raise ConfigError(f"cannot listen: {e.strerror or e}") from None
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def serve_forever(settings, config_path, overrides, flags) -> int:
    """The picker's process: a daemon without its HTTP front (nor routerd's gRPC API), and the
    picker's listeners, until SIGTERM/SIGINT (drain, then exit 0); SIGHUP reloads."""
    from routerd.daemon.app import Daemon
    from routerd.epp.server import EppServer

    # The picker's front is ext_proc: routerd's own HTTP and gRPC fronts are not served.
    settings = settings.model_copy(update={"grpc": settings.grpc.model_copy(update={"enabled": False})})
    overrides = {**overrides, "grpc": {**overrides.get("grpc", {}), "enabled": False}}
    daemon = Daemon(settings, config_path=config_path, reload_overrides=overrides, reload_override_flags=flags,
                    http_front=False)
    return await daemon.serve_forever(fronts=[EppServer(daemon)])
