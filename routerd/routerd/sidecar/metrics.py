"""Read a vLLM instance's state from the text of its Prometheus ``/metrics`` page.

Metric names are those of vLLM V1 (``vllm/v1/metrics/loggers.py``; summary in
``../shared/docs/vllm-and-simulators.md`` §2), with the fallbacks older servers need:

- ``vllm:kv_cache_usage_perc``, else the deprecated ``vllm:gpu_cache_usage_perc``
  (renamed in vLLM 0.9);
- ``vllm:inter_token_latency_seconds``, else the deprecated
  ``vllm:time_per_output_token_seconds`` (deprecated in 0.11, hidden in 0.12);
- ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total`` (counters of
  prompt tokens looked up in and found in the prefix cache), else the deprecated
  ``vllm:gpu_prefix_cache_queries_total`` / ``..._hits_total`` (renamed in 0.9, hidden
  later). Servers older than vLLM V1's prefix-cache counters have neither pair: the
  prefix-cache values are then None ("not reported"), never 0. The KV-connector counters
  ``vllm:external_prefix_cache_*`` (LMCache and the like) are not read: they count
  another cache tier.

Values are parsed with prometheus_client's text parser. A vLLM page is mostly histogram
buckets and process metrics that the state does not need (about 170 of a typical 190
lines), so the lines read here are picked out first with one regular expression and only
they go through the parser: on such a page that cuts one parse from 8.8 ms to 0.8 ms
(measured on the 2-core dev VM), which matters at 10 scrapes per second. A malformed line among the lines
read fails the parse; one elsewhere on the page is not looked at.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["MetricsParseError", "PrefixCacheWindow", "VllmMetrics", "parse_vllm_metrics", "prefix_cache_window"]


class MetricsParseError(ValueError):
    """The metrics text is malformed or is not a vLLM ``/metrics`` page; the message says what failed."""


# Sample names (as exposed, counters with ``_total``, histograms as ``_sum``/``_count``).
_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV = "vllm:kv_cache_usage_perc"
_KV_OLD = "vllm:gpu_cache_usage_perc"
_PREEMPTIONS = "vllm:num_preemptions_total"
_PROMPT_TOKENS = "vllm:prompt_tokens_total"
_GENERATION_TOKENS = "vllm:generation_tokens_total"
_SUCCESS = "vllm:request_success_total"
_TTFT = "vllm:time_to_first_token_seconds"
_ITL = "vllm:inter_token_latency_seconds"
_TPOT_OLD = "vllm:time_per_output_token_seconds"
_E2E = "vllm:e2e_request_latency_seconds"
_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
_PREFIX_HITS = "vllm:prefix_cache_hits_total"
_PREFIX_QUERIES_OLD = "vllm:gpu_prefix_cache_queries_total"
_PREFIX_HITS_OLD = "vllm:gpu_prefix_cache_hits_total"

_SIMPLE = (_RUNNING, _WAITING, _KV, _KV_OLD, _PREEMPTIONS, _PROMPT_TOKENS, _GENERATION_TOKENS, _SUCCESS,
           _PREFIX_QUERIES, _PREFIX_HITS, _PREFIX_QUERIES_OLD, _PREFIX_HITS_OLD)
_HISTOGRAMS = (_TTFT, _ITL, _TPOT_OLD, _E2E)
_WANTED = frozenset(_SIMPLE) | {h + s for h in _HISTOGRAMS for s in ("_sum", "_count")}

# A sample line of one of the wanted names: the name must end at '{' or a blank, so that
# e.g. ``vllm:prompt_tokens_total_x`` is not taken for ``vllm:prompt_tokens_total``.
_LINE = re.compile(
    r"^[ \t]*vllm:(?:"
    + "|".join(re.escape(n.removeprefix("vllm:")) for n in sorted(_WANTED, key=len, reverse=True))
    + r")[{ \t].*$",
    re.MULTILINE,
)


@dataclass(frozen=True, slots=True)
class VllmMetrics:
    """The instance state read from one ``/metrics`` page; each value is summed over label sets.

    vLLM labels every series with ``model_name`` and ``engine`` (the data-parallel rank), so
    one page can carry several engines: request counts and counters add up across them,
    the KV cache usage is their mean (each engine has its own cache of the same size, so
    the mean is the used fraction of the instance's total), and latency means pool every
    engine's ``_sum`` and ``_count``.
    """

    num_requests_running: float = 0.0
    """``vllm:num_requests_running``: requests in the running batch."""
    num_requests_waiting: float = 0.0
    """``vllm:num_requests_waiting``: requests queued in the engine."""
    kv_cache_usage: float = 0.0
    """``vllm:kv_cache_usage_perc`` (or ``vllm:gpu_cache_usage_perc``): used fraction 0..1 despite the name."""
    num_preemptions_total: float = 0.0
    """``vllm:num_preemptions_total``: preemptions since start (0 when the server does not export it)."""
    prompt_tokens_total: float = 0.0
    """``vllm:prompt_tokens_total``: prefill tokens processed since start."""
    generation_tokens_total: float = 0.0
    """``vllm:generation_tokens_total``: tokens generated since start."""
    request_success_total: float = 0.0
    """``vllm:request_success_total`` over every ``finished_reason``: requests finished since start."""
    mean_ttft_s: float = 0.0
    """Mean time to first token since start, ``_sum / _count`` of ``vllm:time_to_first_token_seconds`` (s)."""
    mean_tpot_s: float = 0.0
    """Mean time per output token since start, from ``vllm:inter_token_latency_seconds``
    (or ``vllm:time_per_output_token_seconds``) (s)."""
    mean_e2e_s: float = 0.0
    """Mean end-to-end request latency since start, from ``vllm:e2e_request_latency_seconds`` (s)."""
    models: tuple[str, ...] = field(default=())
    """Served model names (``model_name`` label), sorted."""
    prefix_cache_queries_total: float | None = None
    """``vllm:prefix_cache_queries_total`` (or ``vllm:gpu_prefix_cache_queries_total``): prompt tokens
    looked up in the prefix cache since start (tokens); None when the page lacks the pair."""
    prefix_cache_hits_total: float | None = None
    """``vllm:prefix_cache_hits_total`` (or ``vllm:gpu_prefix_cache_hits_total``): prompt tokens found
    in the prefix cache since start (tokens); None exactly when ``prefix_cache_queries_total`` is."""

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Cumulative hit rate since start, hits / queries (0..1; vLLM's own definition,
        ``PrefixCachingMetrics.hit_rate``); None when not reported or no token was queried yet."""
        return _rate(self.prefix_cache_hits_total, self.prefix_cache_queries_total)

    def as_fields(self, window: "PrefixCacheWindow | None" = None) -> dict:
        """The values as keyword arguments of ``phasewise.v1.InstanceState``.

        The prefix-cache fields (proto3 ``optional``) are left out, so unset, when not
        reported; ``window`` (from :func:`prefix_cache_window`) adds the windowed ones.
        """
        out = {
            "num_requests_running": self.num_requests_running,
            "num_requests_waiting": self.num_requests_waiting,
            "kv_cache_usage": self.kv_cache_usage,
            "num_preemptions_total": self.num_preemptions_total,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "request_success_total": self.request_success_total,
            "mean_ttft_s": self.mean_ttft_s,
            "mean_tpot_s": self.mean_tpot_s,
            "mean_e2e_s": self.mean_e2e_s,
            "models": list(self.models),
        }
        if self.prefix_cache_queries_total is not None and self.prefix_cache_hits_total is not None:
            out["prefix_cache_queries_total"] = self.prefix_cache_queries_total
            out["prefix_cache_hits_total"] = self.prefix_cache_hits_total
            rate = self.prefix_cache_hit_rate
            if rate is not None:
                out["prefix_cache_hit_rate"] = rate
        if window is not None:
            out["prefix_cache_window_queries"] = window.queries
            out["prefix_cache_window_hits"] = window.hits
            out["prefix_cache_window_s"] = window.seconds
            if window.hit_rate is not None:
                out["prefix_cache_window_hit_rate"] = window.hit_rate
        return out


@dataclass(frozen=True, slots=True)
class PrefixCacheWindow:
    """Prefix-cache counts between two successful scrapes of one instance (tokens), ``seconds`` apart."""

    queries: float
    """Prompt tokens looked up in the window."""
    hits: float
    """Prompt tokens found in the window."""
    seconds: float
    """Length of the window (s, the sidecar's monotonic clock)."""

    @property
    def hit_rate(self) -> float | None:
        """hits / queries (0..1); None when no token was queried in the window."""
        return _rate(self.hits, self.queries)


def prefix_cache_window(previous: VllmMetrics | None, current: VllmMetrics, seconds: float) -> PrefixCacheWindow | None:
    """The prefix-cache counts between scrape ``previous`` and scrape ``current``, ``seconds`` apart.

    None when either scrape lacks the counters (the first scrape, or a server without
    them). A counter that went down means the engine restarted and counts again from 0,
    so the window is the current totals (Prometheus ``increase()`` treats a reset the
    same way); both counters are taken as reset together, as they are in vLLM.
    """
    if current.prefix_cache_queries_total is None or current.prefix_cache_hits_total is None:
        return None
    if previous is None or previous.prefix_cache_queries_total is None or previous.prefix_cache_hits_total is None:
        return None
    dq = current.prefix_cache_queries_total - previous.prefix_cache_queries_total
    dh = current.prefix_cache_hits_total - previous.prefix_cache_hits_total
    if dq < 0 or dh < 0:
        dq, dh = current.prefix_cache_queries_total, current.prefix_cache_hits_total
    return PrefixCacheWindow(queries=dq, hits=dh, seconds=max(0.0, seconds))


def _rate(hits: float | None, queries: float | None) -> float | None:
    """hits / queries clamped to 0..1 (a page with hits > queries is inconsistent, not a rate above 1);
    None when either is missing or queries is 0."""
    if hits is None or queries is None or queries <= 0:
        return None
    return min(1.0, hits / queries)


def parse_vllm_metrics(text: str) -> VllmMetrics:
    """Parse a vLLM Prometheus ``/metrics`` page (text exposition format 0.0.4).

    Raises :class:`MetricsParseError` when a line read here is malformed (the message gives
    its line number), when a value read is not finite or is negative, or when the page lacks
    ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` or a KV cache usage gauge
    (then it is not a vLLM page, and reporting zeros would make the instance look idle).
    """
    matches = list(_LINE.finditer(text))
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    models: set[str] = set()
    try:
        families = list(text_string_to_metric_families("\n".join(m.group(0) for m in matches) + "\n"))
    except Exception as e:  # the parser raises ValueError, IndexError, ... on bad lines
        raise _locate_error(text, matches, e) from None
    for family in families:
        for sample in family.samples:
            if sample.name not in _WANTED:
                continue  # e.g. a counter's *_created series the parser split off
            value = sample.value
            if not math.isfinite(value):
                raise MetricsParseError(f"{sample.name}{_labels(sample.labels)}: value {value} is not finite")
            if value < 0:  # counts, totals, usage and latency sums are never negative
                raise MetricsParseError(f"{sample.name}{_labels(sample.labels)}: value {value} is negative")
            sums[sample.name] = sums.get(sample.name, 0.0) + value
            counts[sample.name] = counts.get(sample.name, 0) + 1
            model = sample.labels.get("model_name")
            if model:
                models.add(model)

    missing = [n for n in (_RUNNING, _WAITING) if n not in counts]
    if _KV not in counts and _KV_OLD not in counts:
        missing.append(_KV)
    if missing:
        raise MetricsParseError(f"no {', '.join(missing)} sample: not a vLLM /metrics page?")
    kv = _KV if _KV in counts else _KV_OLD
    itl = _ITL if _ITL + "_count" in counts else _TPOT_OLD
    # Both counters of one naming or nothing: a rate from a current-name numerator and a
    # deprecated-name denominator would mix two series.
    prefix_queries = prefix_hits = None
    for q, h in ((_PREFIX_QUERIES, _PREFIX_HITS), (_PREFIX_QUERIES_OLD, _PREFIX_HITS_OLD)):
        if q in counts and h in counts:
            prefix_queries, prefix_hits = sums[q], sums[h]
            break

    def mean(hist: str) -> float:
        n = sums.get(hist + "_count", 0.0)
        return sums.get(hist + "_sum", 0.0) / n if n > 0 else 0.0

    return VllmMetrics(
        num_requests_running=sums[_RUNNING],
        num_requests_waiting=sums[_WAITING],
        kv_cache_usage=sums[kv] / counts[kv],
        num_preemptions_total=sums.get(_PREEMPTIONS, 0.0),
        prompt_tokens_total=sums.get(_PROMPT_TOKENS, 0.0),
        generation_tokens_total=sums.get(_GENERATION_TOKENS, 0.0),
        request_success_total=sums.get(_SUCCESS, 0.0),
        mean_ttft_s=mean(_TTFT),
        mean_tpot_s=mean(itl),
        mean_e2e_s=mean(_E2E),
        models=tuple(sorted(models)),
        prefix_cache_queries_total=prefix_queries,
        prefix_cache_hits_total=prefix_hits,
    )


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""


def _locate_error(text: str, matches: list[re.Match], error: Exception) -> MetricsParseError:
    """Find which line made the parser fail (parsed alone); only runs on the error path."""
    for m in matches:
        try:
            list(text_string_to_metric_families(m.group(0) + "\n"))
        except Exception as e:
            lineno = text.count("\n", 0, m.start()) + 1
            line = m.group(0).strip()
            shown = line if len(line) <= 120 else line[:117] + "..."
            return MetricsParseError(f"line {lineno}: malformed sample {shown!r}: {e or type(e).__name__}")
    return MetricsParseError(f"malformed metrics text: {error or type(error).__name__}")
