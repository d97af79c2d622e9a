"""Which models each endpoint serves, read from its own ``/v1/models`` (issue 15).

vLLM answers ``GET /v1/models`` with the served model name(s) and every loaded LoRA adapter
(``vllm/entrypoints/openai/serving_models.py``: ``show_available_models``), in the OpenAI
shape ``{"object": "list", "data": [{"id": NAME, ...}, ...]}``. :class:`ModelLister` reads
it from every endpoint at start, every ``refresh_s`` after, and soon after :meth:`poke`
(the proxy pokes an endpoint that answered 404: an adapter unloaded, a model swapped).
A failed read keeps the endpoint's last known list (``on_models(name, None)``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable, Iterable

import aiohttp

log = logging.getLogger("routerd.models")


def parse_models(body: bytes) -> list[str]:
    """The model ids of an OpenAI ``/v1/models`` answer.

    Raises:
        ValueError: not JSON, no ``data`` list, or an entry without a string ``id``.
    """
    doc = json.loads(body)
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ValueError("no 'data' list")
    ids = []
    for i, m in enumerate(data):
        mid = m.get("id") if isinstance(m, dict) else None
        if not isinstance(mid, str) or not mid:
            raise ValueError(f"data[{i}] has no string 'id'")
        ids.append(mid)
    return ids


class ModelLister:
    """Refreshes the model list of each endpoint.

    Args:
        endpoints: returns the current (name, base URL) pairs.
        on_models: called on the event loop with (name, ids), or (name, None) after a failed read.
        refresh_s: interval between two full refreshes (s).
        timeout_s: bound on one ``/v1/models`` request (s).
    """

    def __init__(self, endpoints: Callable[[], Iterable[tuple[str, str]]],
                 on_models: Callable[[str, list[str] | None], None], *, refresh_s: float = 30.0,
                 timeout_s: float = 5.0) -> None:
        self.endpoints = endpoints
        self.on_models = on_models
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._poked: set[str] = set()
        self._wake = asyncio.Event()
        self._failing: set[str] = set()

    async def _session_(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def fetch(self, name: str, url: str) -> list[str] | None:
        """The ids ``url``'s ``/v1/models`` lists, or None (logged once per failing streak)."""
        session = await self._session_()
        try:
            async with session.get(url + "/v1/models") as r:
                body = await r.read()
                if r.status != 200:
                    raise ValueError(f"HTTP {r.status}")
            ids = parse_models(body)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, UnicodeDecodeError) as e:
            if name not in self._failing:
                self._failing.add(name)
                log.warning("endpoint %s: cannot read %s/v1/models (%s); keeping its last known models",
                            name, url, str(e) or type(e).__name__)
            return None
        self._failing.discard(name)
        return ids

    async def refresh(self, names: set[str] | None = None) -> None:
        """Read the lists of ``names`` (None: every endpoint) concurrently and report them."""
        targets = [(n, u) for n, u in self.endpoints() if names is None or n in names]
        results = await asyncio.gather(*(self.fetch(n, u) for n, u in targets))
        for (n, _), ids in zip(targets, results):
            self.on_models(n, ids)

    def poke(self, name: str) -> None:
        """Refresh ``name`` soon (its answer suggested its models changed)."""
        self._poked.add(name)
        self._wake.set()

    async def run(self) -> None:
        """Refresh everything every ``refresh_s``, and poked endpoints as soon as poked."""
        loop = asyncio.get_running_loop()
        next_full = loop.time() + self.refresh_s
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.0, next_full - loop.time()))
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if loop.time() >= next_full:
                self._poked.clear()
                await self.refresh()
                next_full = loop.time() + self.refresh_s
            elif self._poked:
                poked, self._poked = self._poked, set()
                await self.refresh(poked)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
