"""Configuration of ``phasewise sidecar``: command-line flags, each also settable by an environment variable."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from typing import Literal, Mapping

import yarl
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from routerd.errors import ConfigError

__all__ = ["SidecarConfig", "OPTIONS", "resolve_config", "DEFAULT_INTERVAL_S", "DEFAULT_TIMEOUT_S"]

DEFAULT_INTERVAL_S = 0.1
"""Scrape period (s): routers act on state well under a second old."""
DEFAULT_TIMEOUT_S = 1.0
"""Longest wait for one scrape (s); an instance slower than this is reported unhealthy."""


class SidecarConfig(BaseModel):
    """Validated settings of one sidecar (times in seconds)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    metrics_url: str
    """vLLM's Prometheus endpoint, e.g. ``http://127.0.0.1:8000/metrics``."""
    listen: str
    """``HOST:PORT`` of the gRPC server (port 0: any free port, logged at start)."""
    instance: str = Field(min_length=1)
    """Instance name reported in every snapshot (the pod name in Kubernetes)."""
    endpoint: str = ""
    """OpenAI-compatible base URL reported in every snapshot ("" when routerd knows it from discovery)."""
    interval_s: float = Field(DEFAULT_INTERVAL_S, gt=0, le=3600, allow_inf_nan=False)
    timeout_s: float = Field(DEFAULT_TIMEOUT_S, gt=0, le=3600, allow_inf_nan=False)
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("metrics_url")
    @classmethod
    def _check_metrics_url(cls, v: str) -> str:
        return _http_url(v)

    @field_validator("endpoint")
    @classmethod
    def _check_endpoint(cls, v: str) -> str:
        return _http_url(v).rstrip("/") if v else v

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError("expected HOST:PORT with a port 0-65535, e.g. 0.0.0.0:50051 or [::]:50051")
        return v

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, v):
        return v.lower() if isinstance(v, str) else v


def _http_url(v: str) -> str:
    try:
        url = yarl.URL(v)
    except (ValueError, TypeError) as e:
        raise ValueError(f"not a URL ({e})") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError("expected an http:// or https:// URL with a host")
    return v


@dataclass(frozen=True)
class _Option:
    field: str
    flag: str
    env: str
    metavar: str
    help: str


OPTIONS: tuple[_Option, ...] = (
    _Option("metrics_url", "--metrics-url", "PHASEWISE_SIDECAR_METRICS_URL", "URL",
            "vLLM's Prometheus metrics URL, e.g. http://127.0.0.1:8000/metrics (required)"),
    _Option("listen", "--listen", "PHASEWISE_SIDECAR_LISTEN", "HOST:PORT",
            "address of the gRPC server, e.g. 0.0.0.0:50051 (required; port 0 picks a free port)"),
    _Option("instance", "--instance", "PHASEWISE_SIDECAR_INSTANCE", "NAME",
            "instance name in every snapshot (default: the host name, which is the pod name in Kubernetes)"),
    _Option("endpoint", "--endpoint", "PHASEWISE_SIDECAR_ENDPOINT", "URL",
            "OpenAI-compatible base URL of the instance, reported in every snapshot (default: none)"),
    _Option("interval_s", "--interval", "PHASEWISE_SIDECAR_INTERVAL", "S",
            f"seconds between scrapes (default: {DEFAULT_INTERVAL_S:g})"),
    _Option("timeout_s", "--timeout", "PHASEWISE_SIDECAR_TIMEOUT", "S",
            f"seconds one scrape may take before the instance counts as unhealthy (default: {DEFAULT_TIMEOUT_S:g})"),
    _Option("log_level", "--log-level", "PHASEWISE_SIDECAR_LOG_LEVEL", "LEVEL",
            "debug, info, warning or error (default: info)"),
)
"""Each setting: its config field, flag and environment variable (the flag wins over the variable)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every option of :data:`OPTIONS` to ``parser``, as strings validated later by :func:`resolve_config`."""
    for o in OPTIONS:
        # Strings and no defaults here: validation (and its one-line error naming the flag
        # or variable) happens in resolve_config, where the environment is also read.
        parser.add_argument(o.flag, dest=o.field, metavar=o.metavar, default=None, help=f"{o.help} [env {o.env}]")


def resolve_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> SidecarConfig:
    """Build the config from the parsed flags, falling back to the environment variables.

    Raises :class:`routerd.errors.ConfigError` naming the flag or variable of a missing
    required setting or of the first invalid value.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, str] = {}
    source: dict[str, str] = {}
    for o in OPTIONS:
        flag_value = getattr(args, o.field, None)
        if flag_value is not None:
            values[o.field], source[o.field] = flag_value, o.flag
        elif environ.get(o.env):
            values[o.field], source[o.field] = environ[o.env], o.env
    for o in OPTIONS:
        if o.field in ("metrics_url", "listen") and o.field not in values:
            raise ConfigError(f"{o.flag} (or {o.env}) is required")
    values.setdefault("instance", socket.gethostname())
    source.setdefault("instance", "--instance (default: the host name)")
    try:
        return SidecarConfig(**values)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else ""
        where = source.get(field, field)
        shown = f"={values[field]!r}" if field in values else ""
        msg = err["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{where}{shown}: {msg}") from None
