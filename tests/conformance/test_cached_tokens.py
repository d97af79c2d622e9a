"""``usage.prompt_tokens_details.cached_tokens``: the prompt tokens served from the prefix cache.

Expected values by hand from vLLM V1's prefix cache (``vllm/v1/core/kv_cache_manager.py``,
``get_computed_blocks``): only full blocks are cached, and a request reuses at most
``prompt_tokens - 1`` tokens (its last prompt token is always computed), so a repeat of a
``p``-token prompt finds ``(p - 1) // block_size * block_size`` tokens. Block hashes carry the
LoRA adapter and the request's ``cache_salt`` (``generate_block_hash_extra_keys`` in
``vllm/v1/core/kv_cache_utils.py``): a salted or adapter request shares nothing with the base
model's unsalted blocks. Chat's ``created_cache_tokens`` is the full prompt blocks the request
cached anew (``PrefillStats.finalize``, ``vllm/v1/metrics/stats.py``).
"""

from __future__ import annotations

import uuid

from conformance.backends import MODEL, unique_ids


def _cached(out: dict) -> int:
    details = out["usage"]["prompt_tokens_details"]
    assert set(details) >= {"cached_tokens"}, details
    return details["cached_tokens"]


def _hit(p: int, bs: int) -> int:
    return (p - 1) // bs * bs


def test_repeat_finds_whole_blocks_but_the_last_token(backend):
    bs = backend.block_size
    for p in (3 * bs + 44, 2 * bs, 2 * bs + 1, bs - 1):
        ids = unique_ids(p)
        first = backend.complete(ids)
        assert _cached(first) == 0 and first["usage"]["prompt_tokens"] == p
        again = backend.complete(ids)
        assert _cached(again) == _hit(p, bs), p
        assert _cached(again) % bs == 0 and _cached(again) <= p - 1


def test_a_shared_prefix_hits_up_to_where_it_ends(backend):
    bs = backend.block_size
    head = unique_ids(bs + bs // 2)
    backend.complete(head + unique_ids(bs))
    other = backend.complete(head + unique_ids(2 * bs))
    assert _cached(other) == bs  # the one whole block inside the shared head


def test_cache_salt_isolates(backend):
    bs = backend.block_size
    ids = unique_ids(2 * bs + 10)
    salt = f"salt-{uuid.uuid4().hex}"
    backend.complete(ids)
    assert _cached(backend.complete(ids, cache_salt=salt)) == 0
    assert _cached(backend.complete(ids, cache_salt=salt)) == _hit(len(ids), bs)
    assert _cached(backend.complete(ids, cache_salt=f"other-{salt}")) == 0
    assert _cached(backend.complete(ids)) == _hit(len(ids), bs)


def test_an_adapter_does_not_hit_the_base_models_blocks(backend):
    bs = backend.block_size
    ids = unique_ids(2 * bs + 10)
    backend.complete(ids)
    out = backend.complete(ids, model="a1")
    assert out["model"] == "a1" and _cached(out) == 0
    assert _cached(backend.complete(ids, model="a1")) == _hit(len(ids), bs)
    assert _cached(backend.complete(ids, model="a2")) == 0


def test_chat_reports_cached_and_created_tokens(backend):
    bs = backend.block_size
    text = " ".join(uuid.uuid4().hex for _ in range(20))  # a few hundred tokens with either tokenizer
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2, "ignore_eos": True}
    outs = []
    for _ in range(2):
        status, out = backend.post("/v1/chat/completions", body)
        assert status == 200, out
        outs.append(out)
    p = outs[0]["usage"]["prompt_tokens"]
    assert p >= bs and outs[1]["usage"]["prompt_tokens"] == p
    first, again = (o["usage"]["prompt_tokens_details"] for o in outs)
    assert (first["cached_tokens"], first["created_cache_tokens"]) == (0, p // bs * bs)
    assert again["cached_tokens"] == _hit(p, bs)
    assert again["created_cache_tokens"] == p // bs * bs - _hit(p, bs)


def test_streamed_usage_carries_cached_tokens(backend):
    import json
    import urllib.request

    bs = backend.block_size
    ids = unique_ids(bs + 20)
    backend.complete(ids)
    req = urllib.request.Request(backend.url + "/v1/completions", method="POST", data=json.dumps({
        "model": MODEL, "prompt": ids, "max_tokens": 3, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True}}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        frames = r.read().decode().split("\n\n")
    usage = json.loads(frames[-3].removeprefix("data: "))["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": bs}
