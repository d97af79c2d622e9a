"""``phasewise emulate``'s vLLM-style flags: block size, cache size, context, LoRA adapters, prompt-token
details and ``--tokenizer``, on a real emulator process (the conformance suite in
``tests/conformance`` runs the behaviour both servers share against real vLLM too).

Expected values by hand: a token-id prompt of ``p`` ids is ``p`` prompt tokens, and a repeat finds
``(p - 1) // block_size * block_size`` of them cached (vLLM V1: whole blocks, the last prompt
token always computed).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from routerd.emulator.cli import parse_lora_modules
from routerd.emulator.openai_api import LoraModule
from routerd.emulator.process import EmulatorProcess
from routerd.errors import ConfigError


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())


def _cache_info(url: str) -> dict[str, str]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    (s,) = [s for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "vllm:cache_config_info"]
    return s.labels


def test_block_size_cache_and_context_overrides_reach_cache_metrics_and_limits():
    # The shipped A100 profile has block_size 16 and max_model_len 4096.
    with EmulatorProcess("--port", "0", "--profile", "llama2-7b-a100", "--block-size", "64",
                         "--num-gpu-blocks-override", "40", "--max-model-len", "1024",
                         "--enable-prompt-tokens-details") as emu:
        info = _cache_info(emu.url)
        assert (info["block_size"], info["num_gpu_blocks"], info["num_gpu_blocks_override"]) == ("64", "40", "40")
        assert info["kv_cache_size_tokens"] == str(64 * 40)
        ids = list(range(10, 10 + 200))
        url = emu.url + "/v1/completions"
        for want in (0, 192):  # (200 - 1) // 64 * 64
            status, out = _post(url, {"prompt": ids, "max_tokens": 1})
            assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] == want
        status, out = _post(url, {"prompt": [5] * 1025, "max_tokens": 1})
        assert status == 400 and out["error"]["param"] == "input_tokens"
        with urllib.request.urlopen(emu.url + "/v1/models", timeout=10) as r:
            assert json.loads(r.read())["data"][0]["max_model_len"] == 1024


def test_without_prompt_tokens_details_they_are_null_or_left_out():
    with EmulatorProcess("--port", "0", "--served-model-name", "m", "--model", "/models/m") as emu:
        status, out = _post(emu.url + "/v1/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2})
        assert status == 200 and out["usage"]["prompt_tokens_details"] is None and out["model"] == "m"
        req = urllib.request.Request(emu.url + "/v1/completions", method="POST", data=json.dumps({
            "model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}).encode())
        with urllib.request.urlopen(req, timeout=30) as r:
            frames = r.read().decode().split("\n\n")
        usage = json.loads(frames[-3].removeprefix("data: "))["usage"]
        assert usage == {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}
        with urllib.request.urlopen(emu.url + "/v1/models", timeout=10) as r:
            (card,) = json.loads(r.read())["data"]
        assert (card["id"], card["root"], card["parent"]) == ("m", "/models/m", None)


def test_lora_modules_parse_both_of_vllms_forms():
    got = parse_lora_modules(["a1=/x/a1", '{"name": "a2", "path": "/x/a2", "base_model_name": "base"}'])
    assert got == (LoraModule("a1", "/x/a1"), LoraModule("a2", "/x/a2", "base"))
    for bad in ("a1", "=/x", "a1=", '{"name": "a"}', "{nope"):
        with pytest.raises(ConfigError, match="--lora-modules"):
            parse_lora_modules([bad])


@pytest.mark.parametrize("flags,needle", [
    (["--block-size", "0"], "--block-size"),
    (["--num-gpu-blocks-override", "4"], "--num-gpu-blocks-override"),  # 64 tokens < max_model_len
    (["--max-model-len", "1000000"], "--max-model-len"),  # past the profile's KV cache
    (["--lora-modules", "a1"], "--lora-modules"),
    (["--lora-modules", "a1=/x", "a1=/y"], "--lora-modules"),
    (["--tokenizer", "/no/such/folder"], "--tokenizer"),
])
def test_bad_vllm_style_flags_exit_2_with_one_line(flags, needle, capsys):
    from routerd.emulator.__main__ import main

    assert main(["--host", "127.0.0.1", "--port", "0", *flags]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("phasewise: error: ") and needle in lines[0], err
    assert out == ""


def _tokenizer_folder(tmp_path):
    """A word-level tokenizer with a BOS post-processor and a chat template: ids by hand."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, processors

    vocab = {"[UNK]": 0, "<s>": 1, "hello": 2, "world": 3, "user": 4, ":": 5, "assistant": 6, "|": 7}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<s>"])  # recognised in a rendered template's text, as a model's BOS
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} | {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}")
    return tmp_path


def test_tokenizer_counts_text_and_renders_chat_like_vllm(tmp_path):
    folder = _tokenizer_folder(tmp_path)
    with EmulatorProcess("--port", "0", "--tokenizer", str(folder), "--model", "m") as emu:
        status, out = _post(emu.url + "/v1/completions", {"prompt": "hello world hello", "max_tokens": 1,
                                                          "return_token_ids": True})
        # Completions add the BOS (the tokenizer's post-processor), as vLLM's add_special_tokens=True.
        assert status == 200 and out["choices"][0]["prompt_token_ids"] == [1, 2, 3, 2]
        status, out = _post(emu.url + "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 1, "return_token_ids": True})
        # "<s>user : hello world | assistant :" rendered, then tokenized without adding specials.
        assert status == 200 and out["prompt_token_ids"] == [1, 4, 5, 2, 3, 7, 6, 5]
        assert out["usage"]["prompt_tokens"] == 8


def test_the_new_flags_read_their_environment_variables():
    import argparse

    from routerd.emulator.cli import add_parser, settings_from_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    env = {"PHASEWISE_EMULATOR_LORA_MODULES": "a1=/x/a1 a2=/x/a2", "PHASEWISE_EMULATOR_BLOCK_SIZE": "32",
           "PHASEWISE_EMULATOR_ENABLE_PROMPT_TOKENS_DETAILS": "true",
           "PHASEWISE_EMULATOR_SERVED_MODEL_NAME": "tiny", "PHASEWISE_EMULATOR_MAX_MODEL_LEN": "2048"}
    s = settings_from_args(parser.parse_args(["emulate"]), environ=env)
    assert s.lora_modules == (LoraModule("a1", "/x/a1"), LoraModule("a2", "/x/a2"))
    assert (s.block_size, s.enable_prompt_tokens_details, s.served_name, s.max_model_len) == (32, True, "tiny", 2048)
    # Flags win over variables.
    s = settings_from_args(parser.parse_args(["emulate", "--block-size", "64", "--lora-modules", "b=/y"]), environ=env)
    assert s.block_size == 64 and s.lora_modules == (LoraModule("b", "/y"),)
