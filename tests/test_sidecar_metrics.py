"""Parsing vLLM /metrics text into the instance state (routerd.sidecar.metrics).

Also home of the metrics pages the other sidecar tests serve (``vllm_page``).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routerd.api.v1.instance_state_pb2 import InstanceState
from routerd.sidecar.metrics import MetricsParseError, VllmMetrics, parse_vllm_metrics, prefix_cache_window

# An excerpt of a vLLM 0.11 V1 /metrics page, written by hand in the format of
# prometheus_client (HELP/TYPE lines, counters exposed with _total plus a _created gauge,
# histograms with _bucket/_count/_sum). 0.11 still shows the deprecated
# time_per_output_token_seconds beside inter_token_latency_seconds; they differ here so
# that the test sees which one is read.
VLLM_0_11 = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12034.0
python_gc_objects_collected_total{generation="1"} 3021.0
python_gc_objects_collected_total{generation="2"} 412.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 2.147483648e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.4375
# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{engine="0",model_name="Qwen/Qwen3-8B",sleep_state="awake"} 1.0
vllm:engine_sleep_state{engine="0",model_name="Qwen/Qwen3-8B",sleep_state="weights_offloaded"} 0.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-8B"} 12345.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="Qwen/Qwen3-8B"} 1.7593536e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-8B"} 4096.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="Qwen/Qwen3-8B"} 1.7593536e+09
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-8B"} 12345.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="Qwen/Qwen3-8B"} 6789.0
# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="Qwen/Qwen3-8B"} 100.0
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-8B"} 900.0
vllm:iteration_tokens_total_count{engine="0",model_name="Qwen/Qwen3-8B"} 900.0
vllm:iteration_tokens_total_sum{engine="0",model_name="Qwen/Qwen3-8B"} 19134.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="Qwen/Qwen3-8B"} 40.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="Qwen/Qwen3-8B"} 7.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="Qwen/Qwen3-8B"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="Qwen/Qwen3-8B"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="Qwen/Qwen3-8B"} 30.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.25",model_name="Qwen/Qwen3-8B"} 46.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-8B"} 48.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-8B"} 48.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-8B"} 6.0
# HELP vllm:time_per_output_token_seconds Histogram of time per output token in seconds.DEPRECATED: Use vllm:inter_token_latency_seconds instead.
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{engine="0",le="0.025",model_name="Qwen/Qwen3-8B"} 6000.0
vllm:time_per_output_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-8B"} 6741.0
vllm:time_per_output_token_seconds_count{engine="0",model_name="Qwen/Qwen3-8B"} 6741.0
vllm:time_per_output_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-8B"} 161.784
# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.025",model_name="Qwen/Qwen3-8B"} 6500.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-8B"} 6741.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="Qwen/Qwen3-8B"} 6741.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="Qwen/Qwen3-8B"} 134.82
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="Qwen/Qwen3-8B"} 5.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-8B"} 48.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="Qwen/Qwen3-8B"} 48.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="Qwen/Qwen3-8B"} 96.0
"""

# vLLM 0.8-era names (and the llm-d inference simulator's subset): the deprecated
# gpu_cache_usage_perc and time_per_output_token_seconds, no preemption counter.
VLLM_DEPRECATED = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="llama"} 0.8
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="llama"} 4.0
vllm:time_per_output_token_seconds_count{model_name="llama"} 4.0
vllm:time_per_output_token_seconds_sum{model_name="llama"} 0.2
"""

# Data parallel, 2 engines of one model: counts add, KV usage is the mean, latency
# means pool both engines' sums and counts.
VLLM_TWO_ENGINES = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:num_preemptions_total{engine="1",model_name="m"} 5.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 2.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 6.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="m"} 3.0
"""

# No HELP/TYPE lines at all (untyped samples keep their full names), two models, both
# KV gauge names (the current one wins), histograms with no observations yet.
VLLM_UNTYPED = """\
vllm:num_requests_running{model_name="b"} 1
vllm:num_requests_running{model_name="a"} 2
vllm:num_requests_waiting{model_name="b"} 3
vllm:kv_cache_usage_perc{model_name="b"} 0.125
vllm:gpu_cache_usage_perc{model_name="b"} 0.9
vllm:prompt_tokens_total{model_name="a"} 10
vllm:prompt_tokens_total{model_name="b"} 20
vllm:prompt_tokens_total_extra{model_name="zzz"} 1000
vllm:e2e_request_latency_seconds_count{model_name="a"} 0
vllm:e2e_request_latency_seconds_sum{model_name="a"} 0
"""


@pytest.mark.parametrize("text, expected", [
    (VLLM_0_11, VllmMetrics(
        num_requests_running=5, num_requests_waiting=2, kv_cache_usage=0.4375, num_preemptions_total=3,
        prompt_tokens_total=12345, generation_tokens_total=6789, request_success_total=40 + 7 + 1,
        mean_ttft_s=6.0 / 48, mean_tpot_s=134.82 / 6741, mean_e2e_s=96.0 / 48, models=("Qwen/Qwen3-8B",),
        prefix_cache_queries_total=12345, prefix_cache_hits_total=4096)),
    (VLLM_DEPRECATED, VllmMetrics(
        num_requests_running=1, num_requests_waiting=0, kv_cache_usage=0.8, mean_tpot_s=0.2 / 4,
        models=("llama",))),
    (VLLM_TWO_ENGINES, VllmMetrics(
        num_requests_running=7, num_requests_waiting=1, kv_cache_usage=0.375, num_preemptions_total=7,
        mean_ttft_s=4.0 / 8, models=("m",))),
    (VLLM_UNTYPED, VllmMetrics(
        num_requests_running=3, num_requests_waiting=3, kv_cache_usage=0.125, prompt_tokens_total=30,
        models=("a", "b"))),
], ids=["vllm-0.11", "deprecated-names", "two-engines", "untyped-two-models"])
def test_parse_vllm_metrics(text, expected):
    got = parse_vllm_metrics(text)
    for name in VllmMetrics.__slots__:
        want = getattr(expected, name)
        value = getattr(got, name)
        assert value == (pytest.approx(want, rel=1e-12) if isinstance(want, float) else want), name


def test_values_fill_an_instance_state_message():
    state = InstanceState(instance="vllm-0", healthy=True, **parse_vllm_metrics(VLLM_0_11).as_fields())
    back = InstanceState.FromString(state.SerializeToString())
    assert back.num_requests_running == 5 and back.kv_cache_usage == 0.4375
    assert back.request_success_total == 48 and back.mean_e2e_s == 2.0
    assert list(back.models) == ["Qwen/Qwen3-8B"]


@pytest.mark.parametrize("text, message", [
    ("", "no vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc sample"),
    ("<html><body>Not Found</body></html>\n", "not a vLLM /metrics page"),
    (VLLM_0_11.replace("vllm:num_requests_waiting{", "vllm:num_requests_waiting_x{"),
     "no vllm:num_requests_waiting sample"),
    (VLLM_DEPRECATED.replace("gpu_cache_usage_perc", "cpu_cache_usage_perc"), "no vllm:kv_cache_usage_perc sample"),
    ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\" 3\n",
     "line 2: malformed sample 'vllm:num_requests_running{model_name=\"m\" 3'"),
    (VLLM_DEPRECATED.replace('vllm:num_requests_waiting{model_name="llama"} 0.0',
                             'vllm:num_requests_waiting{model_name="llama"} many'),
     "line 4: malformed sample"),
    (VLLM_DEPRECATED.replace("} 0.8", "} NaN"), 'vllm:gpu_cache_usage_perc{model_name="llama"}: value nan is not finite'),
    (VLLM_DEPRECATED.replace("} 0.2", "} +Inf"), "value inf is not finite"),
], ids=["empty", "html", "no-waiting", "no-kv", "unclosed-labels", "bad-value", "nan", "inf"])
def test_bad_pages_raise_a_clear_value_error(text, message):
    with pytest.raises(MetricsParseError) as info:
        parse_vllm_metrics(text)
    assert isinstance(info.value, ValueError)
    assert message in str(info.value)


def test_reads_what_prometheus_client_itself_exposes():
    """vLLM declares its metrics with prometheus_client; its own exposition must parse to the values set."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    gauges = {n: Gauge(n, n, labels, registry=reg)
              for n in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")}
    preemptions = Counter("vllm:num_preemptions", "p", labels, registry=reg)  # exposed as ..._total
    success = Counter("vllm:request_success", "s", [*labels, "finished_reason"], registry=reg)
    ttft = Histogram("vllm:time_to_first_token_seconds", "t", labels, buckets=(0.1, 1.0), registry=reg)
    queries = Counter("vllm:prefix_cache_queries", "q", labels, registry=reg)  # as vLLM declares them
    hits = Counter("vllm:prefix_cache_hits", "h", labels, registry=reg)
    for engine, (running, kv, ttfts) in enumerate([(3, 0.2, [0.05, 0.5]), (1, 0.6, [2.0])]):
        lab = ("m", str(engine))
        gauges["vllm:num_requests_running"].labels(*lab).set(running)
        gauges["vllm:num_requests_waiting"].labels(*lab).set(engine)
        gauges["vllm:kv_cache_usage_perc"].labels(*lab).set(kv)
        preemptions.labels(*lab).inc(2)
        success.labels(*lab, "stop").inc(3)
        success.labels(*lab, "length").inc()
        for t in ttfts:
            ttft.labels(*lab).observe(t)
        queries.labels(*lab).inc(64 * (engine + 1))
        hits.labels(*lab).inc(16)
    got = parse_vllm_metrics(generate_latest(reg).decode())
    assert (got.prefix_cache_queries_total, got.prefix_cache_hits_total) == (64 + 128, 32)
    assert got.prefix_cache_hit_rate == pytest.approx(32 / 192)
    assert (got.num_requests_running, got.num_requests_waiting) == (4, 1)
    assert got.kv_cache_usage == pytest.approx(0.4)
    assert (got.num_preemptions_total, got.request_success_total) == (4, 8)
    assert got.mean_ttft_s == pytest.approx((0.05 + 0.5 + 2.0) / 3)
    assert got.models == ("m",)


def test_a_malformed_line_the_state_does_not_read_is_ignored():
    text = VLLM_0_11.replace('vllm:iteration_tokens_total_count{engine="0",model_name="Qwen/Qwen3-8B"} 900.0',
                             "vllm:iteration_tokens_total_count{engine= 900.0")
    assert parse_vllm_metrics(text).num_requests_running == 5


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 256), st.integers(0, 1000), st.floats(0, 1), st.integers(0, 10**6),
                          st.floats(0, 100)), min_size=1, max_size=8))
def test_engines_add_up(engines):
    """Any number of engines: the parsed totals equal sums computed independently of the page."""
    text = vllm_page(engines=[dict(running=r, waiting=w, kv=kv, prompt_tokens=p, ttft_sum=s, ttft_count=r)
                              for r, w, kv, p, s in engines])
    got = parse_vllm_metrics(text)
    assert got.num_requests_running == sum(e[0] for e in engines)
    assert got.num_requests_waiting == sum(e[1] for e in engines)
    assert got.kv_cache_usage == pytest.approx(sum(e[2] for e in engines) / len(engines))
    assert got.prompt_tokens_total == sum(e[3] for e in engines)
    count = sum(e[0] for e in engines)
    assert got.mean_ttft_s == (pytest.approx(sum(e[4] for e in engines) / count) if count else 0.0)


def test_typical_page_is_about_200_lines_and_parses():
    text = vllm_page(running=4, waiting=1, kv=0.5)
    assert 180 <= len(text.splitlines()) <= 230
    got = parse_vllm_metrics(text)
    assert (got.num_requests_running, got.num_requests_waiting, got.kv_cache_usage) == (4, 1, 0.5)
    assert got.mean_ttft_s == pytest.approx(2.0 / 16) and got.mean_e2e_s == pytest.approx(40.0 / 16)
    assert got.mean_tpot_s == pytest.approx(1.6 / 80) and got.request_success_total == 16


# -- prefix cache ---------------------------------------------------------------------------

# vLLM 0.9-0.10 exposes the prefix-cache counters under both names (the gpu_ ones deprecated);
# they differ here so that the test sees which pair is read.
VLLM_BOTH_PREFIX_NAMES = VLLM_DEPRECATED + """\
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{model_name="llama"} 999.0
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{model_name="llama"} 111.0
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{model_name="llama"} 800.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{model_name="llama"} 200.0
"""
# vLLM 0.8: only the gpu_ names.
VLLM_OLD_PREFIX_NAMES = VLLM_DEPRECATED + """\
vllm:gpu_prefix_cache_queries_total{model_name="llama"} 640.0
vllm:gpu_prefix_cache_hits_total{model_name="llama"} 160.0
"""
# Two data-parallel engines: counters add, the rate is the pooled one (not the mean of 0.5 and 0.1).
VLLM_TWO_ENGINES_PREFIX = VLLM_TWO_ENGINES + """\
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 300.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 50.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 30.0
"""
# Prefix caching off (--no-enable-prefix-caching): vLLM still exports both counters, at 0.
VLLM_CACHE_OFF = VLLM_DEPRECATED + """\
vllm:prefix_cache_queries_total{model_name="llama"} 0.0
vllm:prefix_cache_hits_total{model_name="llama"} 0.0
"""


@pytest.mark.parametrize("text, queries, hits, rate", [
    (VLLM_0_11, 12345, 4096, 4096 / 12345),
    (VLLM_BOTH_PREFIX_NAMES, 800, 200, 0.25),
    (VLLM_OLD_PREFIX_NAMES, 640, 160, 0.25),
    (VLLM_TWO_ENGINES_PREFIX, 400, 80, 0.2),
    (VLLM_CACHE_OFF, 0, 0, None),
], ids=["vllm-0.11", "both-names-current-wins", "gpu-names-only", "two-engines-pooled", "caching-off"])
def test_prefix_cache_counters_and_cumulative_hit_rate(text, queries, hits, rate):
    got = parse_vllm_metrics(text)
    assert (got.prefix_cache_queries_total, got.prefix_cache_hits_total) == (queries, hits)
    assert got.prefix_cache_hit_rate == (None if rate is None else pytest.approx(rate, rel=1e-12))
    state = InstanceState.FromString(InstanceState(**got.as_fields()).SerializeToString())
    assert state.HasField("prefix_cache_queries_total") and state.prefix_cache_queries_total == queries
    assert state.HasField("prefix_cache_hits_total") and state.prefix_cache_hits_total == hits
    assert state.HasField("prefix_cache_hit_rate") == (rate is not None)
    if rate is not None:
        assert state.prefix_cache_hit_rate == pytest.approx(rate, rel=1e-12)
    assert not state.HasField("prefix_cache_window_queries")  # no window without a previous scrape


@pytest.mark.parametrize("text", [
    VLLM_DEPRECATED,
    VLLM_UNTYPED,
    # Half a pair is no rate: a page with queries but no hits (or the reverse) reports neither.
    VLLM_DEPRECATED + 'vllm:prefix_cache_queries_total{model_name="llama"} 10.0\n',
    VLLM_DEPRECATED + 'vllm:prefix_cache_hits_total{model_name="llama"} 10.0\n',
    # One current name and one deprecated one are two different series, not a pair.
    VLLM_DEPRECATED + 'vllm:prefix_cache_queries_total{model_name="llama"} 10.0\n'
                      'vllm:gpu_prefix_cache_hits_total{model_name="llama"} 5.0\n',
], ids=["none", "untyped", "queries-only", "hits-only", "mixed-names"])
def test_a_page_without_the_prefix_counters_reports_nothing_not_zero(text):
    got = parse_vllm_metrics(text)
    assert got.prefix_cache_queries_total is None and got.prefix_cache_hits_total is None
    assert got.prefix_cache_hit_rate is None
    fields = got.as_fields()
    assert not any(k.startswith("prefix_cache") for k in fields)
    state = InstanceState.FromString(InstanceState(**fields).SerializeToString())
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "prefix_cache_hit_rate",
                 "prefix_cache_window_queries", "prefix_cache_window_hits", "prefix_cache_window_s",
                 "prefix_cache_window_hit_rate"):
        assert not state.HasField(name), name
    # The window needs the counters on both sides.
    with_counters = parse_vllm_metrics(VLLM_CACHE_OFF)
    assert prefix_cache_window(got, with_counters, 1.0) is None
    assert prefix_cache_window(with_counters, got, 1.0) is None
    assert prefix_cache_window(None, with_counters, 1.0) is None


def _prefix_page(queries: float, hits: float) -> VllmMetrics:
    return parse_vllm_metrics(VLLM_DEPRECATED + f'vllm:prefix_cache_queries_total{{model_name="llama"}} {queries}\n'
                              f'vllm:prefix_cache_hits_total{{model_name="llama"}} {hits}\n')


@pytest.mark.parametrize("before, after, window", [
    # 600 tokens queried since the previous scrape, 450 of them hits: 0.75 in the window,
    # while the cumulative rate is 700 / 1600 = 0.4375.
    ((1000, 250), (1600, 700), (600, 450, 0.75)),
    # Nothing queried in between: counts 0, no rate (not 0, not the cumulative one).
    ((1600, 700), (1600, 700), (0, 0, None)),
    # The engine restarted (counters went down): the window is what it counted since, 50 / 200.
    ((1600, 700), (200, 50), (200, 50, 0.25)),
    # Only hits went down (a reset that the next queries already exceed): still a reset.
    ((100, 90), (150, 10), (150, 10, 10 / 150)),
], ids=["delta", "idle", "reset", "reset-hits-only"])
def test_windowed_hit_rate_since_the_previous_scrape(before, after, window):
    prev, cur = _prefix_page(*before), _prefix_page(*after)
    w = prefix_cache_window(prev, cur, 0.25)
    assert (w.queries, w.hits, w.seconds) == (window[0], window[1], 0.25)
    assert w.hit_rate == (None if window[2] is None else pytest.approx(window[2], rel=1e-12))
    state = InstanceState(**cur.as_fields(w))
    assert (state.prefix_cache_window_queries, state.prefix_cache_window_hits, state.prefix_cache_window_s) == \
        (window[0], window[1], 0.25)
    assert state.HasField("prefix_cache_window_hit_rate") == (window[2] is not None)
    assert state.prefix_cache_hit_rate == pytest.approx(after[1] / after[0], rel=1e-12)


def test_hits_above_queries_clamp_the_rate_to_one():
    """vLLM raises queries before hits, so a scrape between the two increments can see more
    hits than queries in a window: a rate, never above 1."""
    w = prefix_cache_window(_prefix_page(100, 50), _prefix_page(110, 70), 0.1)
    assert (w.queries, w.hits, w.hit_rate) == (10, 20, 1.0)


# -- pages served by the other sidecar tests ------------------------------------------------

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


def vllm_page(running: float = 0, waiting: float = 0, kv: float = 0.0, *, model: str = "Qwen/Qwen3-8B",
              engines: list[dict] | None = None) -> str:
    """A vLLM 0.11-style /metrics page of about 200 lines (one engine unless ``engines`` is given).

    Besides the values given, each engine reports 16 finished requests with TTFT sum 2 s
    (mean 0.125 s) and E2E sum 40 s (mean 2.5 s) unless its dict overrides them, and
    prefix-cache counters ``prefix_queries`` / ``prefix_hits`` (default 0).
    """
    if engines is None:
        engines = [dict(running=running, waiting=waiting, kv=kv)]
    lab = [f'engine="{i}",model_name="{model}"' for i in range(len(engines))]
    out: list[str] = []

    def family(name: str, kind: str, help_: str, rows: list[str]) -> None:
        out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *rows])

    family("python_gc_objects_collected_total", "counter", "Objects collected during gc",
           [f'python_gc_objects_collected_total{{generation="{g}"}} {1000 * (g + 1)}.0' for g in range(3)])
    family("python_gc_collections_total", "counter", "Number of times this generation was collected",
           [f'python_gc_collections_total{{generation="{g}"}} {50 * (g + 1)}.0' for g in range(3)])
    family("python_info", "gauge", "Python platform information",
           ['python_info{implementation="CPython",major="3",minor="12",patchlevel="11",version="3.12.11"} 1.0'])
    for name in ("process_virtual_memory_bytes", "process_resident_memory_bytes", "process_start_time_seconds",
                 "process_cpu_seconds_total", "process_open_fds", "process_max_fds"):
        family(name, "gauge", "Process metric", [f"{name} 1.0e+06"])
    for name, key, help_ in (("vllm:num_requests_running", "running", "Number of requests in model execution batches."),
                             ("vllm:num_requests_waiting", "waiting", "Number of requests waiting to be processed."),
                             ("vllm:kv_cache_usage_perc", "kv", "KV-cache usage. 1 means 100 percent usage.")):
        family(name, "gauge", help_, [f"{name}{{{lab[i]}}} {float(e[key])!r}" for i, e in enumerate(engines)])
    for name, key in (("vllm:num_preemptions", "preemptions"), ("vllm:prompt_tokens", "prompt_tokens"),
                      ("vllm:generation_tokens", "generation_tokens"), ("vllm:prefix_cache_queries", "prefix_queries"),
                      ("vllm:prefix_cache_hits", "prefix_hits")):
        family(f"{name}_total", "counter", "Counter",
               [f"{name}_total{{{lab[i]}}} {float(e.get(key, 0))!r}" for i, e in enumerate(engines)])
        family(f"{name}_created", "gauge", "Counter",
               [f"{name}_created{{{lab[i]}}} 1.7593536e+09" for i in range(len(engines))])
    family("vllm:request_success_total", "counter", "Count of successfully processed requests.",
           [f'vllm:request_success_total{{{lab[i]},finished_reason="{r}"}} {n}.0'
            for i in range(len(engines)) for r, n in (("stop", 12), ("length", 4), ("abort", 0))])

    def histogram(name: str, buckets, key: str, default_sum: float, default_count: float) -> None:
        rows = []
        for i, e in enumerate(engines):
            count = float(e.get(f"{key}_count", default_count))
            rows += [f'{name}_bucket{{{lab[i]},le="{b}"}} {count!r}' for b in buckets]
            rows += [f'{name}_bucket{{{lab[i]},le="+Inf"}} {count!r}', f"{name}_count{{{lab[i]}}} {count!r}",
                     f"{name}_sum{{{lab[i]}}} {float(e.get(f'{key}_sum', default_sum))!r}"]
        family(name, "histogram", "Histogram", rows)

    histogram("vllm:time_to_first_token_seconds", _TTFT_BUCKETS, "ttft", 2.0, 16)
    histogram("vllm:inter_token_latency_seconds", _ITL_BUCKETS, "itl", 1.6, 80)
    histogram("vllm:e2e_request_latency_seconds", _E2E_BUCKETS, "e2e", 40.0, 16)
    histogram("vllm:request_prompt_tokens", _TOKEN_BUCKETS, "prompt", 4096.0, 16)
    histogram("vllm:request_generation_tokens", _TOKEN_BUCKETS, "gen", 1024.0, 16)
    return "\n".join(out) + "\n"
