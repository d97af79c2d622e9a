"""The objects the operator renders actually run: emulators, sidecars and routerd as local processes.

What a pod would get is reproduced on loopback: the ConfigMap's files in a folder (the
volume mount), each container's command line with its ports moved to free ones, and the
endpoints routerd's EndpointSlice watcher would deliver for the engine Service (given as
--endpoint flags, since there is no API server here). Then a request goes through routerd
with the official openai client, and a policy change rendered by the operator reaches the
running routerd by reload, without a restart.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from stack_processes import wait_until

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))

from phasewise_operator import builders as B  # noqa: E402
from phasewise_operator.settings import OperatorSettings  # noqa: E402
from phasewise_operator.spec import PredictorSpec, check_pool, parse_pool_spec  # noqa: E402

openai = pytest.importorskip("openai")

POOL = B.PoolRef("local", "ns", "uid-1")
SPEC = {"model": {"name": "llama-2-7b"}, "emulated": True, "engine": {"replicas": 2},
        "hardwareProfile": {"name": "llama2-7b-a100"}, "routing": {"policy": "least_outstanding_tokens"}}

# One data-plane command run through its own CLI module (add_parser + run), as `phasewise CMD` does.
LAUNCH = ("import argparse, importlib, sys\n"
          "mod = importlib.import_module({'serve': 'routerd.daemon.cli', 'emulate': 'routerd.emulator.cli',"
          " 'sidecar': 'routerd.sidecar.cli'}[sys.argv[1]])\n"
          "p = argparse.ArgumentParser(); mod.add_parser(p.add_subparsers(dest='cmd'))\n"
          "sys.exit(mod.run(p.parse_args(sys.argv[1:])))\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers_200(url: str) -> bool:
    """Whether a GET of ``url`` answers 200 (False while the server is not up yet)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status == 200
    except OSError:
        return False


def _get(url: str, timeout: float = 30.0) -> str:
    """The body of a GET of ``url`` (a running server's page, such as /metrics).

    Raises:
        AssertionError: the GET failed or did not answer 200 (never read as an empty page,
            which would make every metric 0).
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            if r.status != 200:
                raise AssertionError(f"GET {url} answered {r.status}")
            return r.read().decode()
    except OSError as e:
        raise AssertionError(f"GET {url} failed within {timeout} s: {e!r}") from e


def wait_http(url: str, procs: list, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{p.args[3:]} exited {p.returncode}: {p.stdout.read() if p.stdout else ''}")
        if _answers_200(url):
            return
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready after {timeout} s")


def _args_with(args: list[str], flag: str, value: str) -> list[str]:
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


class Stack:
    """Emulators, sidecars and routerd started from rendered objects; ``mount`` plays the kubelet's
    ConfigMap update; ``close`` stops everything (SIGTERM, then SIGKILL after 20 s)."""

    def __init__(self, configmap: dict, engine: dict, routerd: dict, workdir: Path) -> None:
        self.conf = workdir / "etc-phasewise"
        self.conf.mkdir()
        self.procs: list[subprocess.Popen] = []
        self.mount(configmap)
        containers = engine["spec"]["template"]["spec"]["containers"]
        emu_args = next(c for c in containers if c["name"] == "emulator")["args"]
        side_args = next(c for c in containers if c["name"] == "sidecar")["args"]
        router = routerd["spec"]["template"]["spec"]["containers"][0]
        endpoints = []
        try:
            for i in range(engine["spec"]["replicas"]):
                http, state = free_port(), free_port()
                a = _args_with(_args_with(emu_args, "--port", str(http)), "--profile", str(self.conf / "profile.yaml"))
                self._start(["emulate", *_args_with(a, "--host", "127.0.0.1")])
                s = _args_with(_args_with(side_args, "--metrics-url", f"http://127.0.0.1:{http}/metrics"),
                               "--listen", f"127.0.0.1:{state}")
                self._start(["sidecar", *_args_with(s, "--instance", f"engine-{i}")])
                # what routerd's EndpointSlice watcher would deliver for the engine Service
                endpoints.append(f"engine-{i}=http://127.0.0.1:{http},127.0.0.1:{state}")
                wait_http(f"http://127.0.0.1:{http}/health", self.procs)
            rport = free_port()
            cmd = router["command"][1:] + [a.replace(B.CONFIG_DIR + "/", f"{self.conf}/") for a in router["args"]]
            self.routerd = self._start([*cmd, *[f"--endpoint={e}" for e in endpoints]], {
                "PHASEWISE_KUBERNETES__ENABLED": "false", "PHASEWISE_HTTP__HOST": "127.0.0.1",
                "PHASEWISE_HTTP__PORT": str(rport), "PHASEWISE_GRPC__HOST": "127.0.0.1",
                "PHASEWISE_GRPC__PORT": str(free_port())})
            self.url = f"http://127.0.0.1:{rport}"
            wait_http(f"{self.url}/readyz", self.procs)
        except BaseException:
            self.close()
            raise

    def mount(self, configmap: dict) -> None:
        """The kubelet's view of the volume: each key a file; paths in routerd.yaml point into it."""
        for key, text in configmap["data"].items():
            (self.conf / key).write_text(text.replace(B.CONFIG_DIR + "/", f"{self.conf}/"))

    def _start(self, args: list[str], extra_env: dict | None = None) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(REPO / "routerd"), **(extra_env or {})}
        p = subprocess.Popen([sys.executable, "-c", LAUNCH, *args], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()


@pytest.fixture
def stack(tmp_path):
    ps = parse_pool_spec(SPEC)
    check_pool(ps)
    kids = {(o["kind"], o["metadata"]["name"]): o for o in B.pool_children(POOL, ps, OperatorSettings())}
    st = Stack(kids[("ConfigMap", "local-routerd")], kids[("Deployment", "local-engine")],
               kids[("Deployment", "local-routerd")], tmp_path)
    try:
        yield {"url": st.url, "mount": st.mount, "routerd": st.routerd, "spec": ps}
    finally:
        st.close()


def _metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(rf"{re.escape(name)}(?:\{{(.*?)\}})? (\S+)$", line)
        if not m:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def check_requests(url: str, model: str) -> None:
    """Completions (plain and streamed) through routerd with the openai client; decisions counted."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        _check_requests(client, model)
    except openai.APIStatusError as e:  # say what routerd answered
        raise AssertionError(f"routerd answered {e.status_code}: {e.body}") from e
    finally:
        client.close()
    assert _metric(_get(url + "/metrics"), "phasewise_decisions_total") >= 5


def _check_requests(client, model: str) -> None:
    assert [m.id for m in client.models.list().data] == [model]
    for _ in range(4):
        r = client.completions.create(model=model, prompt="Hello from the operator", max_tokens=8)
        assert r.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model=model, max_tokens=5, stream=True,
                                                 messages=[{"role": "user", "content": "hi"}]))
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 5


def wait_reloaded(url: str, timeout: float = 30.0) -> None:
    """Until routerd counts a successful reload (and no failed one)."""
    def reloads() -> tuple[float, float]:
        metrics = _get(url + "/metrics")
        return (_metric(metrics, "phasewise_config_reloads_total", result="ok"),
                _metric(metrics, "phasewise_config_reloads_total", result="error"))

    ok, errors = wait_until(reloads, lambda v: v[0] >= 1 or v[1] > 0, timeout,
                            "routerd's phasewise_config_reloads_total (ok, error) to count the reload",
                            interval_s=0.2)
    assert ok >= 1 and errors == 0, f"reloads (ok, error): {(ok, errors)}"


def test_request_through_the_rendered_stack_and_reload(stack):
    check_requests(stack["url"], "llama-2-7b")
    metrics = _get(stack["url"] + "/metrics")
    assert {e for e in re.findall(r'endpoint="([^"]+)"', metrics)} >= {"engine-0", "engine-1"}
    # SPEC names no predictor: routerd runs the shipped model. Every request of check_requests
    # asks for at most 8 tokens, so its prediction is capped to bucket 0 (a prediction, not "none").
    assert _metric(metrics, "phasewise_predicted_bucket_total", predicted="0", actual="0") == 5
    assert _metric(metrics, "phasewise_predicted_bucket_total", predicted="none") == 0

    # The operator renders a policy change and predictor none; the kubelet swaps the file;
    # routerd reloads it.
    ps = stack["spec"].model_copy(update={"routing": stack["spec"].routing.model_copy(
        update={"policy": "late_binding", "params": {"reserve_fraction": 0.1}}),
        "predictor": PredictorSpec(name="none")})
    time.sleep(1.1)  # a new modification time
    stack["mount"](B.routerd_configmap(POOL, ps))
    wait_reloaded(stack["url"])
    check_requests(stack["url"], "llama-2-7b")  # served right after the reload
    assert stack["routerd"].poll() is None  # the same process: reloaded, not restarted
    metrics = _get(stack["url"] + "/metrics")
    assert _metric(metrics, "phasewise_predicted_bucket_total", predicted="none", actual="0") == 5
    assert _metric(metrics, "phasewise_predicted_bucket_total", predicted="0", actual="0") == 5  # before only


def test_profile_job_command_against_an_emulator_fits_the_pool_profile(tmp_path):
    """The profile job's work command (with --quick) run against an emulator of the pool, its output
    through the reporter's ConfigMap into the pool's inline profile: close to the emulated hardware."""
    from phasewise_operator import jobs as J
    from phasewise_operator import report as R
    from phasewise_operator.spec import parse_job_spec

    ps = parse_pool_spec({"model": {"name": "m"}, "emulated": True, "engine": {"replicas": 1},
                          "hardwareProfile": {"name": "llama2-7b-a100"}})
    cm = B.routerd_configmap(POOL, ps)
    conf = tmp_path / "etc-phasewise"
    conf.mkdir()
    (conf / "profile.yaml").write_text(cm["data"]["profile.yaml"])
    results = tmp_path / "results"
    results.mkdir()
    http = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO / "routerd")}
    emu = subprocess.Popen([sys.executable, "-c", LAUNCH, "emulate", "--host", "127.0.0.1", "--port", str(http),
                            "--model", "m", "--profile", str(conf / "profile.yaml")], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_http(f"http://127.0.0.1:{http}/health", [emu])
        job = J.batch_job(B.PoolRef("fit", "ns", "u"), parse_job_spec(
            {"poolRef": {"name": "local"}, "task": "profile", "profile": {"args": ["--quick"]}}),
            POOL, ps, OperatorSettings(), target_url=f"http://127.0.0.1:{http}")
        cmd = job["spec"]["template"]["spec"]["initContainers"][0]["command"]
        cmd = [a.replace(B.CONFIG_DIR + "/", f"{conf}/").replace(J.RESULTS_DIR + "/", f"{results}/") for a in cmd]
        launch = LAUNCH.replace("'sidecar': 'routerd.sidecar.cli'}", "'sidecar': 'routerd.sidecar.cli', "
                                "'profile': 'routerd.profiler.cli'}")
        r = subprocess.run([sys.executable, "-c", launch, *cmd[1:]], env=env, capture_output=True, text=True,
                           timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        emu.send_signal(signal.SIGTERM)
        emu.communicate(timeout=20)
    result = R.result_configmap("profile", results, name="fit-result", namespace="ns", owner_name="fit",
                                owner_uid="u")
    inline, _ = J.profile_from_result(result["data"], POOL, ps)
    truth = yaml.safe_load(cm["data"]["profile.yaml"])
    assert inline["basedOn"] == "llama2-7b-a100"
    # The fit reads client-side wall-clock timings, which scheduling on a loaded machine skews:
    # a sanity band here (a wrong unit, a swapped term or a failed fit is far outside it).
    # The accuracy target (grad1 and grad2 within 10 %) is measured and printed by
    # benchmarks/profiler_accuracy.py (issue 19). The dominant terms: within a factor of 2.
    for camel, snake in (("grad1", "grad1"), ("overheadS", "overhead_s")):
        assert 0.5 <= inline[camel] / truth[snake] <= 2.0, (camel, inline[camel], truth[snake])
    # The per-sequence (11 us) and per-context-token (0.3 us) decode terms are the size of the
    # scheduling noise itself: a run beside a CI run and two busy processes fitted 12x the
    # per-sequence term.
    # What they must keep is their sign and order below the step overhead (10 ms): a unit or
    # a swap would break it.
    for camel in ("decodePerSeqS", "decodePerCtxTokenS"):
        assert 0.0 <= inline[camel] < inline["overheadS"], (camel, inline[camel], inline["overheadS"])
    assert inline["kvCapacityTokens"] == truth["kv_capacity_tokens"]  # read from the emulator's /metrics
    assert inline["maxNumSeqs"] == truth["max_num_seqs"]  # from --base-profile, the pool's profile
