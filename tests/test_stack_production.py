"""Issue 15's production cases with real processes on loopback (deliverable 9).

Each test starts its own ``phasewise serve`` (``python -m routerd serve``) in front of
``phasewise emulate`` instances (profile llama2-7b-a100, as in ``test_stack_e2e``), with
sidecars where the case is about what routerd learns from the instances, and drives it with
the official ``openai`` client or raw sockets. The same behaviour is unit-tested in-process
in ``test_daemon_models``, ``test_daemon_outliers``, ``test_daemon_frontend``,
``test_daemon_config_safety``, ``test_daemon_hardening`` and ``test_daemon_status_counts``;
here it is checked through the process boundary: flags, environment variables, config files,
signals, exit codes and ``/metrics`` as an operator sees them.

1. Two instances serving different models, no ``models`` configured: ``/v1/models`` is
   the union read from them, every request reaches an instance serving its model (the
   instances' own ``vllm:request_success_total``), an unknown model is 404 before dispatch.
2. A hung instance beside two healthy ones is ejected (default outlier settings); afterwards
   no request reaches it.
3. 50 silent client connections are closed by the header timeout, a stalled body gets 408,
   while normal requests are answered.
4. A config file truncated to empty (file watcher, then SIGHUP) is refused and the running
   endpoints kept; a good file with another endpoint list applies. ``serve`` with an empty
   file exits 2.
5. Oracle policies and endpoint URLs routerd cannot dial are refused at start: exit 2, one
   line naming the field, no traceback.
6. ``phasewise_requests_total`` counts 200s and routerd's own 404s exactly.

Every wait polls state with a bounded deadline and a message (``stack_processes.wait_until``);
no assertion is on elapsed time. Every process is stopped by the ``start_stack`` fixture, which
also checks that none is left running and that no log holds a traceback.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import socket
import time
from collections import Counter
from typing import Any, Callable

import openai
import pytest

from routerd.daemon.config import servable_policies
from routerd.policies.registry import POLICIES
from stack_processes import (HungServer, Stack, aclient, client, http_get, http_post, metric_by, metric_sum,
                             routerd_metrics, run_routerd, scrape, wait_until)

MODEL = "llama-2-7b"  # the emulator's default model name
OTHER_MODEL = "mistral-7b-instruct"
PROFILE = "llama2-7b-a100"
TIMEOUT_S = 60.0  # per request, and for every condition polled: far above what a loaded machine needs


# -- helpers -----------------------------------------------------------------------------

@pytest.fixture
def start_stack(tmp_path):
    """``start_stack(n=..., **Stack options)`` -> a started :class:`Stack` (emulators get the
    module's profile); every stack is stopped at teardown, which fails if one left a process
    running or logged a traceback."""
    stacks: list[Stack] = []

    def start(**kw: Any) -> Stack:
        logdir = tmp_path / f"stack{len(stacks)}"
        logdir.mkdir()
        kw["emulator_flags"] = ("--profile", PROFILE, *kw.get("emulator_flags", ()))
        s = Stack(logdir, **kw)
        stacks.append(s)
        s.start()
        return s

    yield start
    leaks, tracebacks = [], []
    for s in stacks:
        leaks += s.close_checked()
        tracebacks += [f"{p.name}:\n{p.log_text()[-4000:]}" for p in s.all_processes() if "Traceback" in p.log_text()]
    assert not leaks, f"processes left running after teardown: {leaks}"
    assert not tracebacks, "a process logged an exception:\n" + "\n".join(tracebacks)


def served_by_model(url: str) -> dict[str, float]:
    """An emulator's finished requests by served model: ``vllm:request_success_total`` summed over
    ``finished_reason``, keyed by ``model_name``."""
    out: Counter = Counter()
    for name, labels, value in scrape(url + "/metrics"):
        if name == "vllm:request_success_total":
            out[labels["model_name"]] += value
    return dict(out)


def served(s: Stack) -> list[float]:
    """Finished requests of each emulator of ``s`` (all models)."""
    return [sum(served_by_model(url).values()) for url in s.emulator_urls]


def decisions(s: Stack) -> dict[str, float]:
    """routerd's ``phasewise_decisions_total`` by endpoint."""
    return metric_by(routerd_metrics(s), "phasewise_decisions_total", "endpoint")


def readyz(s: Stack) -> tuple[int, dict]:
    status, body = http_get(s.url + "/readyz")
    return status, (json.loads(body) if body else {})


def complete(c: openai.OpenAI, model: str, i: int, n: int = 3) -> None:
    """One request of kind ``i % 4`` (completion, chat, streamed completion, streamed chat), checked:
    answered 200 by an instance serving ``model`` with ``n`` tokens."""
    chat, stream = i % 2 == 1, i % 4 >= 2
    msgs = [{"role": "user", "content": f"request {i}"}]
    if not stream:
        if chat:
            raw = c.chat.completions.with_raw_response.create(model=model, messages=msgs, max_tokens=n)
        else:
            raw = c.completions.with_raw_response.create(model=model, prompt=f"request {i}", max_tokens=n)
        assert raw.status_code == 200
        r = raw.parse()
        assert (r.model, r.usage.completion_tokens) == (model, n), r
        return
    if chat:
        st = c.chat.completions.create(model=model, messages=msgs, max_tokens=n, stream=True)
    else:
        st = c.completions.create(model=model, prompt=f"request {i}", max_tokens=n, stream=True)
    assert st.response.status_code == 200
    with st:
        chunks = list(st)
    assert {ch.model for ch in chunks} == {model}
    assert sum(bool(ch.choices and (ch.choices[0].delta.content if chat else ch.choices[0].text))
               for ch in chunks) == n


def wait_counts(probe: Callable[[], Any], want: Any, what: str) -> Any:
    """Poll ``probe()`` until it equals ``want`` (counters written once a request has ended)."""
    return wait_until(probe, lambda v: v == want, TIMEOUT_S, what)


# -- 1. several models, discovered from the instances -----------------------------------------

@pytest.mark.parametrize("policy", ["round_robin", "join_shortest_queue"])
def test_two_models_are_discovered_and_every_request_reaches_an_instance_serving_its_model(start_stack, policy):
    s = start_stack(n=2, per_emulator_flags=(("--model", MODEL), ("--model", OTHER_MODEL)),
                    routerd_flags=("--policy", policy))
    with client(s) as c:
        wait_until(lambda: sorted(m.id for m in c.models.list()), lambda ids: ids == sorted([MODEL, OTHER_MODEL]),
                   TIMEOUT_S, "routerd's /v1/models listing both instances' models")
    before_served, before_dec = [served_by_model(u) for u in s.emulator_urls], decisions(s)
    rng = random.Random(15)
    wanted = [MODEL] * 20 + [OTHER_MODEL] * 20
    rng.shuffle(wanted)

    async def one(c: openai.AsyncOpenAI, i: int, model: str) -> str:
        chat, stream, n = i % 2 == 1, i % 4 >= 2, 2 + i % 5
        msgs = [{"role": "user", "content": f"request {i}"}]
        if not stream:
            if chat:
                raw = await c.chat.completions.with_raw_response.create(model=model, messages=msgs, max_tokens=n)
            else:
                raw = await c.completions.with_raw_response.create(model=model, prompt=f"r {i}", max_tokens=n)
            assert raw.status_code == 200
            r = raw.parse()
            assert (r.model, r.usage.completion_tokens) == (model, n)
            return r.model
        if chat:
            st = await c.chat.completions.create(model=model, messages=msgs, max_tokens=n, stream=True)
        else:
            st = await c.completions.create(model=model, prompt=f"r {i}", max_tokens=n, stream=True)
        assert st.response.status_code == 200
        async with st:
            got = {ch.model async for ch in st}
        assert got == {model}
        return model

    async def main() -> list:
        async with aclient(s) as c:  # concurrent, so that join_shortest_queue sees load
            return await asyncio.gather(*(one(c, i, m) for i, m in enumerate(wanted)), return_exceptions=True)

    results = asyncio.run(main())
    failed = [(i, repr(r)) for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of 40 failed, e.g. {failed[:3]}\n{s.logs()}"
    # Each instance finished exactly the requests of its own model, and routerd sent it those only.
    want_served = [{MODEL: before_served[0].get(MODEL, 0) + 20},
                   {OTHER_MODEL: before_served[1].get(OTHER_MODEL, 0) + 20}]
    wait_counts(lambda: [served_by_model(u) for u in s.emulator_urls], want_served,
                "each emulator's vllm:request_success_total of its own model")
    after_dec = decisions(s)
    assert {e: after_dec[e] - before_dec.get(e, 0) for e in s.names} == {"emu0": 20, "emu1": 20}

    with client(s) as c:
        # While some endpoint's list is still being read, routerd answers an unknown model with
        # a retryable 503 (a model that list might hold); once every list is known, 404. The
        # sidecars' names can complete /v1/models before the lists are read, so wait for it.
        def unknown_status():
            try:
                c.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
            except openai.APIStatusError as e:
                return e.status_code
            return 200
        assert wait_until(unknown_status, lambda st: st == 404, TIMEOUT_S,
                          "every model list read: an unknown model answered 404, not 503") == 404
        for call in (lambda: c.completions.create(model="no-such-model", prompt="hi", max_tokens=2),
                     lambda: c.chat.completions.create(model="no-such-model", max_tokens=2, stream=True,
                                                       messages=[{"role": "user", "content": "hi"}])):
            with pytest.raises(openai.NotFoundError) as ei:
                call()
            assert ei.value.status_code == 404
            body = ei.value.body  # the client keeps the ``error`` object, or the whole body
            assert isinstance(body, dict), body
            assert body.get("error", body)["code"] == "model_not_found", body
    m = routerd_metrics(s)
    assert metric_by(m, "phasewise_decisions_total", "endpoint") == after_dec  # dispatched nowhere
    assert metric_sum(m, "phasewise_rejections_total", reason="not_found") == 3  # the wait's first 404 too
    assert [served_by_model(u) for u in s.emulator_urls] == want_served


# -- 2. a hung instance is ejected -----------------------------------------------------------

@pytest.fixture
def hung():
    with HungServer() as h:
        yield h


def test_a_hung_instance_is_ejected_and_then_gets_no_request(hung, start_stack):
    timeout_s = 3.0  # the healthy instances answer 4 tokens in well under this, even on a loaded machine
    s = start_stack(n=2, sidecars=False, extra_endpoints=(f"hung={hung.url}",),
                    routerd_flags=("--model", MODEL, "--policy", "round_robin"),
                    routerd_env={"PHASEWISE_UPSTREAM__RESPONSE_TIMEOUT_S": str(timeout_s)})
    assert readyz(s) == (200, {"status": "ready", "reason": "ok", "ejected": [], "unhealthy": []})

    async def batch(k: int) -> list[int]:
        async with aclient(s) as c:
            async def one(i: int) -> int:
                try:
                    raw = await c.completions.with_raw_response.create(model=MODEL, prompt=f"p {i}", max_tokens=4)
                    return raw.status_code
                except openai.APIStatusError as e:
                    return e.status_code
            return list(await asyncio.gather(*(one(i) for i in range(k))))

    # Concurrent batches until the hung instance's 5 consecutive timeouts eject it (round robin
    # hands it every third request: one batch of 15 is usually enough).
    codes: Counter = Counter()
    deadline = time.monotonic() + TIMEOUT_S
    while "hung" not in readyz(s)[1].get("ejected", []):
        assert time.monotonic() < deadline, f"hung instance not ejected; answers so far {codes}\n{s.logs()}"
        codes.update(asyncio.run(batch(15)))
    assert set(codes) <= {200, 504}, codes
    # Every request routed to it, and only those, timed out (504); the others were answered.
    wait_counts(lambda: len(hung.request_lines()), codes[504], "the hung instance's requests all recorded")
    assert set(hung.request_lines()) == {"POST /v1/completions HTTP/1.1"}
    m = routerd_metrics(s)
    assert metric_sum(m, "phasewise_endpoint_ejections_total", endpoint="hung") == 1
    assert metric_sum(m, "phasewise_upstream_errors_total", endpoint="hung", kind="timeout") == codes[504]
    assert metric_sum(m, "phasewise_endpoint_ejected", endpoint="hung") == 1

    hits, dec = len(hung.request_lines()), decisions(s)
    with client(s) as c:
        for i in range(20):
            complete(c, MODEL, i)
    after = decisions(s)
    assert {e: after[e] - dec[e] for e in after} == {"emu0": 10, "emu1": 10, "hung": 0}
    assert len(hung.request_lines()) == hits
    # Still within its first ejection (30 s by default): the 20 requests ran while it was out.
    assert readyz(s) == (200, {"status": "ready", "reason": "ok", "ejected": ["hung"], "unhealthy": []})


# -- 3. silent and slow clients ---------------------------------------------------------------

def _read_to_eof(sock: socket.socket, deadline: float) -> bytes:
    """Everything ``sock`` receives until the peer closes it; fails at ``deadline`` (monotonic s)."""
    data = b""
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"connection still open at the hang bound; received {data!r}") from None
        if not chunk:
            return data
        data += chunk


def test_silent_and_stalled_clients_are_closed_while_normal_requests_are_answered(start_stack):
    s = start_stack(n=2, sidecars=False, routerd_flags=("--model", MODEL),
                    routerd_env={"PHASEWISE_HTTP__HEADER_TIMEOUT_S": "1", "PHASEWISE_HTTP__BODY_TIMEOUT_S": "1"})
    host, port = s.url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "p", "max_tokens": 2}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    silent: list[socket.socket] = []
    stalled = socket.create_connection((host, int(port)), timeout=TIMEOUT_S)
    try:
        stalled.sendall(head + body[:5])  # the headers whole, then the body stops
        with client(s) as c:
            # Five new silent connections before each normal request: it is answered beside them.
            for i in range(10):
                silent += [socket.create_connection((host, int(port)), timeout=TIMEOUT_S) for _ in range(5)]
                complete(c, MODEL, i)
        # A hang bound, not a speed target: routerd closes them after 1 s (plus its sweep).
        deadline = time.monotonic() + TIMEOUT_S
        assert [_read_to_eof(x, deadline) for x in silent] == [b""] * 50  # closed without an answer
        answer = _read_to_eof(stalled, deadline)
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    finally:
        for x in (stalled, *silent):
            x.close()
    m = wait_until(lambda: routerd_metrics(s),
                   lambda m: metric_sum(m, "phasewise_client_connections_closed_total", reason="header_timeout") >= 50,
                   TIMEOUT_S, "routerd counting the closed silent connections")
    assert metric_sum(m, "phasewise_client_connections_closed_total", reason="header_timeout") == 50
    assert metric_by(m, "phasewise_requests_total", "code") == {"200": 10, "408": 1}


# -- 4. config safety through a real process ---------------------------------------------------

def test_an_emptied_config_file_is_refused_and_a_good_one_applies(start_stack):
    s = start_stack(n=2, sidecars=False, config={"models": [MODEL], "reload": {"poll_interval_s": 0.2,
                                                                               "settle_s": 0.2}})
    path = s.config_path
    assert path is not None
    good = path.read_text()

    def reloads() -> dict[str, float]:
        return metric_by(routerd_metrics(s), "phasewise_config_reloads_total", "result")

    def serves_both(k: int = 4) -> None:
        """Requests answered 200, round robin spreading them over both endpoints; /readyz ready."""
        dec = decisions(s)
        with client(s) as c:
            for i in range(k):
                complete(c, MODEL, i)
        after = decisions(s)
        assert {e: after[e] - dec.get(e, 0) for e in after} == {"emu0": k / 2, "emu1": k / 2}
        assert readyz(s) == (200, {"status": "ready", "reason": "ok", "ejected": [], "unhealthy": []})

    serves_both()
    refused = f"reload refused, keeping the running configuration: config {path}: the file is empty; refused"
    path.write_text("")  # what a truncate-then-write leaves behind for a moment
    wait_counts(lambda: reloads().get("error"), 1, "the file watcher refusing the empty file")
    assert s.routerd.log_text().count(refused) == 1
    serves_both()
    s.routerd.signal(signal.SIGHUP)
    wait_counts(lambda: reloads().get("error"), 2, "SIGHUP refusing the empty file")
    assert s.routerd.log_text().count(refused) == 2
    serves_both()
    assert s.routerd.alive()

    # A good file that drops emu0 applies (the watcher), and only emu1 is sent requests afterwards.
    path.write_text(good.replace(f"- name: emu0\n  url: {s.emulator_urls[0]}\n", ""))
    assert "emu0" not in path.read_text() and "emu1" in path.read_text()
    wait_counts(lambda: reloads(), {"error": 2, "ok": 1}, "the watcher applying the good file")
    assert "reloaded: policy round_robin, endpoints: 1" in s.routerd.log_text()
    before = served(s)
    with client(s) as c:
        for i in range(4):
            complete(c, MODEL, i)
    wait_counts(lambda: served(s), [before[0], before[1] + 4], "emu1 finishing all 4 requests")
    assert set(decisions(s)) == {"emu1"}  # emu0's series went with it
    assert reloads() == {"error": 2, "ok": 1}  # the rewrite was never read half-way


def _one_line_error(rc: int, out: str) -> str:
    """The single error line of a ``serve`` that refused to start (exit 2, no traceback)."""
    assert rc == 2, out
    assert "Traceback" not in out, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("phasewise: error: "), out
    return lines[0][len("phasewise: error: "):]


def test_serve_with_an_empty_config_file_exits_2_naming_the_file(tmp_path):
    path = tmp_path / "routerd.yaml"
    path.write_text("")
    err = _one_line_error(*run_routerd("serve-empty", ["serve", "--config", str(path), "--port", "0"], tmp_path))
    assert err == (f"config {path}: the file is empty; refused (a half-written file?). "
                   "Write `{}` to mean all defaults")


# -- 5. settings refused at start -----------------------------------------------------------------

ORACLES = sorted(name for name, cls in POLICIES.items() if cls.oracle)


@pytest.mark.parametrize("how", ["flag", "env"])
@pytest.mark.parametrize("policy", ORACLES)
def test_serve_refuses_an_oracle_policy_and_lists_the_servable_ones(tmp_path, policy, how):
    assert ORACLES == ["decode_balancer", "oracle"]
    args, env, source = ["serve", "--port", "0"], {}, "flag --policy"
    if how == "flag":
        args += ["--policy", policy]
    else:
        env, source = {"PHASEWISE_POLICY__NAME": policy}, "environment variable PHASEWISE_POLICY__NAME"
    err = _one_line_error(*run_routerd(f"serve-{policy}-{how}", args, tmp_path, env=env))
    servable = [n for n in POLICIES if n not in ORACLES]
    assert servable == servable_policies()
    assert err == (f"{source}: policy.name: reads true output lengths, so it runs only in the simulator: "
                   f"{policy!r}; servable: {', '.join(servable)}")


@pytest.mark.parametrize("url, message", [
    ("http://127.0.0.1:0", "port 0 cannot be dialled (1-65535, or none for the scheme's default): "
                           "'http://127.0.0.1:0'"),
    ("http://127.0.0.1:8000/v1", "must not have a path (routerd adds /v1/... itself): give the server only, "
                                 "like http://10.0.0.7:8000, got 'http://127.0.0.1:8000/v1'"),
])
@pytest.mark.parametrize("how", ["flag", "config"])
def test_serve_refuses_an_endpoint_url_it_cannot_dial_naming_the_field(tmp_path, url, message, how):
    if how == "flag":
        args = ["serve", "--port", "0", "--endpoint", "ok=http://127.0.0.1:8000", "--endpoint", f"bad={url}"]
        source = "flag --endpoint"
    else:
        path = tmp_path / "routerd.yaml"
        path.write_text(f"endpoints:\n  - {{name: ok, url: 'http://127.0.0.1:8000'}}\n"
                        f"  - {{name: bad, url: '{url}'}}\n")
        args, source = ["serve", "--port", "0", "--config", str(path)], f"config {path}"
    err = _one_line_error(*run_routerd(f"serve-url-{how}", args, tmp_path))
    assert err == f"{source}: endpoints[1].url: {message}"


# -- 6. the request counter by status code ------------------------------------------------------

def test_requests_are_counted_once_by_status_code(start_stack):
    s = start_stack(n=2, sidecars=False, routerd_flags=("--model", MODEL))
    n_ok = 8
    with client(s) as c:
        for i in range(n_ok):
            complete(c, MODEL, i)
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=2, stream=True)
    status, _, raw = http_post(s.url + "/v1/no-such-path", json.dumps({"model": MODEL}).encode())
    assert status == 404, raw
    # Scrapes and probes in between are not counted.
    assert http_get(s.url + "/readyz")[0] == 200 and http_get(s.url + "/healthz")[0] == 200
    want = {"200": n_ok, "404": 3}
    got = wait_counts(lambda: metric_by(routerd_metrics(s), "phasewise_requests_total", "code"), want,
                      "phasewise_requests_total by code")
    assert got == want
    assert sum(served(s)) == n_ok  # the emulators finished exactly the 200s
