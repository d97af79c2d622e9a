"""Bad requests: the status codes and error bodies vLLM 0.32 sends, which clients (and routerd) pass on.

Two shapes, as a real vLLM 0.32 answered them:

* vLLM's ``ErrorResponse`` ``{"error": {"message", "type", "param", "code"}}`` with ``code`` the
  HTTP status; ``type`` ``"BadRequestError"`` / ``"NotFoundError"`` for vLLM's own checks (their
  ``param`` the field's name), ``"Bad Request"`` for FastAPI's validation of the request's JSON
  (``param`` ``"body.<field>"``, ``vllm/entrypoints/serve/exception_handling/handlers/validation.py``);
* Starlette's ``{"detail": ...}`` for an unknown route (404) or a wrong method (405).
"""

from __future__ import annotations

import json

import pytest
from conformance.backends import MODEL, unique_ids

_CASES = [
    # (name, path, body, status, type, param)
    ("unknown-model", "/v1/completions", {"model": "no-such-model", "prompt": [5, 6], "max_tokens": 2},
     404, "NotFoundError", "model"),
    ("unknown-model-chat", "/v1/chat/completions",
     {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404, "NotFoundError", "model"),
    ("prompt-too-long", "/v1/completions", {"model": MODEL, "prompt": [7] * 2049, "max_tokens": 1},
     400, "BadRequestError", "input_tokens"),
    ("no-room-to-generate", "/v1/completions", {"model": MODEL, "prompt": [7] * 2048, "max_tokens": 1},
     400, "BadRequestError", "max_tokens"),
    ("malformed-json", "/v1/completions", b'{"model": ', 400, "Bad Request", "body.10"),
    ("empty-body", "/v1/completions", b"", 400, "Bad Request", "body"),
    ("not-an-object", "/v1/completions", [1, 2], 400, "Bad Request", "body"),
    ("max-tokens-string", "/v1/completions", {"model": MODEL, "prompt": [5], "max_tokens": "x"},
     400, "Bad Request", "body.max_tokens"),
    ("max-tokens-fraction", "/v1/completions", {"model": MODEL, "prompt": [5], "max_tokens": 2.5},
     400, "Bad Request", "body.max_tokens"),
    ("max-tokens-negative", "/v1/completions", {"model": MODEL, "prompt": [5], "max_tokens": -1},
     400, "BadRequestError", "max_tokens"),
    ("max-tokens-zero", "/v1/completions", {"model": MODEL, "prompt": [5], "max_tokens": 0},
     400, "BadRequestError", "max_tokens"),
    ("stream-not-bool", "/v1/completions", {"model": MODEL, "prompt": [5], "stream": "x"},
     400, "Bad Request", "body.stream"),
    ("model-not-string", "/v1/completions", {"model": 5, "prompt": [5]}, 400, "Bad Request", "body.model"),
    ("missing-prompt", "/v1/completions", {"model": MODEL, "max_tokens": 2}, 400, "BadRequestError", "prompt"),
    ("empty-prompt", "/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 2},
     400, "BadRequestError", "prompt"),
    ("missing-messages", "/v1/chat/completions", {"model": MODEL, "max_tokens": 2},
     400, "Bad Request", "body.messages"),
    ("messages-not-list", "/v1/chat/completions", {"model": MODEL, "messages": "hi"},
     400, "Bad Request", "body.messages"),
    ("empty-messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "BadRequestError", None),
    ("stream-options-without-stream", "/v1/completions",
     {"model": MODEL, "prompt": [5], "stream_options": {"include_usage": True}},
     400, "BadRequestError", "stream_options"),
    ("empty-cache-salt", "/v1/completions", {"model": MODEL, "prompt": [5], "cache_salt": ""},
     400, "BadRequestError", "cache_salt"),
    ("cache-salt-not-string", "/v1/completions", {"model": MODEL, "prompt": [5], "cache_salt": 5},
     400, "BadRequestError", "cache_salt"),
]


@pytest.mark.parametrize("name,path,body,status,type_,param", _CASES, ids=[c[0] for c in _CASES])
def test_bad_request_gets_vllms_error_body(backend, name, path, body, status, type_, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    code, out, _ = backend.request("POST", path, raw=raw)
    assert code == status, out
    assert isinstance(out, dict) and set(out) == {"error"}, out
    err = out["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["code"], err["type"], err["param"]) == (status, type_, param), err
    assert isinstance(err["message"], str) and err["message"]


def test_error_messages_name_what_is_wrong(backend):
    _, out, _ = backend.request("POST", "/v1/completions", {"model": "no-such-model", "prompt": [5]})
    assert out["error"]["message"] == f"The model `no-such-model` does not exist. Valid aliases: {MODEL}."
    _, out, _ = backend.request("POST", "/v1/completions", {"model": MODEL, "prompt": [7] * 2049, "max_tokens": 1})
    assert out["error"]["message"] == (
        "This model's maximum context length is 2048 tokens. However, your prompt contains at least 2049 input "
        "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
        "prompt. (parameter=input_tokens, value=2049)")
    _, out, _ = backend.request("POST", "/v1/completions", {"model": MODEL, "prompt": [7] * 2100, "max_tokens": 1})
    assert "your prompt contains 2100 input tokens" in out["error"]["message"]
    _, out, _ = backend.request("POST", "/v1/completions", {"model": MODEL, "prompt": [5], "max_tokens": -1})
    assert out["error"]["message"] == "max_tokens must be at least 1, got -1. (parameter=max_tokens, value=-1)"
    _, out, _ = backend.request("POST", "/v1/completions", {"model": MODEL, "prompt": [5], "max_tokens": "x"})
    assert out["error"]["message"] == (
        "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid "
        "integer, unable to parse string as an integer', 'input': 'x'}")


@pytest.mark.parametrize("method,path,status,detail", [
    ("POST", "/v1/no-such-route", 404, "Not Found"),
    ("GET", "/no-such-page", 404, "Not Found"),
    ("GET", "/v1/completions", 405, "Method Not Allowed"),
    ("POST", "/v1/models", 405, "Method Not Allowed"),
])
def test_routing_errors_get_starlettes_detail_body(backend, method, path, status, detail):
    code, out, headers = backend.request(method, path, raw=b"{}" if method == "POST" else None)
    assert (code, out) == (status, {"detail": detail})
    if status == 405:
        allowed = {h.lower(): v for h, v in headers.items()}["allow"]
        assert allowed == ("GET" if path == "/v1/models" else "POST")


def test_max_tokens_beyond_the_context_is_cut_to_it(backend):
    # vLLM's get_max_tokens: min(max_tokens, max_model_len - prompt tokens), not an error.
    p = 2000
    out = backend.complete(unique_ids(p), 100)
    assert out["usage"]["completion_tokens"] == 2048 - p and out["choices"][0]["finish_reason"] == "length"


def test_json_the_parser_cannot_take_gets_fastapis_detail_body(backend):
    # Nesting past Python's recursion limit, an integer past its 4300-digit limit.
    for raw in (b"[" * 100_000, b'{"model": "tiny", "prompt": [5], "max_tokens": ' + b"9" * 5000 + b"}"):
        code, out, _ = backend.request("POST", "/v1/completions", raw=raw)
        assert (code, out) == (400, {"detail": "There was an error parsing the body"})
