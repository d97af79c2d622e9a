"""``phasewise sidecar``: scrape one vLLM instance's /metrics and serve its state over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from routerd.errors import ConfigError
from routerd.sidecar.config import OPTIONS, SidecarConfig, add_arguments, resolve_config

__all__ = ["add_parser", "run"]

log = logging.getLogger("routerd.sidecar")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``sidecar`` subcommand to the ``phasewise`` parser."""
    env_lines = "\n".join(f"  {o.env:<32} {o.flag}" for o in OPTIONS)
    p = sub.add_parser(
        "sidecar",
        help="scrape a vLLM instance's /metrics and stream its state to routerd over gRPC",
        description="Run beside one vLLM instance: scrape its Prometheus /metrics every --interval "
        "seconds and serve the state as phasewise.v1.InstanceStateService (GetState, WatchState) "
        "plus grpc.health.v1 (SERVING while scrapes succeed). Stops cleanly on SIGTERM or SIGINT.",
        epilog="Every flag can also be set by an environment variable (the flag wins):\n" + env_lines,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Run the sidecar until SIGTERM or SIGINT; returns 0 after a clean stop.

    Raises :class:`routerd.errors.ConfigError` for a missing or invalid setting or an
    address that cannot be bound.
    """
    config = resolve_config(args)
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(config))


async def serve(config: SidecarConfig) -> int:
    """Serve ``config`` until SIGTERM or SIGINT (this must run in the main thread); returns 0."""
    from routerd.sidecar.server import Sidecar

    sidecar = Sidecar(config.metrics_url, listen=config.listen, instance=config.instance,
                      endpoint=config.endpoint, interval_s=config.interval_s, timeout_s=config.timeout_s)
    try:
        await sidecar.start()
    except OSError as e:
        raise ConfigError(f"--listen {config.listen}: {e}") from None  # flag or PHASEWISE_SIDECAR_LISTEN
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await sidecar.serve_until(stop)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    log.info("instance %s: stopped", config.instance)
    return 0
