"""Passive health (outlier ejection) and random tie-breaks in routerd (issue 15), with real HTTP
servers on loopback: an instance that answers 500 to everything, one that never answers, and
idle clusters where every instance ties."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import pytest
from aiohttp import web

from daemon_fakes import FakeBackend, sample, serve_app, start_daemon


class BadBackend:
    """An OpenAI-shaped server on 127.0.0.1 that answers ``status`` to every request, or (``hang``)
    reads the request and never answers. ``healed`` makes it answer like a healthy instance."""

    def __init__(self, name: str, status: int = 500, hang: bool = False) -> None:
        self.name, self.status, self.hang = name, status, hang
        self.healed = False
        self.hits = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        await request.read()
        if self.healed:
            return web.json_response({"id": "c", "object": "text_completion", "created": 1, "model": "m",
                                      "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
        if self.hang:
            await asyncio.sleep(3600)
        return web.json_response({"object": "error", "message": "boom", "type": "InternalServerError",
                                  "code": self.status}, status=self.status)

    async def start(self) -> "BadBackend":
        app = web.Application()
        app.router.add_post("/v1/completions", self._serve)
        self._runner, self.port = await serve_app(app, handler_cancellation=True, shutdown_timeout=0.1)
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


async def _complete(session, base: str) -> int:
    async with session.post(base + "/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 2}) as r:
        await r.read()
        return r.status


def _decisions(d) -> Counter:
    return Counter(name for (_, _, name, *_rest) in d.router.decisions)


@pytest.mark.parametrize("hang", [False, True], ids=["always-500", "hung"])
def test_a_failing_instance_is_ejected_then_gets_almost_nothing_and_returns_when_healed(hang):
    """Target: a hung or always-500 backend gets <= 5% of requests after its first ejection."""
    async def main():
        good = [await FakeBackend(f"g{i}").start() for i in range(2)]
        bad = await BadBackend("bad", hang=hang).start()
        outlier = {"consecutive_errors": 3, "base_ejection_s": 2.0, "max_ejection_s": 10.0}
        # The hung instance's requests end by the response timeout; 3 s is far above the healthy
        # instances' answers even on a loaded machine (they must not time out and be ejected).
        d = await start_daemon([*good, bad], policy={"name": "round_robin"},
                               upstream={"response_timeout_s": 3.0 if hang else 600.0, "outlier": outlier})
        base = f"http://127.0.0.1:{d.http_port}"
        try:
            async with aiohttp.ClientSession() as s:
                codes = Counter()
                # Concurrent clients, as in production: the hung instance's requests overlap.
                for _ in range(10):
                    codes.update(await asyncio.gather(*(_complete(s, base) for _ in range(6))))
                    if sample(d, "phasewise_endpoint_ejections_total", endpoint="bad") >= 1:
                        break
                assert sample(d, "phasewise_endpoint_ejections_total", endpoint="bad") == 1
                assert sample(d, "phasewise_endpoint_ejected", endpoint="bad") == 1
                async with s.get(base + "/readyz") as r:
                    assert r.status == 200 and (await r.json())["ejected"] == ["bad"]
                hits_at_ejection = bad.hits
                after = Counter()
                for _ in range(10):
                    after.update(await asyncio.gather(*(_complete(s, base) for _ in range(10))))
                assert after == {200: 100}  # nothing goes to the ejected instance
                assert bad.hits == hits_at_ejection
                assert (bad.hits - hits_at_ejection) / 100 <= 0.05
                # Healed and back after its ejection: one success ends its probation.
                bad.healed = True
                await asyncio.sleep(2.2)
                got = Counter(await asyncio.gather(*(_complete(s, base) for _ in range(30))))
                assert got == {200: 30} and bad.hits > hits_at_ejection
                assert sample(d, "phasewise_endpoint_ejected", endpoint="bad") == 0
                ep = d.router.by_name["bad"]
                assert (ep.probation, ep.ejections, ep.consecutive_errors) == (False, 0, 0)
        finally:
            await d.stop()
            for b in (*good, bad):
                await b.stop()

    asyncio.run(main())


def test_ejection_time_grows_and_probation_re_ejects_on_one_failure():
    async def main():
        good = await FakeBackend("g").start()
        bad = await BadBackend("bad").start()
        outlier = {"consecutive_errors": 2, "base_ejection_s": 0.5, "max_ejection_s": 1.2,
                   "max_ejected_percent": 50}
        d = await start_daemon([good, bad], policy={"name": "round_robin"}, upstream={"outlier": outlier})
        base = f"http://127.0.0.1:{d.http_port}"
        ep = d.router.by_name["bad"]
        try:
            async with aiohttp.ClientSession() as s:
                for _ in range(4):  # round robin: two of these reach "bad"
                    await _complete(s, base)
                now = d.router.clock()
                assert ep.ejections == 1 and 0.3 < ep.ejected_until - now <= 0.5
                await asyncio.sleep(0.6)
                for _ in range(2):  # back on probation: its first failure ejects it again
                    await _complete(s, base)
                now = d.router.clock()
                assert ep.ejections == 2 and 0.8 < ep.ejected_until - now <= 1.0  # 2 x base
                await asyncio.sleep(1.1)
                for _ in range(2):
                    await _complete(s, base)
                assert ep.ejections == 3 and ep.ejected_until - d.router.clock() <= 1.2  # capped
                assert sample(d, "phasewise_endpoint_ejections_total", endpoint="bad") == 3
        finally:
            await d.stop()
            await good.stop()
            await bad.stop()

    asyncio.run(main())


def test_the_ejection_cap_keeps_half_the_endpoints_serving():
    async def main():
        bads = [await BadBackend(f"b{i}").start() for i in range(4)]
        outlier = {"consecutive_errors": 1, "base_ejection_s": 30.0, "max_ejected_percent": 50}
        d = await start_daemon(bads, policy={"name": "round_robin"}, upstream={"outlier": outlier})
        base = f"http://127.0.0.1:{d.http_port}"
        try:
            async with aiohttp.ClientSession() as s:
                codes = [await _complete(s, base) for _ in range(12)]
            assert codes == [500] * 12  # relayed as the instances said
            ejected = [b.name for b in bads if sample(d, "phasewise_endpoint_ejected", endpoint=b.name) == 1]
            assert len(ejected) == 2  # 50% of 4
            assert sample(d, "phasewise_endpoint_ejections_capped_total") >= 1
        finally:
            await d.stop()
            for b in bads:
                await b.stop()

    asyncio.run(main())


@pytest.mark.parametrize("policy", ["join_shortest_queue", "late_binding", "least_outstanding_tokens"])
def test_ties_go_to_a_random_instance_not_the_lowest_index(policy):
    """Issue 15: one client sending one request at a time to join_shortest_queue sent 80 of 80 to
    the first instance (every instance idle at each decision: a tie, broken by lowest index)."""
    async def main():
        backs = [await FakeBackend(f"b{i}").start() for i in range(3)]
        d = await start_daemon(backs, policy={"name": policy}, router={"tie_break_seed": 7})
        base = f"http://127.0.0.1:{d.http_port}"
        try:
            async with aiohttp.ClientSession() as s:
                for _ in range(90):
                    assert await _complete(s, base) == 200
            share = _decisions(d)
            assert sum(share.values()) == 90 and set(share) == {"b0", "b1", "b2"}
            assert max(share.values()) <= 1.3 * 30, share  # the balance target
        finally:
            await d.stop()
            for b in backs:
                await b.stop()

    asyncio.run(main())


def test_round_robin_keeps_its_order_and_a_seed_replays_the_same_choices():
    async def main():
        backs = [await FakeBackend(f"b{i}").start() for i in range(3)]
        runs = []
        for policy, seed in (("round_robin", None), ("join_shortest_queue", 11), ("join_shortest_queue", 11)):
            d = await start_daemon(backs, policy={"name": policy}, router={"tie_break_seed": seed})
            base = f"http://127.0.0.1:{d.http_port}"
            try:
                async with aiohttp.ClientSession() as s:
                    for _ in range(9):
                        await _complete(s, base)
                runs.append([name for (_, _, name, *_r) in d.router.decisions])
            finally:
                await d.stop()
        for b in backs:
            await b.stop()
        assert runs[0] == ["b0", "b1", "b2"] * 3  # order-sensitive: not shuffled
        assert runs[1] == runs[2]  # the same seed, the same choices

    asyncio.run(main())
