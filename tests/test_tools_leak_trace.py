"""``tools/leak_trace.py`` names the test and the line that created a leaked socket, and
``tools/flake_check.py --trace-leaks`` collects those reports (issue 19)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LEAKY = '''import gc, socket


def make():
    return socket.socket()  # line 5: the creation the trace must name


def test_leaks():
    s = make()
    del s
    gc.collect()  # collected (and warned about) inside this test


def test_clean():
    with socket.socket():
        pass
'''


def _write(tmp_path: Path) -> Path:
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    (tmp_path / "pytest.ini").write_text("[pytest]\nfilterwarnings = error\n")  # as this project's config
    return tmp_path / "test_leaky.py"


def test_the_plugin_names_the_creating_test_and_line_and_keeps_the_failure(tmp_path):
    _write(tmp_path)
    out = tmp_path / "leaks.log"
    env = {**os.environ, "LEAK_TRACE_OUT": str(out),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tools"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "leak_trace",
                           "test_leaky.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    # The warning still fails the leaking test (nothing silenced); the clean one passes.
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 failed, 1 passed" in proc.stdout
    text = out.read_text()
    assert text.count("leak-trace: unclosed <socket.socket") == 1, text
    first = text.splitlines()[0]
    assert "collected during test_leaky.py::test_leaks; created during test_leaky.py::test_leaks" in first
    frames = text.splitlines()[1:]
    assert frames[0].strip() == f"{tmp_path / 'test_leaky.py'}:5"  # make()
    assert frames[1].strip() == f"{tmp_path / 'test_leaky.py'}:9"  # its caller in the test
    assert not any("_pytest" in f or "pluggy" in f for f in frames)


def test_flake_check_reports_the_traced_leaks(tmp_path):
    path = _write(tmp_path)
    logs = tmp_path / "logs"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "flake_check.py"), "-n", "1", "--trace-leaks",
                           "--log-dir", str(logs), "--pytest-args", f"-p no:cacheprovider --rootdir {tmp_path}",
                           str(path)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the leaking test failed its run
    assert "1 unclosed socket(s) traced to their creation" in proc.stdout, proc.stdout
    assert (logs / "run001.leaks").read_text().startswith("leak-trace: unclosed <socket.socket")


CYCLE = '''import socket


class Holder:
    def __init__(self):
        self.me = self  # a reference cycle: only the garbage collector frees it
        self.sock = socket.socket()


def test_cycle():
    Holder()  # garbage at once, but not freed until a collection
'''


def test_leak_trace_gc_reports_a_cycle_in_the_test_that_made_it(tmp_path):
    (tmp_path / "test_cycle.py").write_text(CYCLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nfilterwarnings = error\n")
    out = tmp_path / "leaks.log"
    env = {**os.environ, "LEAK_TRACE_OUT": str(out), "LEAK_TRACE_GC": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tools"), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "leak_trace",
                    "test_cycle.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    text = out.read_text()
    assert text.count("leak-trace: unclosed <socket.socket") == 1, text
    # Without LEAK_TRACE_GC the cycle outlives the test and no report names it (checked by
    # the run below); with it, the collection at the test's end names the test itself.
    assert "collected during test_cycle.py::test_cycle; created during test_cycle.py::test_cycle" in text
    out.unlink()
    env.pop("LEAK_TRACE_GC")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "leak_trace",
                    "test_cycle.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "collected during test_cycle.py::test_cycle" not in (out.read_text() if out.exists() else ""), out
