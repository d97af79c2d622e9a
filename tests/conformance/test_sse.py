"""Streaming: the server-sent-event framing of completions and chat, read raw and with the ``openai`` client.

Per vLLM 0.32 (``vllm/entrypoints/openai/completion/serving.py``, ``chat_completion/serving.py``):
events ``data: {json}\\n\\n``, ``data: [DONE]\\n\\n`` last; one event may carry several tokens
(never count tokens by events: ``usage`` or ``token_ids`` count them); ``finish_reason`` on the
event with the last token; with ``stream_options.include_usage`` a chunk with empty ``choices``
and the ``usage`` comes before ``[DONE]``; chat first sends ``delta.role`` in a chunk of its
own; ``return_token_ids`` adds ``token_ids`` per chunk and ``prompt_token_ids`` in the first.
Expected counts by hand: a token-id prompt of ``p`` ids is ``p`` prompt tokens; ``ignore_eos``
makes every output exactly ``max_tokens`` long.
"""

from __future__ import annotations

import json
import urllib.request
import uuid

import openai
import pytest
from conformance.backends import MODEL, unique_ids


def _stream_raw(backend, path: str, body: dict) -> tuple[str, list]:
    """``(content type, events)``: every ``data:`` payload, parsed (``"[DONE]"`` kept as is)."""
    req = urllib.request.Request(backend.url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        ctype = r.headers["Content-Type"]
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    frames = raw.split("\n\n")
    assert frames[-1] == ""
    events = []
    for f in frames[:-1]:
        assert f.startswith("data: ") and "\n" not in f, f
        payload = f[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    return ctype, events[:-1]


@pytest.mark.parametrize("usage", [True, False], ids=["usage", "no-usage"])
def test_completion_stream_framing(backend, usage):
    p, n = 40, 24
    ids = unique_ids(p)
    body = {"model": MODEL, "prompt": ids, "max_tokens": n, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    ctype, events = _stream_raw(backend, "/v1/completions", body)
    assert ctype.startswith("text/event-stream")
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("cmpl-")
    assert all(e["object"] == "text_completion" and e["model"] == MODEL for e in events)
    if usage:
        *chunks, last = events
        assert last["choices"] == [] and last["usage"]["prompt_tokens"] == p
        assert last["usage"]["completion_tokens"] == n and last["usage"]["total_tokens"] == p + n
    else:
        chunks = events
        assert all("usage" not in e or e["usage"] is None for e in events)
    assert 1 <= len(chunks) <= n  # several tokens per event allowed, never fewer than one
    choices = [c for e in chunks for c in e["choices"]]
    assert len(choices) == len(chunks) and all(c["index"] == 0 for c in choices)
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
    token_ids = [t for c in choices for t in c["token_ids"]]
    assert len(token_ids) == n and all(isinstance(t, int) and t >= 0 for t in token_ids)
    assert choices[0]["prompt_token_ids"] == ids
    assert all(c.get("prompt_token_ids") is None for c in choices[1:])


def test_chat_stream_framing(backend):
    n = 16
    messages = [{"role": "user", "content": f"conformance chat {uuid.uuid4().hex}"}]
    ctype, events = _stream_raw(backend, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": n, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True}, "return_token_ids": True})
    assert ctype.startswith("text/event-stream")
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("chatcmpl-")
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    first, *chunks, last = events
    (c0,) = first["choices"]
    assert c0["delta"] == {"role": "assistant", "content": ""} and c0["finish_reason"] is None
    usage = last["usage"]
    assert last["choices"] == [] and usage["completion_tokens"] == n
    assert usage["total_tokens"] == usage["prompt_tokens"] + n
    # The rendered prompt's ids come in the first chunk, one per prompt token.
    assert len(first["prompt_token_ids"]) == usage["prompt_tokens"]
    choices = [c for e in chunks for c in e["choices"]]
    assert 1 <= len(choices) <= n
    assert all("role" not in c["delta"] for c in choices)
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
    assert sum(len(c["token_ids"]) for c in choices) == n


def test_streams_through_the_openai_client(backend):
    n = 12
    with openai.OpenAI(base_url=backend.url + "/v1", api_key="unused", max_retries=0) as client:
        stream = client.completions.create(model=MODEL, prompt=unique_ids(30), max_tokens=n, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = list(stream)
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"hello {uuid.uuid4().hex}"}], max_tokens=n,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chat_chunks = list(chat)
    assert chunks[-1].usage.completion_tokens == n and chunks[-1].usage.prompt_tokens == 30
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert chat_chunks[-1].usage.completion_tokens == n
    assert [c.choices[0].finish_reason for c in chat_chunks[:-1]][-1] == "length"


def test_non_streaming_return_token_ids(backend):
    p, n = 20, 7
    ids = unique_ids(p)
    out = backend.complete(ids, n, return_token_ids=True)
    (c,) = out["choices"]
    assert c["prompt_token_ids"] == ids and len(c["token_ids"]) == n and c["finish_reason"] == "length"
    assert out["usage"]["prompt_tokens"] == p and out["usage"]["completion_tokens"] == n
    plain = backend.complete(unique_ids(p), n)
    assert plain["choices"][0]["token_ids"] is None and plain["choices"][0]["prompt_token_ids"] is None
    status, chat = backend.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": f"ids {uuid.uuid4().hex}"}], "max_tokens": n,
        "ignore_eos": True, "return_token_ids": True})
    assert status == 200, chat
    assert len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    assert len(chat["choices"][0]["token_ids"]) == n and chat["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_running_usage_in_every_chunk(backend, path):
    # vLLM sends it when both include_usage and continuous_usage_stats are set; the profiler asks
    # for it (routerd/routerd/profiler/client.py) to count tokens per chunk.
    n = 10
    body = {"model": MODEL, "max_tokens": n, "stream": True, "ignore_eos": True, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": f"usage {uuid.uuid4().hex}"}]
    else:
        body["prompt"] = unique_ids(25)
    _, events = _stream_raw(backend, path, body)
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == n
    p = last["usage"]["prompt_tokens"]
    seen = 0
    for e in chunks:
        u = e["usage"]
        got = sum(len(c.get("token_ids") or []) for c in e["choices"])
        assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (p, seen + got, p + seen + got)
        seen += got
    assert seen == n
