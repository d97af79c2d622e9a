"""Real ``phasewise`` processes on loopback for end-to-end tests: emulators, sidecars, routerd.

:class:`Stack` starts N emulators (``python -m routerd emulate``), one sidecar beside each
(``python -m routerd sidecar``) and routerd (``python -m routerd serve``), all started at
once: the emulators' and sidecars' ports are picked beforehand, routerd's (port 0) are
read back from its log. Each process
carries the environment variable ``PHASEWISE_E2E_STACK=<id>`` so that
:func:`marked_processes` finds every process the stack started (and any child they
started) after teardown: a leak check that needs no process tree.

Options cover the production cases of issue 15: a different ``emulate`` flag set per
emulator (``--model``), no sidecars, extra ``--endpoint`` specs (a :class:`HungServer`), and
the endpoints in a YAML config file (``config``, for reloads) instead of flags; and those of
issue 14: vLLM KV events from every emulator on a port of its own (``kv_events``), and one
emulator killed and started again on the same ports (:meth:`Stack.kill_emulator`,
:meth:`Stack.restart_emulator`).
:func:`run_routerd` runs one ``python -m routerd`` command that is expected to exit (bad
settings).

Also: :func:`scrape` (Prometheus text read with ``prometheus_client.parser``),
:func:`metric_sum`, and :func:`wait_until` / :func:`await_until`: the one way tests here
wait for state that another thread or process writes (operator status, EndpointSlices,
routerd gauges, emulator counters): poll it until it is what the test asserts, with a
bounded timeout and a message naming what was awaited, instead of reading it once or
sleeping a guessed time.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import signal
import socket
import selectors
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
MARKER = "PHASEWISE_E2E_STACK"

_EMULATOR_LINE = re.compile(r"serving '[^']*' on (http://[\d.]+:\d+) \(")
_SIDECAR_LINE = re.compile(r"on port (\d+), scraping")
_ROUTERD_LINE = re.compile(r"routerd listening on http://([\d.]+):(\d+), gRPC ([\d.]+):(\d+)")


class StackError(RuntimeError):
    """A process exited or stayed silent before it was ready; the message holds its log."""


def _base_env(stack_id: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHASEWISE_")}
    src = str(REPO / "routerd")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env[MARKER] = stack_id
    return env


class StackProcess:
    """One ``python -m routerd ARGS`` child, stdout and stderr into ``logdir/NAME.log``."""

    def __init__(self, name: str, args: list[str], logdir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.args = args
        self.log_path = logdir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "routerd", *args], stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_for(self, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str]:
        """The first match of ``pattern`` in the log, polling until ``timeout_s``.

        Raises:
            StackError: the process exited first, or the time ran out.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            m = pattern.search(self.log_text())
            if m is not None:
                return m
            if not self.alive():
                raise StackError(f"{self.name} exited with {self.proc.returncode} before it was ready:\n"
                                 f"{self.log_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise StackError(f"{self.name} not ready within {timeout_s} s:\n{self.log_text()[-4000:]}")
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        """Wait for the exit; SIGKILL after ``timeout_s``. Returns the exit code."""
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode


class Stack:
    """``n`` emulators + their sidecars + routerd, all on 127.0.0.1.

    Args:
        emulator_flags: ``emulate`` flags of every emulator.
        per_emulator_flags: further ``emulate`` flags of emulator i (``("--model", "a")``);
            empty, or one entry per emulator.
        sidecars: start a sidecar beside each emulator (its ``state_address`` given to routerd).
        extra_endpoints: further ``--endpoint NAME=URL[,STATE]`` specs of routerd (servers the
            test runs itself, e.g. a :class:`HungServer`); they follow the emulators.
        config: when given, routerd reads its endpoints from a YAML file ``logdir/routerd.yaml``
            (``config_path``) holding these settings and ``endpoints`` (the emulators', then
            ``extra_endpoints``), instead of ``--endpoint`` flags, so that a test can rewrite it
            and reload.
        kv_events: every emulator publishes vLLM KV events (``--kv-events-config``, ZMQ PUB
            bound on ``tcp://*:PORT``, a port of its own, topic ``""``) and its endpoint entry
            names the publisher (``kv_events: tcp://127.0.0.1:PORT``). Needs ``config`` (the
            ``--endpoint`` flag has no field for it).

    Attributes (after :meth:`start`): ``emulators``, ``emulator_urls``, ``sidecars``,
    ``sidecar_addresses``, ``kv_event_ports`` (empty without ``kv_events``), ``routerd``,
    ``url`` (routerd's base URL), ``grpc_address``, ``config_path`` (or None), ``retired``
    (emulator processes replaced by :meth:`restart_emulator`, kept for their logs).
    """

    def __init__(self, logdir: Path, *, n: int = 3, emulator_flags: tuple[str, ...] = (),
                 per_emulator_flags: Sequence[Sequence[str]] = (), sidecars: bool = True,
                 extra_endpoints: Sequence[str] = (), config: dict[str, Any] | None = None,
                 routerd_flags: tuple[str, ...] = (), routerd_env: dict[str, str] | None = None,
                 startup_timeout_s: float = 90.0, kv_events: bool = False) -> None:
        if per_emulator_flags and len(per_emulator_flags) != n:
            raise ValueError(f"per_emulator_flags: {len(per_emulator_flags)} entries for {n} emulators")
        if kv_events and config is None:
            raise ValueError("kv_events needs config: the --endpoint flag cannot name a KV-event publisher")
        self.logdir = logdir
        self.n = n
        self.emulator_flags = list(emulator_flags)
        self.per_emulator_flags = [list(f) for f in per_emulator_flags] or [[] for _ in range(n)]
        self.with_sidecars = sidecars
        self.extra_endpoints = list(extra_endpoints)
        self.config = None if config is None else dict(config)
        self.config_path: Path | None = None
        self.routerd_flags = list(routerd_flags)
        self.routerd_env = dict(routerd_env or {})
        self.startup_timeout_s = startup_timeout_s
        self.kv_events = kv_events
        self.kv_event_ports: list[int] = []
        self.retired: list[StackProcess] = []
        self.id = uuid.uuid4().hex
        self.env = _base_env(self.id)
        self.names = [f"emu{i}" for i in range(n)]
        self.emulators: list[StackProcess] = []
        self.emulator_urls: list[str] = []
        self.sidecars: list[StackProcess] = []
        self.sidecar_addresses: list[str] = []
        self.routerd: StackProcess | None = None
        self.url = ""
        self.grpc_address = ""

    def all_processes(self) -> list[StackProcess]:
        return [*([self.routerd] if self.routerd else []), *self.sidecars, *self.emulators, *self.retired]

    def start(self, attempts: int = 3) -> "Stack":
        """Start all processes at once and wait until each listens.

        The emulators' and sidecars' ports are picked here (so that nothing waits for
        another tier to print its port); in the rare case another program takes one of
        them first, the stack is stopped and started again on new ports.
        """
        for attempt in range(attempts):
            try:
                return self._start_once()
            except StackError as e:
                taken = ("cannot listen" in str(e) or "cannot bind" in str(e)
                         or "Address already in use" in str(e))  # the last: an emulator's KV-event port
                if attempt == attempts - 1 or not taken:
                    raise
                self.close()
                self.emulators, self.sidecars, self.routerd, self.retired = [], [], None, []
        raise AssertionError("unreachable")

    def endpoint_entries(self) -> list[dict[str, str]]:
        """routerd's ``endpoints`` entries of the emulators (with their sidecars), then ``extra_endpoints``."""
        from routerd.daemon.cli import parse_endpoint_flag

        out = []
        for i, (name, url) in enumerate(zip(self.names, self.emulator_urls)):
            entry = {"name": name, "url": url}
            if self.with_sidecars:
                entry["state_address"] = self.sidecar_addresses[i]
            if self.kv_events:
                entry["kv_events"] = f"tcp://127.0.0.1:{self.kv_event_ports[i]}"
            out.append(entry)
        return out + [parse_endpoint_flag(spec) for spec in self.extra_endpoints]

    def write_config(self, settings: dict[str, Any]) -> Path:
        """Write ``settings`` as YAML to ``config_path`` (``logdir/routerd.yaml``) and return it."""
        path = self.logdir / "routerd.yaml"
        path.write_text(yaml.safe_dump(settings, sort_keys=False))
        self.config_path = path
        return path

    def _start_once(self) -> "Stack":
        t = self.startup_timeout_s
        n = self.n
        ports = free_ports((3 if self.kv_events else 2) * n)
        self.emulator_urls = [f"http://127.0.0.1:{p}" for p in ports[:n]]
        self.sidecar_addresses = [f"127.0.0.1:{p}" for p in ports[n:2 * n]] if self.with_sidecars else []
        self.kv_event_ports = ports[2 * n:]
        for i, name in enumerate(self.names):
            self.emulators.append(StackProcess(name, self._emulator_args(i), self.logdir, self.env))
        for name, url, addr in zip(self.names, self.emulator_urls, self.sidecar_addresses):
            self.sidecars.append(StackProcess(f"sidecar-{name}", [
                "sidecar", "--metrics-url", url + "/metrics", "--listen", addr, "--instance", name,
                "--endpoint", url, "--log-level", "info"], self.logdir, self.env))
        flags = ["serve", "--host", "127.0.0.1", "--port", "0", "--grpc-port", "0", "--log-level", "info"]
        if self.config is not None:
            flags += ["--config", str(self.write_config({**self.config, "endpoints": self.endpoint_entries()}))]
        else:
            for e in self.endpoint_entries():
                flags += ["--endpoint", f"{e['name']}={e['url']}" + (f",{e['state_address']}"
                                                                       if "state_address" in e else "")]
        env = dict(self.env)
        env["PHASEWISE_GRPC__HOST"] = "127.0.0.1"
        env.update(self.routerd_env)
        self.routerd = StackProcess("routerd", flags + self.routerd_flags, self.logdir, env)
        for p, url in zip(self.emulators, self.emulator_urls):
            got = p.wait_for(_EMULATOR_LINE, t).group(1)
            if got != url:
                raise StackError(f"{p.name} serves on {got}, not {url}")
        for p, addr in zip(self.sidecars, self.sidecar_addresses):
            if f"127.0.0.1:{p.wait_for(_SIDECAR_LINE, t).group(1)}" != addr:
                raise StackError(f"{p.name} did not bind {addr}:\n{p.log_text()}")
        m = self.routerd.wait_for(_ROUTERD_LINE, t)
        self.url = f"http://{m.group(1)}:{m.group(2)}"
        self.grpc_address = f"{m.group(3)}:{m.group(4)}"
        return self

    def _emulator_args(self, i: int) -> list[str]:
        args = ["emulate", "--host", "127.0.0.1", "--port", self.emulator_urls[i].rsplit(":", 1)[1],
                "--seed", str(i), *self.emulator_flags, *self.per_emulator_flags[i]]
        if self.kv_events:
            # vLLM binds its PUB socket only when the endpoint has a wildcard (else it connects).
            args += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                       "endpoint": f"tcp://*:{self.kv_event_ports[i]}",
                                                       "topic": ""})]
        return args

    def kill_emulator(self, i: int, timeout_s: float = 10.0) -> None:
        """SIGKILL emulator ``i`` (no goodbye on any socket, as a crashed engine) and reap it."""
        p = self.emulators[i]
        p.signal(signal.SIGKILL)
        p.wait(timeout_s)

    def restart_emulator(self, i: int) -> StackProcess:
        """Start emulator ``i`` again, with the same flags and ports (HTTP and KV events), after
        :meth:`kill_emulator`; returns once it serves. Its log is ``logdir/emuI-rK.log``; the
        dead process moves to ``retired``.

        Raises:
            StackError: it is still running, or the new one did not come up (its log).
        """
        old = self.emulators[i]
        if old.alive():
            raise StackError(f"{old.name} is still running (kill_emulator first)")
        self.retired.append(old)
        k = sum(1 for p in self.retired if p.name.split("-r")[0] == self.names[i])
        new = StackProcess(f"{self.names[i]}-r{k}", self._emulator_args(i), self.logdir, self.env)
        self.emulators[i] = new
        got = new.wait_for(_EMULATOR_LINE, self.startup_timeout_s).group(1)
        if got != self.emulator_urls[i]:
            raise StackError(f"{new.name} serves on {got}, not {self.emulator_urls[i]}")
        return new

    def close(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every process at once (routerd drains what is left); SIGKILL stragglers after ``timeout_s``."""
        procs = self.all_processes()
        for p in procs:
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.wait(max(0.1, deadline - time.monotonic()))

    def start_for(self, request: Any) -> "Stack":
        """:meth:`start`, with a pytest finalizer on ``request`` that closes the stack and fails
        when one of its processes outlived it; returns the stack."""

        def finalize() -> None:
            left = self.close_checked()
            assert not left, f"processes of the stack left running after teardown: {left}"
            assert all(not p.alive() for p in self.all_processes())

        request.addfinalizer(finalize)
        self.start()
        return self

    def close_checked(self, timeout_s: float = 15.0) -> list[tuple[int, str]]:
        """:meth:`close`, then SIGKILL every process still carrying this stack's marker (a child
        that outlived its parent); returns those (pid, command line): empty when none leaked."""
        self.close(timeout_s)
        left = marked_processes(self.id)
        for pid, _ in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left

    def logs(self, tail: int = 3000) -> str:
        """The end of every process's log, for failure messages."""
        return "\n".join(f"--- {p.name} (pid {p.pid}, rc {p.proc.returncode}) ---\n{p.log_text()[-tail:]}"
                         for p in self.all_processes())


def run_routerd(name: str, args: list[str], logdir: Path, timeout_s: float = 60.0,
                env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``python -m routerd ARGS`` (a command expected to exit, e.g. ``serve`` with bad
    settings) to its end: (exit code, its stdout and stderr). After ``timeout_s`` it is killed
    and the test fails with its log.

    ``env``: further environment variables (the test's own ``PHASEWISE_*`` are not passed on).
    """
    p = StackProcess(name, args, logdir, {**_base_env(uuid.uuid4().hex), **(env or {})})
    try:
        p.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        p.wait(0)
        raise AssertionError(f"{name}: still running after {timeout_s} s:\n{p.log_text()[-4000:]}") from None
    p.wait(0)
    return p.proc.returncode, p.log_text()


class HungServer:
    """A hung instance: a TCP server on 127.0.0.1 (a thread of the test process) that accepts
    every connection, reads whatever it is sent and never answers. Each request that reaches it
    is recorded by its request line (one per connection: nothing is answered, so nothing is
    pipelined behind it).

    Attributes: ``port``, ``url``. Use as a context manager, or call :meth:`close`.
    """

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._received: dict[socket.socket, bytes] = {}
        self._closed: list[bytes] = []
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._serve, name=f"hung-server-{self.port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    try:
                        conn, _ = self._listener.accept()
                    except BlockingIOError:
                        continue
                    conn.setblocking(False)
                    with self._lock:
                        self._received[conn] = b""
                    self._selector.register(conn, selectors.EVENT_READ)
                    continue
                try:
                    data = sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                with self._lock:
                    if data:
                        self._received[sock] += data
                        continue
                    self._closed.append(self._received.pop(sock))  # the peer gave up (its timeout)
                self._selector.unregister(sock)
                sock.close()

    def request_lines(self) -> list[str]:
        """The request line (``POST /v1/completions HTTP/1.1``) of every request received so far."""
        with self._lock:
            raw = [*self._closed, *self._received.values()]
        return [b.split(b"\r\n", 1)[0].decode(errors="replace") for b in raw if b"\r\n" in b]

    def close(self) -> None:
        """Stop the thread and close every socket."""
        self._stop.set()
        self._thread.join(10)
        with self._lock:
            conns = list(self._received)
            self._received.clear()
        for conn in conns:
            conn.close()
        self._selector.close()
        self._listener.close()

    def __enter__(self) -> "HungServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def free_ports(k: int) -> list[int]:
    """``k`` distinct TCP ports free on 127.0.0.1 now (bound together, then released)."""
    socks = [socket.socket() for _ in range(k)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def marked_processes(stack_id: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose environment carries the stack's marker."""
    needle = f"{MARKER}={stack_id}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                environ = f.read()
            if needle not in environ.split(b"\0"):
                continue
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue  # a zombie: exited, only not reaped (not our child, else wait() reaped it)
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        found.append((int(entry.name), cmd))
    return found


def http_get(url: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
    """(status, body) of a GET; 0 when the connection failed."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()
    except OSError:
        return 0, b""


def http_post(url: str, body: bytes, headers: dict[str, str] | None = None,
              timeout_s: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of a POST with ``body`` as is."""
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, dict(e.headers), e.read()


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of the Prometheus page at ``url``: (sample name, labels, value)."""
    status, body = http_get(url)
    if status != 200:
        raise AssertionError(f"GET {url} answered {status}")
    return [(s.name, dict(s.labels), s.value)
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples]


def metric_sum(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


def metric_by(samples: list[tuple[str, dict[str, str], float]], name: str, label: str) -> dict[str, float]:
    """``{label value: value}`` of the samples called ``name``."""
    return {lab.get(label, ""): v for n, lab, v in samples if n == name}


def wait_until(probe: Callable[[], Any], ok: Callable[[Any], bool], timeout_s: float, what: str,
               interval_s: float = 0.05) -> Any:
    """Call ``probe()`` until ``ok(value)``; returns that value.

    ``probe`` runs at least once, then every ``interval_s`` seconds until ``timeout_s``
    seconds (monotonic clock) have passed.

    Raises:
        AssertionError: not reached in time; the message names ``what`` and the last value.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout_s} s; last value: {value!r}")
        time.sleep(interval_s)


async def await_until(probe: Callable[[], Any], ok: Callable[[Any], bool], timeout_s: float, what: str,
                      interval_s: float = 0.05) -> Any:
    """:func:`wait_until` inside an event loop: the (blocking) ``probe`` runs in a worker thread,
    so the loop keeps serving the clients or in-process servers of the test meanwhile."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await asyncio.to_thread(probe)
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout_s} s; last value: {value!r}")
        await asyncio.sleep(interval_s)


async def poll_until(probe: Callable[[], Any], ok: Callable[[Any], bool], timeout_s: float, what: str,
                     interval_s: float = 0.02) -> Any:
    """:func:`await_until` for a probe that runs on the event loop: a plain function (reading
    in-process state) or one returning an awaitable (an RPC); returns the first value ``ok`` accepts.

    Raises:
        AssertionError: not reached in time; the message names ``what`` and the last value.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout_s} s; last value: {value!r}")
        await asyncio.sleep(interval_s)


def client(s: "Stack", timeout_s: float = 60.0):
    """The official ``openai`` client on ``s``'s routerd (no retries; ``timeout_s`` per request)."""
    import openai

    return openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=timeout_s)


def aclient(s: "Stack", timeout_s: float = 60.0):
    """The official ``openai`` async client on ``s``'s routerd (no retries; ``timeout_s`` per request)."""
    import openai

    return openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=timeout_s)


def routerd_metrics(s: "Stack") -> list[tuple[str, dict[str, str], float]]:
    """``s``'s routerd ``/metrics``, parsed (:func:`scrape`)."""
    return scrape(s.url + "/metrics")
