"""``/v1/models`` and ``/metrics``: the fields and series routerd, its sidecar and its profiler read.

Expected values by hand from the backend's configuration (served name ``tiny``, adapters ``a1``,
``a2``, ``max_model_len`` 2048, block size 128) and from the requests the tests send (token-id
prompts: ``prompt_tokens`` is their length; ``ignore_eos``: ``completion_tokens`` is
``max_tokens``).
"""

from __future__ import annotations

from conformance.backends import ADAPTERS, MODEL, unique_ids
from prometheus_client.parser import text_string_to_metric_families
from stack_processes import wait_until

from routerd.sidecar.metrics import parse_vllm_metrics

_PERMISSION = {"id", "object", "created", "allow_create_engine", "allow_sampling", "allow_logprobs",
               "allow_search_indices", "allow_view", "allow_fine_tuning", "organization", "group", "is_blocking"}


def test_models_lists_the_model_and_its_adapters(backend):
    status, body, _ = backend.request("GET", "/v1/models")
    assert status == 200 and body["object"] == "list"
    cards = {m["id"]: m for m in body["data"]}
    assert list(cards) == [MODEL, *ADAPTERS]
    for m in cards.values():
        assert set(m) == {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"}
        assert m["object"] == "model" and m["owned_by"] == "vllm" and isinstance(m["created"], int)
        (perm,) = m["permission"]
        assert set(perm) == _PERMISSION and perm["object"] == "model_permission" and perm["id"].startswith("modelperm-")
    base = cards[MODEL]
    assert (base["root"], base["parent"], base["max_model_len"]) == (backend.root, None, 2048)
    for a in ADAPTERS:
        assert (cards[a]["root"], cards[a]["parent"], cards[a]["max_model_len"]) == (backend.adapters[a], MODEL, None)


def _samples(text: str) -> list:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


#: Series routerd's sidecar reads (routerd/routerd/sidecar/metrics.py), as sample names.
_READ = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
         "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
         "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
         "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
         "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count",
         "vllm:e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_count")


def test_metrics_names_and_labels_are_vllms(backend):
    samples = _samples(backend.metrics_text())
    by_name: dict[str, list] = {}
    for s in samples:
        by_name.setdefault(s.name, []).append(s)
    for name in _READ:
        assert name in by_name, name
        for s in by_name[name]:
            assert s.labels == {"engine": "0", "model_name": MODEL}, (name, s.labels)
    reasons = {s.labels["finished_reason"] for s in by_name["vllm:request_success_total"]}
    assert {"stop", "length", "abort"} <= reasons
    assert all(set(s.labels) == {"engine", "model_name", "finished_reason"}
               for s in by_name["vllm:request_success_total"])
    waiting = {s.labels["reason"]: s.value for s in by_name["vllm:num_requests_waiting_by_reason"]}
    assert set(waiting) == {"capacity", "deferred"}
    (info,) = by_name["vllm:cache_config_info"]
    assert info.value == 1.0
    assert {"block_size", "num_gpu_blocks", "enable_prefix_caching", "engine", "cache_dtype"} <= set(info.labels)
    assert info.labels["block_size"] == str(backend.block_size) and info.labels["engine"] == "0"
    assert info.labels["enable_prefix_caching"] == "True" and int(info.labels["num_gpu_blocks"]) > 0
    # routerd's own reader takes the page as it is.
    m = parse_vllm_metrics(backend.metrics_text())
    assert m.models == (MODEL,)
    assert m.prefix_cache_queries_total is not None and m.prefix_cache_hits_total is not None


def _counters(backend) -> dict[str, float]:
    want = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_count",
            "vllm:e2e_request_latency_seconds_count")
    out = {n: 0.0 for n in want}
    for s in _samples(backend.metrics_text()):
        if s.name in out:
            out[s.name] += s.value
        elif s.name == "vllm:request_success_total" and s.labels["finished_reason"] == "length":
            out["length"] = s.value
    return out


def test_counters_move_by_the_requests_tokens(backend):
    p, n = 300, 5
    ids = unique_ids(p)
    before = _counters(backend)
    want = {"vllm:prompt_tokens_total": p, "vllm:generation_tokens_total": n, "vllm:prefix_cache_queries_total": p,
            "vllm:prefix_cache_hits_total": 0, "vllm:time_to_first_token_seconds_count": 1,
            "vllm:e2e_request_latency_seconds_count": 1, "length": 1}

    def delta(c):
        return {k: c[k] - before[k] for k in want}

    out = backend.complete(ids, n)
    assert out["usage"]["completion_tokens"] == n
    wait_until(lambda: delta(_counters(backend)), lambda d: d == want, 20, "counters after one request")
    # The same prompt again: its whole blocks but the last token's are hits.
    hit = (p - 1) // backend.block_size * backend.block_size
    backend.complete(ids, n)
    want2 = {k: 2 * v for k, v in want.items()}
    want2["vllm:prefix_cache_hits_total"] = hit
    wait_until(lambda: delta(_counters(backend)), lambda d: d == want2, 20, "counters after a repeat")
