"""Scrape a vLLM ``/metrics`` URL at a fixed rate and post each result as an ``InstanceState``."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Awaitable, Callable

import aiohttp

from routerd.api.v1.instance_state_pb2 import InstanceState
from routerd.sidecar.board import StateBoard
from routerd.sidecar.config import DEFAULT_INTERVAL_S, DEFAULT_TIMEOUT_S
from routerd.sidecar.metrics import (MetricsParseError, PrefixCacheWindow, VllmMetrics, parse_vllm_metrics,
                                     prefix_cache_window)

__all__ = ["Scraper", "DEFAULT_INTERVAL_S", "DEFAULT_TIMEOUT_S"]


# Per process, increasing, and starting at the start time in microseconds: a restarted
# sidecar continues above its predecessor's numbers, so a client that drops updates whose
# sequence is not newer than the last one it saw keeps accepting them.
_SEQUENCE = itertools.count(time.time_ns() // 1000 + 1)

#: Largest ``/metrics`` page read (bytes). A vLLM page is tens of KB (a few hundred KB with
#: many models or LoRA adapters); anything far bigger is not one, and reading it whole
#: would cost the sidecar hundreds of MB and seconds of CPU on every scrape.
MAX_PAGE_BYTES = 16 * 1024 * 1024

#: Called after a scrape whose health (healthy flag) differs from the previous one's,
#: and after the first scrape.
HealthCallback = Callable[[InstanceState], Awaitable[None]]


class Scraper:
    """Scrapes ``metrics_url`` every ``interval_s`` seconds and posts the state to :attr:`board`.

    Each scrape posts a new snapshot with a new ``sequence`` and ``scraped_at_unix_s``
    (wall clock, s). A failed scrape (connection refused, timeout after ``timeout_s``
    seconds, an HTTP status other than 200, a body over :data:`MAX_PAGE_BYTES` or that is not
    a vLLM metrics page) posts
    ``healthy=False`` with ``error`` saying why, and the gauges of the last good scrape.
    Scrapes never overlap: after one that ran longer than ``interval_s`` the next starts
    at once.

    Prefix-cache figures (when the page has vLLM's prefix-cache counters): the cumulative
    totals and hit rate since the engine started, and the windowed counts and hit rate
    between the previous successful scrape and this one (``prefix_cache_window_*``,
    :func:`~routerd.sidecar.metrics.prefix_cache_window`). A failed scrape repeats the
    last good scrape's figures, window included.

    The request asks for the plain text format without compression: on loopback gzip
    only costs CPU in the vLLM API server and here.
    """

    def __init__(
        self,
        metrics_url: str,
        *,
        instance: str,
        endpoint: str = "",
        interval_s: float = DEFAULT_INTERVAL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        on_health_change: HealthCallback | None = None,
    ) -> None:
        if not (interval_s > 0 and timeout_s > 0):
            raise ValueError(f"interval_s and timeout_s must be > 0, got {interval_s} and {timeout_s}")
        self.metrics_url = metrics_url
        self.instance = instance
        self.endpoint = endpoint
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._on_health_change = on_health_change
        self._last_good = VllmMetrics()
        self._last_good_at: float | None = None
        """Monotonic time (s) of the last successful scrape, None before one."""
        self._window: PrefixCacheWindow | None = None
        self._scrapes = 0
        self.board = StateBoard(
            InstanceState(instance=instance, endpoint=endpoint, healthy=False, error="not scraped yet")
        )

    @property
    def scrapes(self) -> int:
        """Scrapes done so far (successful or not)."""
        return self._scrapes

    async def run(self) -> None:
        """Scrape until cancelled. Owns its HTTP session, closed on the way out."""
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            # One keep-alive connection is all a sequential scraper needs.
            connector=aiohttp.TCPConnector(limit=1),
            headers={"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "identity"},
            raise_for_status=False,
        ) as session:
            next_at = loop.time()
            while True:
                await self.scrape_once(session)
                next_at += self.interval_s
                now = loop.time()
                if next_at < now:
                    next_at = now  # fell behind: scrape again at once, without a burst
                await asyncio.sleep(next_at - now)

    async def scrape_once(self, session: aiohttp.ClientSession) -> InstanceState:
        """Scrape once with ``session``, post the snapshot to :attr:`board` and return it."""
        error = ""
        try:
            text = await self._fetch(session)
            metrics = parse_vllm_metrics(text)
            now = time.monotonic()
            if self._last_good_at is None:
                self._window = None
            else:
                self._window = prefix_cache_window(self._last_good, metrics, now - self._last_good_at)
            self._last_good, self._last_good_at = metrics, now
        except MetricsParseError as e:
            error = f"bad metrics from {self.metrics_url}: {e}"
        except (TimeoutError, asyncio.TimeoutError):
            error = f"scrape of {self.metrics_url} timed out after {self.timeout_s:g} s"
        except aiohttp.ClientConnectorError as e:
            reason = e.os_error.strerror if e.os_error and e.os_error.strerror else str(e)
            error = f"cannot connect to {self.metrics_url}: {reason}"
        except _HttpStatus as e:
            error = f"{self.metrics_url} answered HTTP {e}"
        except aiohttp.ClientError as e:
            error = f"scrape of {self.metrics_url} failed: {type(e).__name__}: {e}"
        except UnicodeDecodeError:
            error = f"bad metrics from {self.metrics_url}: the body is not UTF-8 text"
        first = self._scrapes == 0
        self._scrapes += 1
        previous = self.board.latest
        state = InstanceState(
            instance=self.instance,
            endpoint=self.endpoint,
            scraped_at_unix_s=time.time(),
            sequence=next(_SEQUENCE),
            healthy=not error,
            error=error,
            **self._last_good.as_fields(self._window),
        )
        self.board.post(state)
        if self._on_health_change is not None and (first or state.healthy != previous.healthy):
            await self._on_health_change(state)
        return state

    async def _fetch(self, session: aiohttp.ClientSession) -> str:
        for attempt in (0, 1):
            try:
                async with session.get(self.metrics_url) as resp:
                    if resp.status != 200:
                        raise _HttpStatus(f"{resp.status} {resp.reason or ''}".strip())
                    if (resp.content_length or 0) > MAX_PAGE_BYTES:
                        raise MetricsParseError(f"the page is {resp.content_length} bytes, over {MAX_PAGE_BYTES}")
                    parts: list[bytes] = []
                    size = 0
                    async for piece in resp.content.iter_any():
                        size += len(piece)
                        if size > MAX_PAGE_BYTES:
                            raise MetricsParseError(f"the page is over {MAX_PAGE_BYTES} bytes")
                        parts.append(piece)
                    body = b"".join(parts)
                return body.decode("utf-8")
            except aiohttp.ServerDisconnectedError:
                # The server closed the pooled keep-alive connection (e.g. it restarted):
                # one retry on a fresh connection before calling the instance unhealthy.
                if attempt:
                    raise
        raise AssertionError("unreachable")


class _HttpStatus(Exception):
    """The metrics URL answered with a status other than 200."""
