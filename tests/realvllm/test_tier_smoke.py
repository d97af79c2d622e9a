"""The real-engine tier's own checks: the tiny model is deterministic and the pair serves it."""

from __future__ import annotations

import json
import urllib.request

from real_vllm.engine import MODEL_NAME


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def test_pair_serves_the_tiny_model_and_its_adapters(vllm_pair):
    for e in vllm_pair:
        ids = {m["id"]: m for m in _get(e.url + "/v1/models")["data"]}
        assert set(ids) == {MODEL_NAME, "a1", "a2"}
        assert ids[MODEL_NAME]["max_model_len"] == 2048
        assert ids["a1"]["parent"] == MODEL_NAME and ids["a2"]["parent"] == MODEL_NAME


def test_prompt_token_count_is_the_tokenizers(vllm_pair, tiny_model):
    # vLLM counts the tokenizer's ids plus the BOS its post-processor adds for completions.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model.model / "tokenizer.json"))
    prompt = "the quick brown fox jumps over the lazy dog"
    want = len(tok.encode(prompt).ids)
    assert tok.encode(prompt).ids[0] == tok.token_to_id("<s>")
    status, body = vllm_pair[0].post("/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == want
