"""Every answered request is counted once in ``phasewise_requests_total`` by its status code
(issue 15, item 8): 404s routerd answers before dispatch (unknown model, unknown path), 404s
an instance answers (streamed and not), 405s, and the 200s beside them."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from daemon_fakes import sample, serve_app, start_daemon


async def _instance():
    """An instance serving only model ``m``; any other model is vLLM's 404 JSON, even for stream=True."""
    async def completions(request):
        body = await request.json()
        if body.get("model") != "m":
            return web.json_response({"object": "error", "message": f"The model `{body.get('model')}` does not exist.",
                                      "type": "NotFoundError", "param": None, "code": 404}, status=404)
        return web.json_response({"id": "c", "object": "text_completion", "model": "m",
                                  "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return await serve_app(app)


def test_each_answer_is_counted_once_by_its_status_code():
    async def main():
        runner, port = await _instance()
        # Two daemons: one that knows its model list (404 before dispatch), one with none
        # configured (it passes the request on and relays the instance's 404).
        known = await start_daemon(endpoints=[{"name": "i0", "url": f"http://127.0.0.1:{port}"}], models=["m"])
        passthrough = await start_daemon(endpoints=[{"name": "i0", "url": f"http://127.0.0.1:{port}"}], models=[])
        try:
            async with aiohttp.ClientSession() as s:
                async def post(d, path, **body):
                    async with s.post(f"http://127.0.0.1:{d.http_port}{path}", json=body) as r:
                        await r.read()
                        return r.status

                got_known = [await post(known, "/v1/completions", model="zzz", prompt="p"),
                             await post(known, "/v1/completions", model="zzz", prompt="p", stream=True),
                             await post(known, "/v1/nope", model="m"),
                             await post(known, "/v1/completions", model="m", prompt="p")]
                async with s.get(f"http://127.0.0.1:{known.http_port}/v1/completions") as r:
                    got_known.append(r.status)
                got_pass = [await post(passthrough, "/v1/completions", model="zzz", prompt="p"),
                            await post(passthrough, "/v1/completions", model="zzz", prompt="p", stream=True),
                            await post(passthrough, "/v1/completions", model="m", prompt="p")]
            assert got_known == [404, 404, 404, 200, 405]
            assert got_pass == [404, 404, 200]
            assert sample(known, "phasewise_requests_total", code="404") == 3
            assert sample(known, "phasewise_requests_total", code="405") == 1
            assert sample(known, "phasewise_requests_total", code="200") == 1
            assert sample(passthrough, "phasewise_requests_total", code="404") == 2
            assert sample(passthrough, "phasewise_requests_total", code="200") == 1
            # Scrapes and probes are not requests to count.
            async with aiohttp.ClientSession() as s:
                for path in ("/metrics", "/healthz", "/readyz"):
                    async with s.get(f"http://127.0.0.1:{known.http_port}{path}") as r:
                        await r.read()
            assert sample(known, "phasewise_requests_total", code="200") == 1
        finally:
            await known.stop()
            await passthrough.stop()
            await runner.cleanup()

    asyncio.run(main())
