"""Regressions found by trying to break routerd (issue 15): connect-failure cooldown overflow,
host names no resolver takes, stream tails split into many reads, hop-by-hop response headers,
every config mistake in one run, oversized config files."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from daemon_fakes import FakeBackend, start_daemon
from routerd.daemon.config import MAX_CONFIG_BYTES, load_settings, normalize_url
from routerd.daemon.proxy import Proxy, _StreamRelay, final_usage_tokens
from routerd.daemon.router import MAX_COOLDOWN_S
from routerd.daemon.upstream import ConnectError, UpstreamPool
from routerd.errors import ConfigError


def test_thousands_of_connect_failures_keep_the_cooldown_capped():
    async def main():
        b = await FakeBackend("b0").start()
        d = await start_daemon([b])
        try:
            ep = d.router.by_name["b0"]
            for _ in range(2000):  # 2.0 ** 1023 is the largest float power of two
                d.router.note_connect_failure(ep)
            assert 0 < ep.down_until - d.router.clock() <= MAX_COOLDOWN_S
        finally:
            await d.stop()
            await b.stop()

    asyncio.run(main())


@pytest.mark.parametrize("url, message", [
    ("http://a..b:8000", "has an invalid host name 'a..b'"),
    ("http://" + "x" * 64 + ".example:8000", "has an invalid host name"),
    ("http://bücher.example:8000", "is not ASCII: give its IDNA form ('xn--bcher-kva.example')"),
    ("http://10.0.0.1:80#", "must not have a query or fragment"),
    ("http://10.0.0.1:80/?", "must not have a query or fragment"),
])
def test_host_names_and_empty_suffixes_a_resolver_would_refuse(url, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        normalize_url(url)


def test_the_scheme_is_kept_in_lower_case():
    assert normalize_url("HTTP://Vllm-0:8000/") == "http://Vllm-0:8000"


def test_the_pool_turns_an_unencodable_host_into_a_connect_error():
    async def main():
        pool = UpstreamPool(limit=4, connect_timeout_s=2, read_timeout_s=2, response_timeout_s=2)
        try:
            with pytest.raises(ConnectError, match="invalid host name"):
                await pool.request(("http", "a..b", 8000, ""), "/v1/completions", [], b"{}")
        finally:
            await pool.close()

    asyncio.run(main())


@pytest.mark.parametrize("size", [1, 3, 7])
def test_the_end_of_a_stream_is_recognised_however_small_its_reads(size):
    # 9,000 bytes of tokens first: the kept tail is trimmed on the way (at 4 x 2 KiB).
    stream = (b'data: {"choices": [{"text": "a"}]}\n\n' * 250
              + b'data: {"choices": [], "usage": {"completion_tokens": 250}}\n\ndata: [DONE]\n\n')
    ctr = SimpleNamespace(is_closing=lambda: False, write=lambda b: None, get_write_buffer_size=lambda: 0)
    relay = _StreamRelay(ctr, False, None, SimpleNamespace(on_tokens=lambda r, n: None,
                                                           on_first_token=lambda r: None), None)
    for i in range(0, len(stream), size):
        relay.sink(stream[i:i + size])
    tail = relay.tail()
    assert b"data: [DONE]" in tail and final_usage_tokens(tail) == 250
    assert tail == stream[-len(tail):] and len(tail) == 2048
    assert len(relay.t2) <= 4 * 2048 + size
    assert relay.events == 252  # 250 tokens + usage + [DONE]: the proxy subtracts the last two


def test_hop_by_hop_response_headers_are_not_relayed():
    ex = SimpleNamespace(headers=[("Content-Type", "text/event-stream"), ("Proxy-Authenticate", "Basic"),
                                  ("TE", "trailers"), ("Proxy-Connection", "keep-alive"), ("Connection", "X-Hop"),
                                  ("X-Hop", "1"), ("X-Keep", "2")])
    h = Proxy._response_headers(ex)
    assert sorted(h.keys()) == ["Content-Type", "X-Keep"]


def test_duplicate_names_are_reported_with_the_other_field_errors(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("endpoints:\n  - {name: a, url: 'http://h:1'}\n  - {name: a, url: 'http://h:2'}\n"
                 "router: {queue_limit: 0}\n")
    with pytest.raises(ConfigError) as e:
        load_settings(p, environ={})
    lines = str(e.value).splitlines()
    assert lines[0] == "2 configuration errors:"
    assert any("endpoints[1].name: duplicate endpoint name 'a' (also endpoints[0])" in x for x in lines)


def test_an_oversized_config_file_is_refused_before_it_is_parsed(tmp_path):
    p = tmp_path / "big.yaml"
    p.write_bytes(b"# padding\n" * (MAX_CONFIG_BYTES // 10 + 1))
    with pytest.raises(ConfigError, match=f"bytes; the limit is {MAX_CONFIG_BYTES}"):
        load_settings(p, environ={})
