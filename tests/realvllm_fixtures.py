"""Fixtures for the real-engine tier: real vLLM 0.32 (CPU build) serving a tiny random-weight model.

The engines are ``python -m vllm.entrypoints.openai.api_server`` processes started from the vLLM
venv that ``tools/real_vllm/build.sh`` makes (cached outside the repository, like the Kubernetes
binaries) with the model ``tools/real_vllm/make_model.py`` makes (deterministic, no download);
:mod:`real_vllm.engine` starts and stops them. Engines start once per test run (session-scoped
fixtures) and are shared by every test that asks for them: a test must leave them as it found
them, save their prefix caches (each test uses prompts of its own, or resets the cache first).

Without the venv these tests are skipped, unless ``PHASEWISE_VLLM_REQUIRED`` is set (``.ci/run``
sets it after building the venv): then they fail. Every test that uses one of these fixtures is
marked ``realvllm`` (``pytest -m realvllm`` runs the tier alone, ``-m 'not realvllm'`` skips it),
and the run's summary says how many such tests ran and passed.

Fixtures:

* ``vllm_python``: the venv's interpreter (session).
* ``tiny_model``: :class:`real_vllm.engine.TinyModel` (session).
* ``vllm_pair``: two engines at vLLM's default block size (128 on the CPU build), adapters ``a1``
  and ``a2`` loaded, KV events on, ``--enable-prompt-tokens-details``, ``/reset_prefix_cache``
  served (session).
* ``vllm_bs32``: one engine started with ``--block-size 32`` (session; started on first use): a
  block size other than the CPU build's 128 (its attention backend takes multiples of 32 only, so
  GPU backends' usual 16 cannot run here; the emulator covers 16).
* ``vllm_engine_factory``: ``make(name, **VLLMEngine kwargs) -> VLLMEngine`` for a test module
  that must kill or restart its engine; engines it made are stopped at the end of the module.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from real_vllm.engine import (MODEL_NAME, EngineError, TinyModel, VLLMEngine, missing_reason, start_engines,
                              tiny_model as _tiny_model, venv_python)

REQUIRED_ENV = "PHASEWISE_VLLM_REQUIRED"
MARKER = "realvllm"
_FIXTURES = frozenset(("vllm_python", "tiny_model", "vllm_pair", "vllm_bs32", "vllm_engine_factory"))
_counts = {"ran": 0, "passed": 0, "failed": 0, "skipped": 0}
_timings: dict[str, float] = {}

__all__ = ["MODEL_NAME"]


def pytest_configure(config):
    config.addinivalue_line("markers", f"{MARKER}: needs a real vLLM engine (tools/real_vllm/build.sh)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(getattr(pytest.mark, MARKER))


def pytest_runtest_logreport(report):
    if MARKER not in report.keywords:
        return
    if report.when == "call":
        _counts["ran"] += 1
        _counts["passed" if report.passed else "failed"] += 1
    elif report.when == "setup" and report.skipped:
        _counts["skipped"] += 1
    elif report.when == "setup" and report.failed:
        _counts["ran"] += 1
        _counts["failed"] += 1


def pytest_terminal_summary(terminalreporter):
    c = _counts
    if not (c["ran"] or c["skipped"]):
        return
    starts = ", ".join(f"{k} {v:.0f} s" for k, v in _timings.items())
    terminalreporter.write_line(
        f"real-engine tier (vLLM): {c['ran']} ran, {c['passed']} passed, {c['failed']} failed, "
        f"{c['skipped']} skipped" + (f"; engine starts: {starts}" if starts else ""))


def _need_python() -> Path:
    py = venv_python()
    if py is None:
        reason = missing_reason()
        if os.environ.get(REQUIRED_ENV):
            pytest.fail(f"{REQUIRED_ENV} is set but {reason}", pytrace=False)
        pytest.skip(reason)
    return py


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM venv's interpreter (skips, or fails under ``PHASEWISE_VLLM_REQUIRED``, without it)."""
    return _need_python()


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path) -> TinyModel:
    """The tiny model and adapters (made once, cached)."""
    return _tiny_model(vllm_python)


@pytest.fixture(scope="session")
def vllm_logdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


def _start(name: str, engines: list[VLLMEngine]) -> None:
    t0 = time.monotonic()
    try:
        start_engines(engines)
    except EngineError as e:
        pytest.fail(str(e), pytrace=False)
    _timings[name] = time.monotonic() - t0


@pytest.fixture(scope="session")
def vllm_pair(vllm_python: Path, tiny_model: TinyModel, vllm_logdir: Path) -> Iterator[list[VLLMEngine]]:
    """Two real engines at vLLM's default block size, adapters loaded, KV events on."""
    engines = [VLLMEngine(f"vllm{i}", vllm_python, tiny_model, vllm_logdir) for i in range(2)]
    _start("pair", engines)
    yield engines
    for e in engines:
        e.stop()


@pytest.fixture(scope="session")
def vllm_bs32(vllm_python: Path, tiny_model: TinyModel, vllm_logdir: Path) -> Iterator[VLLMEngine]:
    """One real engine started with ``--block-size 32`` (the CPU attention backend's smallest)."""
    e = VLLMEngine("vllm-bs32", vllm_python, tiny_model, vllm_logdir, block_size=32)
    _start("bs32", [e])
    yield e
    e.stop()


@pytest.fixture(scope="module")
def vllm_engine_factory(vllm_python: Path, tiny_model: TinyModel,
                        vllm_logdir: Path) -> Iterator[Callable[..., VLLMEngine]]:
    """``make(name, **kwargs)``: a started, ready engine of the module's own (stopped after the module)."""
    made: list[VLLMEngine] = []

    def make(name: str, **kwargs) -> VLLMEngine:
        e = VLLMEngine(name, vllm_python, tiny_model, vllm_logdir, **kwargs)
        made.append(e)
        _start(name, [e])
        return e

    yield make
    for e in made:
        e.stop()
