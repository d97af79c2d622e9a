"""A real vLLM engine that dies under routerd (issue 31), with a real ``phasewise sidecar`` scraping
each engine's real ``/metrics``: an engine of this module's own (``crash``, killed with SIGKILL
mid-stream) and the first engine of the shared pair (``pair0``, left running).

* The stream it was sending is broken, not a success: the official ``openai`` client raises
  ``openai.APIError`` (routerd's SSE error event), ``phasewise_streams_broken_total`` counts it,
  nothing counts it as a completion.
* Its sidecar then reports it unhealthy (its scrapes are refused): routerd counts it not ready
  (``phasewise_endpoint_ready``, ``/readyz``) and sends it nothing while ``pair0`` is ready.
"""

from __future__ import annotations

import json
import re
import uuid

import openai
import pytest

from real_vllm.engine import MODEL_NAME
from stack_processes import (Stack, StackProcess, _base_env, free_ports, http_get, marked_processes, metric_sum,
                             routerd_metrics, wait_until)

_SIDECAR_LINE = re.compile(r"on port (\d+), scraping")
#: Counters compared before and after each step.
_COUNTED = ("phasewise_requests_total", "phasewise_request_e2e_seconds_count", "phasewise_generation_tokens_total",
            "phasewise_streams_broken_total", "phasewise_decisions_total", "phasewise_upstream_errors_total",
            "phasewise_upstream_retries_total")


@pytest.fixture(scope="module")
def crash_stack(request, vllm_engine_factory, vllm_pair, tmp_path_factory):
    """routerd (round robin: its first request goes to ``crash``, the first endpoint) over the two
    engines, a sidecar beside each."""
    engine = vllm_engine_factory("crash", lora=False, kv_events=False)
    logdir = tmp_path_factory.mktemp("engine-crash")
    engines = {"crash": engine, "pair0": vllm_pair[0]}
    addrs = {name: f"127.0.0.1:{p}" for name, p in zip(engines, free_ports(len(engines)))}
    marker = uuid.uuid4().hex
    sidecars = [StackProcess(f"sidecar-{name}", ["sidecar", "--metrics-url", e.url + "/metrics", "--listen",
                                                 addrs[name], "--instance", name, "--endpoint", e.url,
                                                 "--log-level", "info"], logdir, _base_env(marker))
                for name, e in engines.items()]

    def stop_sidecars() -> None:
        for p in sidecars:
            p.signal(15)
        for p in sidecars:
            p.wait(15)
        assert marked_processes(marker) == []

    request.addfinalizer(stop_sidecars)
    for p in sidecars:
        p.wait_for(_SIDECAR_LINE, 60)
    s = Stack(logdir, n=0, sidecars=False, startup_timeout_s=120,
              extra_endpoints=[f"{name}={e.url},{addrs[name]}" for name, e in engines.items()],
              routerd_flags=("--policy", "round_robin", "--predictor", "none")).start_for(request)
    # Both sidecars' snapshots in, fresh and healthy (else the first pick would be the fallback's).
    wait_until(lambda: routerd_metrics(s), lambda m: metric_sum(m, "phasewise_endpoint_state_stale") == 0
               and metric_sum(m, "phasewise_endpoint_ready") == 2, 60, "both endpoints ready with fresh state")
    return {"stack": s, "engine": engine, "sidecars": sidecars}


def _counts(s: Stack) -> dict[tuple, float]:
    """Every sample of the counters in :data:`_COUNTED`, by (name, sorted labels)."""
    return {(n, tuple(sorted(lab.items()))): v for n, lab, v in routerd_metrics(s) if n in _COUNTED}


def _delta(before: dict, after: dict, name: str, **labels: str) -> float:
    def total(c):
        return sum(v for (n, lab), v in c.items() if n == name and all(dict(lab).get(k) == x
                                                                          for k, x in labels.items()))
    return total(after) - total(before)


def test_an_engine_killed_mid_stream_is_a_broken_stream_not_a_success(crash_stack):
    s, engine = crash_stack["stack"], crash_stack["engine"]
    assert engine.proc is not None, "the crash engine was already stopped"
    before = _counts(s)
    texts: list[str] = []
    with openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        # 1,500 tokens take seconds on this engine (about 3 ms each): it is killed long before the end.
        stream = client.completions.create(model=MODEL_NAME, prompt=f"a long answer {uuid.uuid4().hex}",
                                           max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError) as err:
            for chunk in stream:
                texts += [c.text for c in chunk.choices]
                if len(texts) == 5:
                    engine.kill()  # SIGKILL to the whole process group: no goodbye on any socket
    assert 5 <= len(texts) < 1500
    # routerd's SSE error event at an event boundary (vLLM writes whole events), not a cut connection.
    assert type(err.value) is openai.APIError, err.value
    assert err.value.body["code"] == "upstream_stream_broken" and "crash" in err.value.body["message"]
    wait_until(lambda: routerd_metrics(s), lambda m: metric_sum(m, "phasewise_in_flight_requests") == 0, 30,
               "the stream's booking released")
    after = _counts(s)
    assert _delta(before, after, "phasewise_decisions_total", endpoint="crash") == 1  # it went to the engine killed
    assert _delta(before, after, "phasewise_streams_broken_total", endpoint="crash", reason="closed") == 1
    assert _delta(before, after, "phasewise_streams_broken_total") == 1
    assert _delta(before, after, "phasewise_requests_total", code="502") == 1
    assert _delta(before, after, "phasewise_requests_total", code="200") == 0
    assert _delta(before, after, "phasewise_request_e2e_seconds_count") == 0
    assert _delta(before, after, "phasewise_generation_tokens_total") == 0
    assert _delta(before, after, "phasewise_upstream_errors_total", endpoint="crash", kind="stream") == 1


def test_the_dead_engines_sidecar_makes_it_not_ready_and_it_gets_nothing(crash_stack):
    s, engine = crash_stack["stack"], crash_stack["engine"]
    engine.kill()  # already dead after the test above; idempotent
    # Its sidecar's scrapes are refused: unhealthy, hence not ready.
    wait_until(lambda: routerd_metrics(s), lambda m: metric_sum(m, "phasewise_endpoint_ready", endpoint="crash") == 0
               and metric_sum(m, "phasewise_endpoint_ready", endpoint="pair0") == 1, 30, "crash not ready")
    status, body = http_get(s.url + "/readyz")
    assert status == 200  # pair0 is ready
    ready = json.loads(body)
    assert ready["unhealthy"] == ["crash"] and ready["status"] == "ready"
    # The reason is the sidecar's own failed scrape of the engine's /metrics (refused, or reset).
    said = rf"endpoint crash: its sidecar reports it unhealthy \((cannot connect to|scrape of) {engine.url}/metrics"
    assert re.search(said, s.routerd.log_text()), s.routerd.log_text()[-3000:]
    before = _counts(s)
    with openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        for i in range(4):
            c = client.completions.create(model=MODEL_NAME, prompt=f"after the crash {i} {uuid.uuid4().hex}",
                                          max_tokens=4, extra_body={"ignore_eos": True})
            assert c.usage.completion_tokens == 4 and c.system_fingerprint.startswith("vllm-")
    after = _counts(s)
    # Without the sidecar's word, round robin would have sent two of them to the dead engine (each a
    # refused connect, then a retry on pair0).
    assert _delta(before, after, "phasewise_decisions_total", endpoint="crash") == 0
    assert _delta(before, after, "phasewise_decisions_total", endpoint="pair0") == 4
    assert _delta(before, after, "phasewise_upstream_errors_total", endpoint="crash") == 0
    assert _delta(before, after, "phasewise_upstream_retries_total") == 0
    assert _delta(before, after, "phasewise_requests_total", code="200") == 4
