"""The emulator's ``/metrics``: vLLM V1 metric names, labels and buckets, in a registry of its own.

Names, help texts, label names (``model_name``, ``engine``) and histogram buckets
follow ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``; see
``shared/docs/vllm-and-simulators.md`` §2), so a scraper written for vLLM (the
phasewise sidecar, Prometheus dashboards) reads the emulator unchanged. Gauges and
counters are read from the engine when scraped (a custom collector), so the hot
path only observes the latency histograms.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Histogram, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString
from prometheus_client.registry import Collector

from routerd.emulator.engine import EngineStats, TokenStream

#: vLLM's ``vllm:time_to_first_token_seconds`` buckets (s).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
#: vLLM's ``vllm:inter_token_latency_seconds`` (formerly ``time_per_output_token``) buckets (s).
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
#: vLLM's request-latency buckets (s), used for ``vllm:e2e_request_latency_seconds``.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Content type of the Prometheus text exposition format served on ``/metrics``."""


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count histogram buckets)."""
    out: list[int] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_value:
                return out
            out.append(v)
        exp += 1


class _TokenHistogram(Collector):
    """A histogram observed once per generated token, kept without locks.

    ``prometheus_client.Histogram.observe`` takes a lock and walks every bucket;
    per token that was the emulator's largest single CPU cost under streaming load.
    The event loop is the only writer, so plain counters suffice; scrapes (same
    thread) export them as a standard histogram.
    """

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], labels: list[str]) -> None:
        self._name, self._doc, self._labels = name, doc, labels
        self._bounds = list(buckets)
        self._counts = [0] * (len(buckets) + 1)  # last: above every bound (+Inf only)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        """Count one observation (s)."""
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    def collect(self) -> Iterable[Metric]:
        cum, acc = [], 0
        for bound, c in zip(self._bounds, self._counts):
            acc += c
            cum.append((floatToGoString(bound), acc))
        acc += self._counts[-1]
        cum.append(("+Inf", acc))
        h = HistogramMetricFamily(self._name, self._doc, labels=["model_name", "engine"])
        h.add_metric(self._labels, cum, self._sum)
        yield h


class _EngineCollector(Collector):
    """Gauges and counters read from the engine at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], labels: list[str], block_size: int,
                 num_blocks: int, prefix_caching: bool, num_blocks_override: int | None = None) -> None:
        self._stats = stats
        self._labels = labels
        # vLLM's label values are str() of CacheConfig's fields (a subset of vLLM 0.32's labels:
        # the ones a router reads), and the engine index (``engine``) as on every vLLM series.
        self._cache_info = {"block_size": str(block_size), "cache_dtype": "auto",
                            "enable_prefix_caching": str(prefix_caching), "engine": labels[1],
                            "kv_cache_size_tokens": str(block_size * num_blocks),
                            "num_gpu_blocks": str(num_blocks), "num_gpu_blocks_override": str(num_blocks_override),
                            "prefix_caching_hash_algo": "sha256"}

    def collect(self) -> Iterable[Metric]:
        st = self._stats()
        names = ["model_name", "engine"]
        v = self._labels

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(v, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(v, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", st.running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", st.waiting)
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all "
            "reasons equals vllm:num_requests_waiting.", labels=names + ["reason"])
        # The simulator's waiting requests all wait for capacity (no LoRA budget, no KV transfer).
        by_reason.add_metric(v + ["capacity"], st.waiting)
        by_reason.add_metric(v + ["deferred"], 0)
        yield by_reason
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", st.kv_usage)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=list(self._cache_info))
        info.add_metric(list(self._cache_info.values()), 1.0)
        yield info
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", st.preemptions)
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.", st.prefix_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      st.prefix_hits)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", st.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", st.generation_tokens)
        ok = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                 labels=names + ["finished_reason"])
        for reason in ("stop", "length", "abort"):
            ok.add_metric(v + [reason], st.finished.get(reason, 0))
        yield ok


class _KVEventsCollector(Collector):
    """The emulator's own counters of its KV-event publisher (vLLM exports none)."""

    def __init__(self, publisher, labels: list[str]) -> None:
        self._pub = publisher
        self._labels = labels

    def collect(self) -> Iterable[Metric]:
        p = self._pub
        for name, doc, value in (
                ("phasewise_emulator_kv_event_batches", "KV-event batches published (one per engine step "
                 "that changed the prefix cache).", p.batches),
                ("phasewise_emulator_kv_events", "KV events published (BlockStored, BlockRemoved, "
                 "AllBlocksCleared).", p.events),
                ("phasewise_emulator_kv_event_errors", "KV-event batches lost to a publishing error.", p.errors)):
            c = CounterMetricFamily(name, doc, labels=["model_name", "engine"])
            c.add_metric(self._labels, value)
            yield c


class EmulatorMetrics:
    """vLLM-named metrics of one emulated engine; also the engine's :class:`EngineObserver`.

    Args:
        model_name: served model name (label ``model_name``).
        max_model_len: bounds the token-count histogram buckets (vLLM does the same).
        block_size, num_blocks, prefix_caching, num_blocks_override: reported in
            ``vllm:cache_config_info`` (``num_blocks_override``: ``--num-gpu-blocks-override``, None unset).
    """

    def __init__(self, model_name: str, max_model_len: int, block_size: int, num_blocks: int,
                 prefix_caching: bool = False, num_blocks_override: int | None = None) -> None:
        self.registry = CollectorRegistry()
        # vLLM serves the default registry, which carries these too (process_cpu_seconds_total etc.).
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self._labels = [model_name, "0"]
        self._block_size = block_size
        self._num_blocks = num_blocks
        self._prefix_caching = prefix_caching
        self._num_blocks_override = num_blocks_override
        names = ["model_name", "engine"]
        r = self.registry

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labelnames=names, buckets=buckets, registry=r).labels(*self._labels)

        self._ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                          TTFT_BUCKETS)
        self._itl = _TokenHistogram("vllm:inter_token_latency_seconds",
                                    "Histogram of inter-token latency in seconds.", ITL_BUCKETS, self._labels)
        r.register(self._itl)
        self._e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                         REQUEST_LATENCY_BUCKETS)
        tok = build_1_2_5_buckets(max_model_len)
        self._prompt = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tok)
        self._gen = hist("vllm:request_generation_tokens", "Number of generation tokens processed.", tok)
        self._itl_observe = self._itl.observe

    def attach(self, stats: Callable[[], EngineStats]) -> None:
        """Read gauges and counters from ``stats`` (the engine's) at scrape time."""
        self.registry.register(_EngineCollector(stats, self._labels, self._block_size, self._num_blocks,
                                                self._prefix_caching, self._num_blocks_override))

    def attach_kv_events(self, publisher) -> None:
        """Export ``publisher``'s counters (:class:`routerd.emulator.kv_events.ZmqEventPublisher`)."""
        self.registry.register(_KVEventsCollector(publisher, self._labels))

    # -- EngineObserver
    def first_token(self, s: TokenStream, t: float) -> None:
        """Observe TTFT (s) = ``t`` - arrival."""
        self._ttft.observe(t - s.arrival_s)

    def token(self, s: TokenStream, gap_s: float) -> None:
        """Observe one inter-token latency (s)."""
        self._itl_observe(gap_s)

    def finished(self, s: TokenStream, t: float) -> None:
        """Observe E2E latency (s) and the request's token counts."""
        self._e2e.observe(t - s.arrival_s)
        self._prompt.observe(s.prompt_tokens)
        self._gen.observe(s.generated)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
