"""Which models each endpoint serves, read from its own ``/v1/models`` (issue 15).

vLLM answers ``GET /v1/models`` with the served model name(s) and every loaded LoRA adapter
(``vllm/entrypoints/openai/models/serving.py``: ``show_available_models``), in the OpenAI
shape ``{"object": "list", "data": [{"id": NAME, ...}, ...]}``. :class:`ModelLister` reads
it from every endpoint at start, every ``refresh_s`` after, and soon after :meth:`poke`
(the proxy pokes an endpoint that answered 404: an adapter unloaded, a model swapped; a
reload pokes every endpoint when ``models`` or ``endpoints[].models`` change). The cards of the
last good read are kept (:attr:`ModelLister.cards`): routerd's own ``/v1/models`` answers with them,
merged over the endpoints by :func:`merge_cards`, so a client sees vLLM's fields (``root``,
``parent``, ``max_model_len``, ...) through routerd.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable, Iterable, Mapping, Sequence

import aiohttp

log = logging.getLogger("routerd.models")


#: Largest ``/v1/models`` answer read (bytes): vLLM's, even with hundreds of LoRA adapters, is
#: tens of KiB (about 200 bytes per entry); a larger one is a broken or hostile server, whose
#: body must not be buffered whole (issue 15: 400 MB were, peak RSS 1.4 GB).
MAX_LIST_BYTES = 4 * 1024 * 1024
#: Longest model id kept from a list (characters); longer ids are ignored (no client names them,
#: and each would be kept per endpoint and echoed in every ``/v1/models``).
MAX_ID_CHARS = 1024


def parse_model_cards(body: bytes) -> list[dict[str, Any]]:
    """The model cards (``data`` entries, as sent) of an OpenAI ``/v1/models`` answer, less those
    whose id is over :data:`MAX_ID_CHARS`. vLLM's carry ``id``, ``object``, ``created``,
    ``owned_by``, ``root`` (the model's path, or the adapter's), ``parent`` (a LoRA adapter's base
    model, else null), ``max_model_len`` (null for an adapter) and ``permission``
    (``vllm/entrypoints/openai/models/serving.py``, ``show_available_models``).

    Raises:
        ValueError: not JSON, no ``data`` list, or an entry without a string ``id``.
    """
    doc = json.loads(body)
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ValueError("no 'data' list")
    cards = []
    for i, m in enumerate(data):
        mid = m.get("id") if isinstance(m, dict) else None
        if not isinstance(mid, str) or not mid:
            raise ValueError(f"data[{i}] has no string 'id'")
        if len(mid) <= MAX_ID_CHARS:
            cards.append(m)
    return cards


def parse_models(body: bytes) -> list[str]:
    """The model ids of an OpenAI ``/v1/models`` answer (:func:`parse_model_cards`).

    Raises:
        ValueError: not JSON, no ``data`` list, or an entry without a string ``id``.
    """
    return [c["id"] for c in parse_model_cards(body)]


def merge_cards(ids: Sequence[str], listed: Sequence[Mapping[str, Mapping[str, Any]]],
                created: int) -> list[dict[str, Any]]:
    """One model card per id of ``ids``, in that order: routerd's ``/v1/models`` data.

    ``listed``: the cards (by id) of each endpoint's list, in order of preference (routerd puts
    the ready endpoints first). An id's card is a copy of the first list's that has it, every
    field as the engine sent it, except ``max_model_len``: the smallest integer any list gives
    for the id (a request may land on any endpoint serving it, so the smallest is what a client
    can count on; vLLM's null, an adapter's, is no figure, and stays when no list has one). An
    id no list has (a configured model, a name only a sidecar reported) gets routerd's own card
    ``{"id", "object": "model", "created": created, "owned_by": "phasewise"}`` (``created``:
    Unix time, s).
    """
    out = []
    for mid in ids:
        card: dict[str, Any] | None = None
        lengths = []
        for cards in listed:
            c = cards.get(mid)
            if c is None:
                continue
            if card is None:
                card = dict(c)
            n = c.get("max_model_len")
            if type(n) is int and n > 0:
                lengths.append(n)
        if card is None:
            card = {"id": mid, "object": "model", "created": created, "owned_by": "phasewise"}
        elif lengths:
            card["max_model_len"] = min(lengths)
        out.append(card)
    return out


async def _read_capped(resp: aiohttp.ClientResponse) -> bytes | None:
    """``resp``'s body, or None as soon as it exceeds :data:`MAX_LIST_BYTES` (the rest is not
    read; the connection is then closed, not reused)."""
    if resp.content_length is not None and resp.content_length > MAX_LIST_BYTES:
        return None
    parts, size = [], 0
    async for chunk in resp.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > MAX_LIST_BYTES:
            return None
        parts.append(chunk)
    return b"".join(parts)


#: What :meth:`ModelLister.fetch` returns when the endpoint could not be reached (connect error,
#: timeout): the endpoint's last known list stands (its health is the proxy's business).
UNREACHABLE = object()


class ModelLister:
    """Refreshes the model list of each endpoint.

    A read has three outcomes. A 200 with an OpenAI model list: ``on_models(name, ids)``. Any
    other answer (401/403 from vLLM's ``--api-key``, 404 from a server without the route, a 5xx,
    a body that is not a model list): ``on_models(name, None)``, the endpoint's models are
    unknown from then on and it serves nothing while several models are possible (fail
    closed). No answer at all (connect error, timeout): nothing is reported, the last known
    list stands. An endpoint whose last read failed is read again every ``retry_s``, except
    after a 404: a server without the route has no list to wait for, so it is read again
    only at the next full refresh (``refresh_s``).

    routerd has no upstream API-key setting (requests carry their clients' own
    ``Authorization``), so ``headers`` is empty by default: behind vLLM's ``--api-key`` the
    lists cannot be read and ``endpoints[].models`` must be configured.

    Args:
        endpoints: returns the current (name, base URL) pairs to read.
        on_models: called on the event loop with (name, ids), or (name, None) as above.
        refresh_s: interval between two full refreshes (s).
        timeout_s: bound on one ``/v1/models`` request (s).
        retry_s: interval between reads of an endpoint whose last read failed (s), at most ``refresh_s``.
        headers: sent with every read (e.g. ``Authorization: Bearer KEY``).
    """

    def __init__(self, endpoints: Callable[[], Iterable[tuple[str, str]]],
                 on_models: Callable[[str, list[str] | None], None], *, refresh_s: float = 30.0,
                 timeout_s: float = 5.0, retry_s: float = 2.0, headers: dict[str, str] | None = None) -> None:
        self.endpoints = endpoints
        self.on_models = on_models
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None
        self._poked: set[str] = set()
        self._done: list[asyncio.Future] = []
        """Resolved when the refresh after their :meth:`refresh_all_soon` has ended."""
        self._wake = asyncio.Event()
        self._failing: set[str] = set()
        """Endpoints whose last read failed (other than 404): read again every ``retry_s``."""
        self._no_list: set[str] = set()
        """Endpoints whose ``/v1/models`` answered 404 (no such route) or more than
        :data:`MAX_LIST_BYTES`: no list to wait for, read every ``refresh_s`` only."""
        self.cards: dict[str, tuple[str, dict[str, dict[str, Any]]]] = {}
        """Per endpoint name: (the URL read, its cards by id) of its last usable list, as reported
        to ``on_models``; dropped when a read answers without a usable list or the endpoint goes
        (bounded by :data:`MAX_LIST_BYTES` per endpoint)."""

    async def _session_(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def fetch(self, name: str, url: str) -> Any:
        """The ids ``url``'s ``/v1/models`` lists; None when it answered without a usable list;
        :data:`UNREACHABLE` when it did not answer. Failures are logged once per failing streak."""
        cards = await self.fetch_cards(name, url)
        return [c["id"] for c in cards] if isinstance(cards, list) else cards

    async def fetch_cards(self, name: str, url: str) -> Any:
        """:meth:`fetch`, with the cards (:func:`parse_model_cards`) instead of their ids."""
        session = await self._session_()
        unreachable = False
        try:
            try:
                async with session.get(url + "/v1/models", headers=self.headers) as r:
                    status = r.status
                    body = await _read_capped(r) if status == 200 else b""
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                unreachable = True
                raise ValueError(str(e) or type(e).__name__) from None
            if body is None:
                # Reading it again every retry_s would download MAX_LIST_BYTES each time.
                if name not in self._no_list:
                    self._no_list.add(name)
                    log.warning("endpoint %s: %s/v1/models answered more than %d bytes; its list is unknown "
                                "(read again every %g s)", name, url, MAX_LIST_BYTES, self.refresh_s)
                self._failing.discard(name)
                return None
            if status == 404:
                # No such route: this server has no model list (not vLLM), and asking again every
                # retry_s would not change that; the periodic refresh still notices a new one.
                if name not in self._no_list:
                    self._no_list.add(name)
                    log.warning("endpoint %s: %s/v1/models answered 404: it has no model list; read again "
                                "every %g s", name, url, self.refresh_s)
                self._failing.discard(name)
                return None
            if status != 200:
                raise ValueError(f"HTTP {status}")
            cards = parse_model_cards(body)
        except (ValueError, UnicodeDecodeError) as e:
            if name not in self._failing:
                self._failing.add(name)
                log.warning("endpoint %s: cannot read %s/v1/models (%s); %s", name, url, e,
                            "keeping its last known models" if unreachable
                            else "while several models are possible it serves no model until its list can "
                                 "be read (or endpoints[].models is set)")
            else:
                self._failing.add(name)
            self._no_list.discard(name)
            return UNREACHABLE if unreachable else None
        self._failing.discard(name)
        self._no_list.discard(name)
        return cards

    async def refresh(self, names: set[str] | None = None) -> None:
        """Read the lists of ``names`` (None: every endpoint) concurrently and report them."""
        targets = [(n, u) for n, u in self.endpoints() if names is None or n in names]
        # Read now: a poke still pending for them (e.g. made when they joined) is answered too.
        self._poked.difference_update(n for n, _ in targets)
        results = await asyncio.gather(*(self.fetch_cards(n, u) for n, u in targets))
        # An endpoint moved to another URL during the read: its answer is the old server's.
        current = set(self.endpoints())
        names_now = {n for n, _ in current}
        for gone in [n for n in self.cards if n not in names_now]:
            del self.cards[gone]  # no longer read (gone, or its models are configured now)
        for (n, u), cards in zip(targets, results):
            if cards is UNREACHABLE or (n, u) not in current:
                continue
            if cards is None:
                self.cards.pop(n, None)
                self.on_models(n, None)
            else:
                self.cards[n] = (u, {c["id"]: c for c in cards})
                self.on_models(n, [c["id"] for c in cards])

    def poke(self, name: str) -> None:
        """Refresh ``name`` soon (its answer suggested its models changed)."""
        self._poked.add(name)
        self._wake.set()

    def poke_all(self) -> None:
        """Refresh every endpoint soon (what they serve may have changed: a reload)."""
        self._poked.update(n for n, _ in self.endpoints())
        self._wake.set()

    def refresh_all_soon(self) -> asyncio.Future:
        """:meth:`poke_all`, and a future resolved once that refresh has ended (its lists
        reported); :meth:`run` resolves it, so it stays pending while :meth:`run` is not running."""
        fut = asyncio.get_running_loop().create_future()
        self._done.append(fut)
        self.poke_all()
        return fut

    async def run(self) -> None:
        """Refresh everything every ``refresh_s``, poked endpoints as soon as poked, failing
        ones every ``retry_s``."""
        loop = asyncio.get_running_loop()
        next_full = loop.time() + self.refresh_s
        next_retry = loop.time() + min(self.retry_s, self.refresh_s)
        while True:
            due = next_full if not self._failing else min(next_full, next_retry)
            # asyncio.wait, not wait_for: Python 3.11's wait_for can swallow the task's own
            # cancellation when it races the timeout, and stop() then waits for ever.
            w = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait((w,), timeout=max(0.0, due - loop.time()))
            finally:
                w.cancel()
            self._wake.clear()
            # Taken with the pokes they came with: the refresh below answers them.
            done, self._done = self._done, []
            try:
                now = loop.time()
                if now >= next_full:
                    self._poked.clear()
                    await self.refresh()
                    next_full = loop.time() + self.refresh_s
                    next_retry = loop.time() + min(self.retry_s, self.refresh_s)
                    continue
                todo, self._poked = self._poked, set()
                if now >= next_retry:
                    todo |= self._failing
                    next_retry = now + min(self.retry_s, self.refresh_s)
                if todo:
                    await self.refresh(todo)
            finally:
                for f in done:
                    if not f.done():
                        f.set_result(None)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
