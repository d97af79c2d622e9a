"""The sidecar against a hostile ``/metrics`` server and the emulator against hostile bodies
(regressions of adversarial tests)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from routerd.emulator.server import EmulatorSettings, start_emulator
from routerd.sidecar import scraper as scraper_mod
from routerd.sidecar.metrics import MetricsParseError, parse_vllm_metrics
from routerd.sidecar.scraper import Scraper

GOOD = "vllm:num_requests_running 1\nvllm:num_requests_waiting 2\nvllm:kv_cache_usage_perc 0.5\n"


def test_negative_values_are_not_a_vllm_page():
    for page in (GOOD.replace(" 1\n", " -3\n"), GOOD.replace("0.5", "-0.5"),
                 GOOD + "vllm:time_to_first_token_seconds_sum -1\nvllm:time_to_first_token_seconds_count 1\n"):
        with pytest.raises(MetricsParseError, match="negative"):
            parse_vllm_metrics(page)


@pytest.mark.parametrize("announced", [True, False])
def test_a_huge_metrics_page_is_refused_without_reading_it_all(monkeypatch, announced):
    monkeypatch.setattr(scraper_mod, "MAX_PAGE_BYTES", 256 * 1024)

    async def main():
        written, served = [0], asyncio.Event()

        async def metrics(request):
            filler = ("# " + "x" * 1000 + "\n") * 1000  # ~1 MB, four times the limit
            if announced:
                return web.Response(text=GOOD + filler)
            resp = web.StreamResponse()  # chunked: no Content-Length to check up front
            await resp.prepare(request)
            try:
                for _ in range(100):
                    await resp.write(filler.encode())
                    written[0] += 1
            except ConnectionError:
                pass
            finally:
                served.set()
            return resp

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        sc = Scraper(f"http://127.0.0.1:{port}/metrics", instance="i", timeout_s=20.0)
        try:
            async with aiohttp.ClientSession() as s:
                st = await sc.scrape_once(s)
                assert not st.healthy and "bytes" in st.error, st.error
                if not announced:
                    # The scraper stopped reading at the limit and closed: the server's writes
                    # blocked, then failed, long before all 100 MB were sent. (A count, not a
                    # time: issue 19, a busy machine must not fail a test.)
                    await asyncio.wait_for(served.wait(), 30)
                    assert written[0] < 50, f"{written[0]} of 100 1-MB chunks were sent"
        finally:
            await runner.cleanup()
    asyncio.run(main())


def test_the_emulator_answers_400_to_json_the_parser_cannot_take():
    async def main():
        emu = await start_emulator(EmulatorSettings(host="127.0.0.1", port=0, fixed_timing=(0.0, 0.0)))
        try:
            async with aiohttp.ClientSession() as s:
                for data in (b"[" * 100_000, b'{"model": "llama-2-7b", "prompt": "a", "max_tokens": ' + b"9" * 5000
                             + b"}"):
                    async with s.post(emu.url + "/v1/completions", data=data) as r:
                        assert r.status == 400
                        # vLLM's (FastAPI's) answer to both, checked against a real vLLM 0.32.
                        assert await r.json() == {"detail": "There was an error parsing the body"}
        finally:
            await emu.close()
    asyncio.run(main())
