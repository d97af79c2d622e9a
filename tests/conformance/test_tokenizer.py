"""``phasewise emulate --tokenizer DIR`` stands in for the tiny model token for token.

Given the model folder vLLM serves, the emulator tokenizes text prompts with its ``tokenizer.json``
(completions add the BOS, as vLLM) and renders chat messages with its chat template: the prompt
token ids both servers return (``return_token_ids``) must be equal. Needs the real engine (the
tiny model is made with the vLLM venv), so this module runs in the real-engine tier only.
"""

from __future__ import annotations

import pytest
from conformance.backends import MODEL, Backend

from routerd.emulator.process import EmulatorProcess

_TEXTS = ["the quick brown fox jumps over the lazy dog",
          "Prefix caching reuses the KV blocks of a shared prompt prefix; numbers 0123456789.",
          "  leading spaces, unicode: café 東京 ✓"]
_CHATS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name three colours."},
     {"role": "assistant", "content": "Red, green, blue."}, {"role": "user", "content": "Two more?"}],
]


@pytest.fixture(scope="module")
def pair_and_twin(vllm_pair, tiny_model):
    engine = vllm_pair[0]
    with EmulatorProcess("--port", "0", "--model", str(tiny_model.model), "--served-model-name", MODEL,
                         "--tokenizer", str(tiny_model.model), "--max-model-len", "2048") as emu:
        yield (Backend("vllm", engine.url, engine.kv_events_address, 128, 2048, str(tiny_model.model)),
               Backend("emulator", emu.url, "", 16, 2048, str(tiny_model.model)))


def _prompt_ids(backend: Backend, path: str, body: dict) -> list[int]:
    status, out = backend.post(path, {"model": MODEL, "max_tokens": 1, "return_token_ids": True, **body})
    assert status == 200, out
    ids = out["prompt_token_ids"] if "messages" in body else out["choices"][0]["prompt_token_ids"]
    assert len(ids) == out["usage"]["prompt_tokens"]
    return ids


@pytest.mark.parametrize("text", _TEXTS)
def test_text_prompts_tokenize_alike(pair_and_twin, text):
    vllm, emu = pair_and_twin
    assert _prompt_ids(emu, "/v1/completions", {"prompt": text}) == _prompt_ids(vllm, "/v1/completions",
                                                                               {"prompt": text})


@pytest.mark.parametrize("messages", _CHATS, ids=["one-turn", "four-turns"])
def test_chat_prompts_render_and_tokenize_alike(pair_and_twin, messages):
    vllm, emu = pair_and_twin
    want = _prompt_ids(vllm, "/v1/chat/completions", {"messages": messages})
    assert _prompt_ids(emu, "/v1/chat/completions", {"messages": messages}) == want
