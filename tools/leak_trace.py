"""A pytest plugin that names where a leaked socket was created (issue 19).

``ResourceWarning: unclosed <socket.socket ...>`` is raised when a socket nobody closed is
garbage-collected, often tests later than the one that leaked it, and says nothing about
its origin. ``PYTHONTRACEMALLOC=N`` would name it but slows the k8s suite past its
timeouts. This plugin does the one thing needed, cheaply:

* every ``socket.socket`` (so also ``ssl.SSLSocket``, which calls its ``__init__``) records
  the test running at its creation and the innermost 25 frames of its creation stack
  (file and line pairs, pytest's and pluggy's own frames left out; microseconds, no
  source lines read);
* a ``sys.unraisablehook`` wrapper, put on top of pytest's own around each test, writes for
  each unclosed-socket ``ResourceWarning`` the creation test and stack to stderr (captured
  into the failing test's report) and, when ``$LEAK_TRACE_OUT`` names a file, to it; then it
  passes the event on to pytest unchanged: the warning is reported (and fails the test under
  ``filterwarnings = error``) exactly as without the plugin.

Asyncio transports (``unclosed transport <_SelectorSocketTransport fd=N>``) wrap a socket
made by ``socket.socket`` too; their socket's own warning carries the stack.

This project's test suite loads it always (``tests/conftest.py``), so that a chance leak in CI
names its source; elsewhere: ``PYTHONPATH=tools python -m pytest -p leak_trace ...``.
``python tools/flake_check.py --trace-leaks`` also collects the reports per run.

``LEAK_TRACE_GC=1`` also runs the garbage collector at the end of every test, inside that
test's hook, so that a leak in a reference cycle is reported in the test that made it rather
than wherever the collector happens to run later (it costs a few ms per test).
"""

from __future__ import annotations

import gc
import os
import socket
import sys

import pytest

_DEPTH = 25
_created: dict[int, tuple[str, list[tuple[str, int]]]] = {}
"""id(socket) -> (test running at creation, innermost frames as (file, line)). An id is reused
only once its socket is gone, so the entry for a live socket is always its own."""
_current = ["(no test: collection or session set-up)"]
_orig_init = socket.socket.__init__
_SKIP, _SKIP_PYTEST = f"{os.sep}pluggy{os.sep}", f"{os.sep}_pytest{os.sep}"


def _traced_init(self, *args, **kwargs):
    _orig_init(self, *args, **kwargs)
    frames = []
    f = sys._getframe(1)
    while f is not None and len(frames) < _DEPTH:
        name = f.f_code.co_filename
        if _SKIP not in name and _SKIP_PYTEST not in name:  # pytest's own frames name nothing
            frames.append((name, f.f_lineno))
        f = f.f_back
    _created[id(self)] = (_current[0], frames)


def _report(unraisable) -> None:
    obj, exc = unraisable.object, unraisable.exc_value
    if not isinstance(exc, ResourceWarning) or not isinstance(obj, socket.socket):
        return
    test, frames = _created.get(id(obj), ("(created before the plugin loaded)", []))
    lines = [f"leak-trace: {exc} collected during {_current[0]}; created during {test} at:"]
    lines += [f"    {file}:{line}" for file, line in frames]
    text = "\n".join(lines) + "\n"
    sys.stderr.write(text)
    path = os.environ.get("LEAK_TRACE_OUT")
    if path:
        with open(path, "a") as out:
            out.write(text)


def pytest_configure(config) -> None:
    socket.socket.__init__ = _traced_init


def pytest_unconfigure(config) -> None:
    socket.socket.__init__ = _orig_init


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid
    inner = sys.unraisablehook

    def hook(unraisable):
        try:
            _report(unraisable)
        finally:
            inner(unraisable)

    sys.unraisablehook = hook
    try:
        yield
        if os.environ.get("LEAK_TRACE_GC") == "1":
            gc.collect()
    finally:
        if sys.unraisablehook is hook:
            sys.unraisablehook = inner
