"""Run an emulator as a child process (tests, benchmarks, local quick starts).

:class:`EmulatorProcess` starts ``python -m routerd.emulator`` with the given flags,
waits for the line it prints once it listens, and stops it on exit::

    with EmulatorProcess("--port", "0", "--profile", "llama2-7b-a100") as emu:
        client = openai.OpenAI(base_url=emu.url + "/v1", api_key="none")
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_URL = re.compile(r" on (http://\S+) \(")
_KV = re.compile(r"; KV events (\S+) topic")


class EmulatorStartError(RuntimeError):
    """The emulator exited or stayed silent before listening; the message holds its stderr."""


class EmulatorProcess:
    """A ``phasewise emulate`` child process.

    Args:
        *flags: ``phasewise emulate`` flags (``--host 127.0.0.1`` is added unless given).
        env: extra environment variables (e.g. ``PHASEWISE_EMULATOR_MODEL``).
        startup_timeout_s: seconds to wait for the listening line.

    Raises:
        EmulatorStartError: from :meth:`start` (and ``__enter__``).
    """

    def __init__(self, *flags: str, env: dict[str, str] | None = None, startup_timeout_s: float = 30.0) -> None:
        self.flags = list(flags)
        if "--host" not in self.flags:
            self.flags = ["--host", "127.0.0.1", *self.flags]
        self.env = dict(env or {})
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        """Base URL, e.g. ``http://127.0.0.1:41234`` (the OpenAI base URL is ``url + "/v1"``)."""
        self.kv_events_endpoint = ""
        """Where its KV-event PUB socket is bound, e.g. ``tcp://127.0.0.1:41235`` ("" without events)."""
        self._stderr = tempfile.TemporaryFile()

    @property
    def pid(self) -> int:
        """Process id of the emulator."""
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> "EmulatorProcess":
        """Start the process and wait until it listens."""
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])  # the folder holding the routerd package
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update(self.env)
        self.proc = subprocess.Popen([sys.executable, "-m", "routerd.emulator", *self.flags], env=env,
                                     stdout=subprocess.PIPE, stderr=self._stderr)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + self.startup_timeout_s
        buf = b""
        fd = self.proc.stdout.fileno()
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                text = self.stderr_text()
                self.stop()
                raise EmulatorStartError(f"emulator did not start within {self.startup_timeout_s} s: {text}")
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    code = self.proc.wait()
                    text = self.stderr_text()
                    self.stop()
                    raise EmulatorStartError(f"emulator exited with {code}: {text}")
                buf += chunk
        m = _URL.search(buf.decode(errors="replace"))
        if m is None:
            text = self.stderr_text()
            self.stop()
            raise EmulatorStartError(f"unexpected first line from the emulator: {buf!r} {text}")
        self.url = m.group(1)
        kv = _KV.search(buf.decode(errors="replace"))
        self.kv_events_endpoint = kv.group(1) if kv else ""
        return self

    def stderr_text(self) -> str:
        """Everything the process wrote to stderr so far ("" once stopped)."""
        if self._stderr.closed:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace").strip()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int | None:
        """Send ``sig`` (SIGTERM: graceful) and wait; kills after ``timeout_s``. Returns the exit code."""
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if p.stdout is not None:
            p.stdout.close()
        self._stderr.close()
        return p.returncode

    def __enter__(self) -> "EmulatorProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
