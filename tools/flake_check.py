#!/usr/bin/env python3
"""Repeat chosen tests N times, optionally under CPU load, and count how often each passes.

Issue 19: a test that passes alone may fail by chance when the machine is busy (a race
with an operator, a controller, a sidecar). This runs the given pytest node ids (files,
directories or ``file::test`` ids) in N consecutive pytest processes, each a fresh
interpreter as CI runs it, while K busy-loop processes keep the CPUs loaded, and prints
per test how many of the N runs it passed, and per run its wall time.

    python tools/flake_check.py -n 5 --load 2 tests/k8s tests/test_stack_e2e.py
    python tools/flake_check.py -n 20 tests/k8s/test_operator_api.py::test_status_follows_the_instances

Each run's outcomes come from a small pytest plugin (``-p``) that writes one JSON line per
test: a test passes a run when its setup, call and teardown all passed; skipped when any
phase skipped and none failed; missing when the run ended before it (a crash, the
per-run timeout). ``--trace-leaks`` loads ``tools/leak_trace.py``, so that each
``ResourceWarning: unclosed <socket ...>`` is reported with the test and the stack that
created the socket (with ``LEAK_TRACE_GC=1`` in the environment, the garbage collector also
runs at the end of each test, so a socket leaked in a reference cycle is reported in the test
that leaked it). Each run's output goes to ``--log-dir`` (a temporary folder by
default), named in the report for the runs that failed.

The load processes spin in Python until ``--load-limit-s`` (default: 2 h) has passed or
this script ends (they are stopped in a ``finally``, and on Linux the kernel kills them
if this script dies: PR_SET_PDEATHSIG), so a load never outlives the check.

Exit status: 0 every test passed every run (skips allowed), 1 some failure, 2 bad
arguments (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_PLUGIN = '''
import json, os

_OUT = os.environ["FLAKE_CHECK_OUT"]
_seen = {}


def pytest_runtest_logreport(report):
    worst = _seen.get(report.nodeid, "passed")
    outcome = report.outcome  # passed, failed or skipped, per phase
    if report.when == "call" and hasattr(report, "wasxfail"):
        outcome = "skipped"  # an expected failure is not a flake
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    if rank[outcome] > rank[worst]:
        worst = outcome
    _seen[report.nodeid] = worst
    if report.when == "teardown":
        with open(_OUT, "a") as f:
            f.write(json.dumps({"nodeid": report.nodeid, "outcome": worst}) + "\\n")
'''

_BUSY = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when this script dies (Linux; a no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_load(k: int, limit_s: float) -> list[subprocess.Popen]:
    """``k`` busy-loop processes, each ending by itself after ``limit_s`` seconds."""
    return [subprocess.Popen([sys.executable, "-c", _BUSY, str(limit_s)], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
            for _ in range(k)]


def stop_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_once(i: int, node_ids: list[str], pytest_args: list[str], log_dir: Path, plugin_dir: Path,
             timeout_s: float, trace_leaks: bool = False) -> tuple[int | None, float, dict[str, str], Path]:
    """One pytest process over ``node_ids``: (exit code or None on timeout, wall s, {nodeid: outcome}, log).

    With ``trace_leaks``, ``tools/leak_trace.py`` is loaded and writes ``runNNN.leaks``.
    """
    out = log_dir / f"run{i:03d}.jsonl"
    log = log_dir / f"run{i:03d}.log"
    paths = [str(plugin_dir), str(REPO / "tools")] if trace_leaks else [str(plugin_dir)]
    env = {**os.environ, "FLAKE_CHECK_OUT": str(out), "LEAK_TRACE_OUT": str(log_dir / f"run{i:03d}.leaks"),
           "PYTHONPATH": os.pathsep.join(filter(None, [*paths, os.environ.get("PYTHONPATH")]))}
    plugins = ["-p", "flake_check_plugin", *(["-p", "leak_trace"] if trace_leaks else [])]
    cmd = [sys.executable, "-m", "pytest", "-q", *plugins, *pytest_args, *node_ids]
    t0 = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # pytest and whatever it started
            proc.wait()
            rc = None
    wall = time.monotonic() - t0
    outcomes: dict[str, str] = {}
    if out.exists():
        for line in out.read_text().splitlines():
            rec = json.loads(line)
            outcomes[rec["nodeid"]] = rec["outcome"]
    return rc, wall, outcomes, log


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("node_ids", nargs="+", metavar="NODE_ID",
                   help="pytest node ids, files or directories (relative to the repository root)")
    p.add_argument("-n", "--runs", type=int, default=5, help="consecutive pytest processes (default 5)")
    p.add_argument("--load", type=int, default=0, metavar="K",
                   help="busy-loop processes loading the CPUs during the runs (default 0)")
    p.add_argument("--load-limit-s", type=float, default=7200.0,
                   help="each load process ends by itself after this many seconds (default 7200)")
    p.add_argument("--timeout-s", type=float, default=3600.0,
                   help="a run still going after this many seconds is killed; its unfinished tests count "
                        "as missing (default 3600)")
    p.add_argument("--log-dir", type=Path, default=None, help="where each run's output goes (default: a temp dir)")
    p.add_argument("--trace-leaks", action="store_true",
                   help="load tools/leak_trace.py: each unclosed-socket warning names the test and the stack "
                        "that created the socket (in the run's log and in runNNN.leaks)")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments, one string, e.g. '-x -k status'")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problems = [msg for bad, msg in (
        (args.runs < 1, f"--runs must be >= 1, got {args.runs}"),
        (args.load < 0, f"--load must be >= 0, got {args.load}"),
        (args.load_limit_s <= 0, f"--load-limit-s must be > 0, got {args.load_limit_s}"),
        (args.timeout_s <= 0, f"--timeout-s must be > 0, got {args.timeout_s}"),
    ) if bad]
    missing = [n for n in args.node_ids if not (REPO / n.split("::", 1)[0]).exists()]
    if missing:
        problems.append(f"no such test path: {', '.join(missing)}")
    if problems:
        print(f"flake_check: {problems[0]}", file=sys.stderr)
        return 2
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="flake-check-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    plugin_dir = Path(tempfile.mkdtemp(prefix="flake-check-plugin-"))
    (plugin_dir / "flake_check_plugin.py").write_text(_PLUGIN)
    pytest_args = args.pytest_args.split()

    print(f"{args.runs} runs of {' '.join(args.node_ids)} with {args.load} busy process(es) on "
          f"{os.cpu_count()} CPU(s); logs in {log_dir}", flush=True)
    counts: dict[str, Counter] = defaultdict(Counter)
    walls: list[float] = []
    failed_runs: list[tuple[int, Path]] = []
    leak_files: list[Path] = []
    load = start_load(args.load, args.load_limit_s)
    try:
        for i in range(1, args.runs + 1):
            rc, wall, outcomes, log = run_once(i, args.node_ids, pytest_args, log_dir, plugin_dir, args.timeout_s,
                                               args.trace_leaks)
            walls.append(wall)
            for nodeid, outcome in outcomes.items():
                counts[nodeid][outcome] += 1
            tally = Counter(outcomes.values())
            state = "timed out" if rc is None else f"exit {rc}"
            print(f"run {i}/{args.runs}: {wall:7.1f} s  {state}  passed {tally['passed']}  failed "
                  f"{tally['failed']}  skipped {tally['skipped']}", flush=True)
            if rc not in (0, 5) or tally["failed"]:
                failed_runs.append((i, log))
            leaks = log.with_suffix(".leaks")
            if leaks.exists():
                n = leaks.read_text().count("leak-trace: ")
                leak_files.append(leaks)
                print(f"  {n} unclosed socket(s) traced to their creation: {leaks}", flush=True)
    finally:
        stop_load(load)
        shutil.rmtree(plugin_dir, ignore_errors=True)

    for c in counts.values():
        c["missing"] = args.runs - sum(c.values())
    flaky = {n: c for n, c in counts.items() if c["failed"] or c["missing"]}
    print(f"\nwall time per run: min {min(walls):.1f} s, median {statistics.median(walls):.1f} s, "
          f"max {max(walls):.1f} s")
    print(f"{len(counts)} tests; passed in every run: {sum(1 for c in counts.values() if c['passed'] == args.runs)}; "
          f"skipped in some run: {sum(1 for c in counts.values() if c['skipped'])}; "
          f"failed or missing in some run: {len(flaky)}")
    width = max((len(n) for n in counts), default=10)
    print(f"\n{'test':<{width}}  passed/runs  failed  skipped  missing")
    for nodeid in sorted(counts, key=lambda n: (-(counts[n]["failed"] + counts[n]["missing"]), n)):
        c = counts[nodeid]
        print(f"{nodeid:<{width}}  {c['passed']:>6}/{args.runs:<4}  {c['failed']:>6}  {c['skipped']:>7}  "
              f"{c['missing']:>7}")
    if failed_runs:
        print("\nruns with failures (their output):")
        for i, log in failed_runs:
            print(f"  run {i}: {log}")
    if leak_files:
        print("\nunclosed sockets, with the test and stack that created each:")
        for leaks in leak_files:
            print(f"  {leaks}")
    if not counts:
        print("no test ran: check the node ids and the logs", file=sys.stderr)
        return 1
    return 1 if flaky or failed_runs else 0


if __name__ == "__main__":
    sys.exit(main())
