"""Start, restart and stop real vLLM OpenAI servers on loopback, serving the tiny model.

Used by the real-engine test tier (``tests/realvllm``) and by benchmarks that measure a real
engine. Nothing here is imported by the ``phasewise`` package.

* :func:`venv_python`: the vLLM venv's interpreter (``tools/real_vllm/build.sh``), or None.
* :func:`tiny_model`: the tiny model and its two LoRA adapters, made once per seed with
  ``tools/real_vllm/make_model.py`` in the vLLM venv and cached beside it.
* :class:`VLLMEngine`: one ``python -m vllm.entrypoints.openai.api_server`` process group
  (API server, EngineCore, worker), with prefix caching, ``--enable-prompt-tokens-details``,
  KV events on a port of its own (``tcp://*:PORT``: the publisher binds), the adapters, and
  ``VLLM_SERVER_DEV_MODE=1`` (``POST /reset_prefix_cache``). Stopping signals the whole group:
  killing the API server alone can leave the EngineCore holding the KV-event port
  (``shared/docs/real-vllm.md``).
* :func:`start_engines`: several at once (start all, then wait for all: on 2 cores two engines
  are ready in about 60-90 s together against 40-60 s for one).

Environment: ``PHASEWISE_VLLM_VENV`` overrides the venv folder (else ``build.sh --print-venv``);
``PHASEWISE_VLLM_CACHE`` the model cache (default ``~/.cache/phasewise/vllm``).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

HERE = Path(__file__).resolve().parent
BUILD = HERE / "build.sh"
MAKE_MODEL = HERE / "make_model.py"

#: The served model name, and the LoRA adapters' names (``--lora-modules NAME=DIR``).
MODEL_NAME = "tiny"
ADAPTERS = ("a1", "a2")
#: KV cache bytes per engine: 64 MiB holds 131,072 tokens of the tiny model (1,024 blocks of 128).
KV_CACHE_BYTES = 64 * 1024 * 1024


class EngineError(RuntimeError):
    """An engine that exited or was not ready in time; the message ends with its log's tail."""


def cache_dir() -> Path:
    return Path(os.environ.get("PHASEWISE_VLLM_CACHE") or Path.home() / ".cache" / "phasewise" / "vllm")


def venv_dir() -> Path:
    """The vLLM venv's folder (made or not): ``PHASEWISE_VLLM_VENV`` or ``build.sh --print-venv``."""
    env = os.environ.get("PHASEWISE_VLLM_VENV")
    if env:
        return Path(env)
    out = subprocess.run(["bash", str(BUILD), "--print-venv"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def venv_python() -> Path | None:
    """The vLLM venv's ``python`` when ``build.sh`` finished making it (its stamp is there), else None."""
    d = venv_dir()
    py = d / "bin" / "python"
    return py if (d / ".phasewise-ok").is_file() and py.is_file() else None


def missing_reason() -> str:
    """Why :func:`venv_python` is None, in one line."""
    return f"the vLLM venv is not built in {venv_dir()}; run tools/real_vllm/build.sh (or set PHASEWISE_VLLM_VENV)"


@dataclass(frozen=True)
class TinyModel:
    """The model folder vLLM serves and its adapters' folders (by adapter name)."""

    model: Path
    adapters: dict[str, Path]


def tiny_model(python: Path, seed: int = 0) -> TinyModel:
    """The tiny model for ``seed``, made with ``python`` (the vLLM venv's) when not cached.

    Cached under :func:`cache_dir` keyed by the seed and ``make_model.py``'s hash; made into a
    temporary folder and renamed, so a half-made model is never used.

    Raises:
        EngineError: ``make_model.py`` failed (its output in the message).
    """
    digest = hashlib.sha256(MAKE_MODEL.read_bytes()).hexdigest()[:12]
    root = cache_dir() / f"model-{digest}-seed{seed}"
    if not (root / "model" / "config.json").is_file():
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = root.with_name(f"{root.name}.tmp{os.getpid()}")
        r = subprocess.run([str(python), str(MAKE_MODEL), str(tmp), "--seed", str(seed)], capture_output=True,
                           text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        if r.returncode != 0:
            raise EngineError(f"make_model.py failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
        try:
            tmp.rename(root)
        except OSError:  # another process made it meanwhile
            subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return TinyModel(root / "model", {a: root / f"lora-{a}" for a in ADAPTERS})


#: Ports handed out by :func:`free_port` in this process (never twice).
_handed: set[int] = set()
#: Where :func:`free_port` looks: below Linux's ephemeral range (32768-60999), where vLLM's own
#: ZMQ sockets take their random ports, so an engine never races another for the port picked here.
PORT_RANGE = (20000, 32000)


def free_port() -> int:
    """A TCP port free on every interface now, not handed out before by this process, picked at
    random in :data:`PORT_RANGE`.

    Raises:
        EngineError: no free port found in 200 tries.
    """
    import random

    for _ in range(200):
        port = random.randrange(*PORT_RANGE)
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _handed.add(port)
        return port
    raise EngineError(f"no free TCP port in {PORT_RANGE}")


class VLLMEngine:
    """One real vLLM OpenAI server on 127.0.0.1 (see the module docstring).

    Args:
        name: for log file names and messages.
        python: the vLLM venv's interpreter.
        model: the tiny model (:func:`tiny_model`).
        logdir: folder for ``<name>.log`` (appended to across restarts).
        port, kv_port: HTTP and KV-event ports (None: free ones picked now, kept across restarts).
        block_size: ``--block-size`` (None: vLLM's default, 128 on the CPU build).
        lora: serve the adapters (``--enable-lora``).
        kv_events: publish KV events.
        max_model_len: ``--max-model-len``.
        kv_cache_bytes: ``--kv-cache-memory-bytes``.
        extra_args: more server arguments.
        env: more environment variables.
    """

    def __init__(self, name: str, python: Path, model: TinyModel, logdir: Path, *, port: int | None = None,
                 kv_port: int | None = None, block_size: int | None = None, lora: bool = True,
                 kv_events: bool = True, max_model_len: int = 2048, kv_cache_bytes: int = KV_CACHE_BYTES,
                 extra_args: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        self.name = name
        self.python = python
        self.model = model
        self.logdir = Path(logdir)
        self.port = port or free_port()
        self.kv_port = kv_port or free_port()
        self.block_size = block_size
        self.lora = lora
        self.kv_events = kv_events
        self.max_model_len = max_model_len
        self.kv_cache_bytes = kv_cache_bytes
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    # --- addresses --------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (no ``/v1``)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_address(self) -> str:
        """Where a subscriber connects: ``tcp://127.0.0.1:KV_PORT``."""
        return f"tcp://127.0.0.1:{self.kv_port}"

    @property
    def log_path(self) -> Path:
        return self.logdir / f"{self.name}.log"

    def argv(self) -> list[str]:
        """The server's command line."""
        a = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model.model),
             "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(self.port),
             "--max-model-len", str(self.max_model_len), "--enable-prefix-caching",
             "--enable-prompt-tokens-details", "--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        if self.block_size is not None:
            a += ["--block-size", str(self.block_size)]
        if self.kv_events:
            a += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                    "endpoint": f"tcp://*:{self.kv_port}"})]
        if self.lora:
            a += ["--enable-lora", "--max-lora-rank", "8", "--max-loras", str(len(self.model.adapters)),
                  "--lora-modules", *(f"{n}={p}" for n, p in self.model.adapters.items())]
        return a + self.extra_args

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the server (returns at once; :meth:`wait_ready` waits). Idempotent while running."""
        if self.proc is not None and self.proc.poll() is None:
            return
        self.logdir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PHASEWISE_", "PYTHON"))}
        env.update({"VLLM_SERVER_DEV_MODE": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                    "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
        argv = self.argv()
        env.update(self.extra_env)
        log = open(self.log_path, "ab")
        log.write(f"\n=== start {self.starts + 1}: {' '.join(argv)}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True, cwd=str(self.logdir))
        log.close()
        self.starts += 1

    def ready(self) -> bool:
        """Whether ``GET /health`` answers 200 now."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Wait until ``/health`` answers 200.

        Raises:
            EngineError: the process exited, or ``timeout_s`` passed (the log's tail included).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise EngineError(f"vLLM engine {self.name} exited (code {code}) before it was ready\n{self.log_tail()}")
            if self.ready():
                return
            time.sleep(0.5)
        raise EngineError(f"vLLM engine {self.name} not ready after {timeout_s:.0f} s\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> None:
        """Signal the whole process group, wait, then SIGKILL what is left. Idempotent."""
        p = self.proc
        if p is None:
            return
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        # The EngineCore and worker share the group; make sure none outlives the server.
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None
        self._wait_port_free(self.kv_port)
        self._wait_port_free(self.port)

    def kill(self) -> None:
        """SIGKILL the whole group at once (a crash)."""
        self.stop(signal.SIGKILL, timeout_s=10)

    def restart(self, timeout_s: float = 300.0) -> None:
        """Stop, start again on the same ports, wait until ready."""
        self.stop()
        self.start()
        self.wait_ready(timeout_s)

    @staticmethod
    def _wait_port_free(port: int, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("0.0.0.0", port))
                    return
                except OSError:
                    time.sleep(0.2)

    # --- helpers ----------------------------------------------------------------------------------

    def port_taken(self) -> bool:
        """Whether the latest start failed because a port was taken (its log says so)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return False
        return "Address already in use" in text[text.rfind("\n=== start "):]

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def post(self, path: str, body: dict | None = None, timeout_s: float = 60.0) -> tuple[int, dict | str]:
        """POST JSON; ``(status, parsed body or text)``, errors included."""
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                status, text = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache`` (the ``AllBlocksCleared`` event comes at the engine's next step).

        Raises:
            EngineError: not answered 200.
        """
        status, body = self.post("/reset_prefix_cache")
        if status != 200:
            raise EngineError(f"vLLM engine {self.name}: reset_prefix_cache answered {status}: {body}")

    def __repr__(self) -> str:
        return f"VLLMEngine({self.name!r}, {self.url}, kv {self.kv_events_address}, block_size {self.block_size})"


def start_engines(engines: Sequence[VLLMEngine], timeout_s: float = 420.0, attempts: int = 3) -> None:
    """Start every engine, then wait for each; on failure stop them all and raise. An engine that
    failed because a port it was given got taken meanwhile is started again on new ports (up to
    ``attempts`` times in all).

    Raises:
        EngineError: one exited or was not ready in time.
    """
    for attempt in range(attempts):
        try:
            for e in engines:
                e.start()
            deadline = time.monotonic() + timeout_s
            for e in engines:
                e.wait_ready(max(1.0, deadline - time.monotonic()))
            return
        except EngineError as err:
            for e in engines:
                e.stop()
            if attempt == attempts - 1 or not any(e.port_taken() for e in engines):
                raise
            for e in engines:
                e.port, e.kv_port = free_port(), free_port()
        except BaseException:
            for e in engines:
                e.stop()
            raise


def one_benchmark_engine(name: str) -> "VLLMEngine | str":
    """Start one engine on the tiny model for a benchmark script (no LoRA, no KV events), logging
    under the temp folder's ``pw-<name>``; prints where it started. Returns the engine, or the
    reason it cannot start (no vLLM venv) for the caller to print.

    Raises:
        EngineError: it exited or was not ready in time.
    """
    py = venv_python()
    if py is None:
        return missing_reason()
    engine = VLLMEngine(name, py, tiny_model(py), Path(tempfile.gettempdir()) / f"pw-{name}",
                        lora=False, kv_events=False)
    t0 = time.perf_counter()
    start_engines([engine])
    print(f"started {engine} in {time.perf_counter() - t0:.0f} s (log {engine.log_path})")
    return engine


if __name__ == "__main__":  # a quick manual check: python tools/real_vllm/engine.py
    py = venv_python()
    if py is None:
        sys.exit(missing_reason())
    m = tiny_model(py)
    e = VLLMEngine("manual", py, m, Path("/tmp/real-vllm-manual"))
    t0 = time.monotonic()
    start_engines([e])
    print(f"{e} ready in {time.monotonic() - t0:.1f} s; log {e.log_path}")
    try:
        print(e.post("/v1/completions", {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}))
    finally:
        e.stop()
