"""``phasewise profile --derive``: hand-computed memory and latency terms, CLI errors, shipped files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from routerd.cli import main
from routerd.profiler.derive import (DEFAULT_EFFICIENCY, DeriveError, DeriveOptions, derive_command, derive_profile,
                                     gpu_names, load_gpu, load_model_config, model_names, profile_yaml,
                                     vllm_batch_defaults)
from routerd.profiles import get_profile, load_profile_file

REPO = Path(__file__).resolve().parents[1]
PROFILES = REPO / "routerd" / "routerd" / "data" / "profiles"
GIB = 1024**3


@pytest.fixture
def llama31():
    return load_model_config("llama-3.1-8b-instruct")


def test_llama31_parameter_count_and_kv_bytes_by_hand(llama31):
    h, i, v, L = 4096, 14336, 128256, 32
    q, kv = 32 * 128, 8 * 128
    layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h  # Q, K, V, O, gate/up/down, 2 RMSNorms
    assert layer == 218_112_000
    total = 2 * v * h + L * layer + h  # embedding + untied LM head + layers + final norm
    assert llama31.param_count == total == 8_030_261_248  # "8.03B" on the model card
    # K and V, 32 layers, 8 KV heads of 128, bf16: 2*32*8*128*2 = 131,072 bytes = 128 KiB per token
    assert llama31.kv_bytes_per_token == 128 * 1024


def test_llama2_7b_parameter_count(llama31):
    m = load_model_config("llama-2-7b")
    assert m.param_count == 6_738_415_616  # the "6.74B" of Llama-2-7B
    assert m.kv_bytes_per_token == 512 * 1024  # MHA: 32 KV heads, fp16
    assert m.dtype_bytes == 2 and m.max_position_embeddings == 4096


def test_kv_capacity_llama31_h100_by_hand(llama31):
    gpu = load_gpu("h100-80gb-sxm")
    assert vllm_batch_defaults(gpu) == (8192, 1024)  # >= 70 GiB and not an A100
    d = derive_profile(llama31, gpu, DeriveOptions(max_model_len=131072))
    weights = 8_030_261_248 * 2
    activation = 8192 * (2 * 4096 + 3 * 14336 + 4096 + 2 * 1024) * 2 + 2 * 1024 * 128256 * 4
    kv_bytes = 0.9 * 79.2 * GIB - weights - activation - 1.79 * GIB
    blocks = int(kv_bytes // (131072 * 16))
    assert d.profile.kv_capacity_tokens == blocks * 16 == 431_536
    assert d.profile.kv_capacity_tokens % 16 == 0
    assert (d.profile.max_num_seqs, d.profile.max_num_batched_tokens, d.profile.chunked_prefill) == (1024, 8192, True)


def test_a100_keeps_vllms_smaller_defaults(llama31):
    # vLLM excludes the A100 from the large defaults by name (PR #17885), though it has 80 GB.
    assert vllm_batch_defaults(load_gpu("a100-80gb-sxm")) == (2048, 256)
    assert vllm_batch_defaults(load_gpu("l40s")) == (2048, 256)


def test_latency_terms_by_hand(llama31):
    gpu, eff = load_gpu("h100-80gb-sxm"), DEFAULT_EFFICIENCY
    p = derive_profile(llama31, gpu).profile
    flops, bw = 989.5e12, 3350e9
    t_w = 8_030_261_248 * 2 / (bw * eff.mbu_weights)
    assert p.overhead_s == pytest.approx(t_w, rel=1e-5)
    assert p.prefill_per_token_s == pytest.approx(2 * 32 * 218_112_000 / (flops * eff.mfu), rel=1e-5)
    assert p.prefill_attn_s == pytest.approx(2 * 32 * 4096 / (flops * eff.attn_flops_eff), rel=1e-5)
    assert p.decode_per_ctx_token_s == pytest.approx(131072 / (bw * eff.mbu_kv), rel=1e-5)
    t_dec = 2 * (32 * 218_112_000 + 128256 * 4096) / (flops * eff.mfu)
    assert p.decode_per_seq_s == pytest.approx((1024 * t_dec - t_w) / 1024, rel=1e-5)
    assert p.grad1 == p.prefill_per_token_s
    assert p.decode_token_time_s == pytest.approx(p.decode_time(32, 32 * 1024), rel=1e-5)


def test_invariants_across_gpus(llama31):
    # More bandwidth and FLOP/s give cheaper terms; the roofline chord is never negative.
    a100 = derive_profile(llama31, load_gpu("a100-80gb-sxm")).profile
    h100 = derive_profile(llama31, load_gpu("h100-80gb-sxm")).profile
    for f in ("overhead_s", "prefill_per_token_s", "prefill_attn_s", "decode_per_ctx_token_s"):
        assert getattr(h100, f) < getattr(a100, f), f
    assert a100.decode_per_seq_s >= 0 and h100.decode_per_seq_s >= 0
    # Tensor parallel 2 halves the per-GPU weight read and KV bytes per token.
    tp2 = derive_profile(llama31, load_gpu("h100-80gb-sxm"), DeriveOptions(tensor_parallel=2)).profile
    assert tp2.overhead_s == pytest.approx(h100.overhead_s / 2, rel=1e-4)
    assert tp2.decode_per_ctx_token_s == pytest.approx(h100.decode_per_ctx_token_s / 2, rel=1e-4)
    assert tp2.kv_capacity_tokens > 2 * h100.kv_capacity_tokens  # weights halve too


def test_vidur_points_within_ten_percent():
    # The efficiency factors were fitted to these seven points (benchmarks/derive_check.py).
    p = derive_profile(load_model_config("llama-2-7b"), load_gpu("a100-80gb-sxm")).profile
    points = [(p.prefill_time(512), 0.036), (p.prefill_time(2048), 0.161), (p.prefill_time(4096), 0.359),
              (p.decode_time(1, 128), 0.010), (p.decode_time(32, 32 * 1024), 0.020),
              (p.decode_time(64, 64 * 2048), 0.049), (p.decode_time(128, 128 * 2048), 0.091)]
    for t, ref in points:
        assert abs(t / ref - 1) < 0.10, (t, ref)
    # Not fitted: vLLM logged 7,351 blocks for Llama2-7B on one A100-80GB (vllm-project/vllm PR #2031).
    assert abs(p.num_blocks / 7351 - 1) < 0.03


@pytest.mark.parametrize("gpu", ["a100", "h100"])
def test_shipped_long_context_profiles_equal_the_derivation(gpu, capsys, tmp_path):
    name = f"llama3.1-8b-{gpu}"
    shipped = PROFILES / f"{name}.yaml"
    rel = f"routerd/routerd/data/profiles/{name}.yaml"
    options = DeriveOptions(name=name, max_model_len=131072)
    d = derive_profile(load_model_config("llama-3.1-8b-instruct"), load_gpu(f"{gpu}-80gb-sxm"), options)
    cmd = derive_command("llama-3.1-8b-instruct", f"{gpu}-80gb-sxm", options, rel)
    assert shipped.read_text(encoding="utf-8") == profile_yaml(d, cmd)
    assert f"#   {cmd}\n" in shipped.read_text(encoding="utf-8")
    assert get_profile(name) == d.profile == load_profile_file(shipped)
    p = d.profile
    assert p.max_model_len >= 32768 and p.kv_capacity_tokens >= p.max_model_len and p.prefix_caching
    # The command itself writes the same bytes.
    out = tmp_path / f"{name}.yaml"
    argv = ["profile", "--derive", "llama-3.1-8b-instruct", f"{gpu}-80gb-sxm", "--name", name,
            "--max-model-len", "131072", "--output", str(out)]
    assert main(argv) == 0
    assert out.read_text() == profile_yaml(d, derive_command("llama-3.1-8b-instruct", f"{gpu}-80gb-sxm", options,
                                                             str(out)))


def test_without_output_the_yaml_is_printed_and_loads(capsys, tmp_path):
    assert main(["profile", "--derive", "llama-2-7b", "a100-80gb-sxm"]) == 0
    text = capsys.readouterr().out
    path = tmp_path / "p.yaml"
    path.write_text(text)
    p = load_profile_file(path)
    assert p.name == "llama-2-7b-a100-80gb-sxm" and p.max_model_len == 4096
    assert "sources" in yaml.safe_load(text) and "# " in text.splitlines()[12]


def _err(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _write_config(tmp_path, **change) -> Path:
    data = json.loads((REPO / "routerd/routerd/data/models/llama-3.1-8b-instruct.json").read_text())
    for k, v in change.items():
        if v is None:
            data.pop(k)
        else:
            data[k] = v
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("change, field", [
    ({"hidden_size": None}, "hidden_size"),
    ({"torch_dtype": None}, "torch_dtype"),
    ({"num_hidden_layers": "32"}, "num_hidden_layers"),
    ({"intermediate_size": -1}, "intermediate_size"),
    ({"vocab_size": 4096.5}, "vocab_size"),
    ({"torch_dtype": "int3"}, "torch_dtype"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"num_local_experts": 8}, "num_local_experts"),
])
def test_bad_model_config_names_the_file_and_field(tmp_path, capsys, change, field):
    path = _write_config(tmp_path, **change)
    out = tmp_path / "out.yaml"
    assert main(["profile", "--derive", str(path), "h100-80gb-sxm", "--output", str(out)]) == 2
    err = _err(capsys)
    assert str(path) in err and f"field {field}" in err
    assert not out.exists() and list(tmp_path.iterdir()) == [path]


def test_missing_field_says_missing(tmp_path, capsys):
    path = _write_config(tmp_path, vocab_size=None)
    assert main(["profile", "--derive", str(path), "h100-80gb-sxm"]) == 2
    assert _err(capsys).endswith("field vocab_size: missing")


@pytest.mark.parametrize("argv, needle", [
    (["nope-7b", "h100-80gb-sxm"], "unknown model config 'nope-7b'"),
    (["llama-2-7b", "b300"], "unknown GPU 'b300'"),
    (["llama-2-7b", "missing/gpu.yaml"], "missing/gpu.yaml"),
    (["missing/config.json", "h100-80gb-sxm"], "missing/config.json"),
])
def test_unknown_model_or_gpu_exits_2(capsys, argv, needle):
    assert main(["profile", "--derive", *argv]) == 2
    err = _err(capsys)
    assert needle in err
    if "unknown" in needle:
        assert ("llama-3.1-8b-instruct" in err) if "model" in needle else ("h100-80gb-sxm" in err)


def test_bad_gpu_file_names_the_field(tmp_path, capsys):
    gpu = tmp_path / "mygpu.yaml"
    gpu.write_text("device_name: X\nmemory_gib: 24\nvisible_memory_gib: 23\nfp16_dense_tflops: 100\n")
    assert main(["profile", "--derive", "llama-2-7b", str(gpu)]) == 2
    err = _err(capsys)
    assert str(gpu) in err and "field memory_bandwidth_gb_s: missing" in err
    gpu.write_text("device_name: X\nmemory_gib: 24\nvisible_memory_gib: 23\nfp16_dense_tflops: 100\n"
                   "memory_bandwidth_gb_s: 0\n")
    assert main(["profile", "--derive", "llama-2-7b", str(gpu)]) == 2
    assert "field memory_bandwidth_gb_s" in _err(capsys)


def test_user_gpu_file_works(tmp_path, capsys):
    gpu = tmp_path / "mygpu.yaml"
    gpu.write_text("device_name: NVIDIA RTX 6000 Ada\nmemory_gib: 48\nvisible_memory_gib: 45\n"
                   "memory_bandwidth_gb_s: 960\nbf16_dense_tflops: 364\nfp16_dense_tflops: 364\n")
    out = tmp_path / "p.yaml"
    assert main(["profile", "--derive", "llama-3.1-8b-instruct", str(gpu), "--max-model-len", "32768",
                 "--output", str(out)]) == 0
    assert load_profile_file(out).name == "llama-3.1-8b-instruct-mygpu"


def test_kv_capacity_below_max_model_len_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "p.yaml"
    # 24 GiB A10G: 0.9 * 22.49 - 14.96 weights - ... leaves about 3 GiB, 24.8K tokens of Llama-3.1-8B
    assert main(["profile", "--derive", "llama-3.1-8b-instruct", "a10g", "--output", str(out)]) == 2
    err = _err(capsys)
    assert "field max_position_embeddings=131072" in err and "llama-3.1-8b-instruct.json" in err
    assert "cannot hold one request of max_model_len=131072" in err
    assert main(["profile", "--derive", "llama-3.1-8b-instruct", "a10g", "--max-model-len", "32768",
                 "--output", str(out)]) == 2
    assert _err(capsys).startswith("phasewise: error: --max-model-len 32768:")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    # The limit it names is one that works.
    fits = int(err.rsplit("use --max-model-len ", 1)[1].split()[0])
    assert main(["profile", "--derive", "llama-3.1-8b-instruct", "a10g", "--max-model-len", str(fits),
                 "--output", str(out)]) == 0
    assert load_profile_file(out).kv_capacity_tokens >= fits


def test_weights_that_do_not_fit_exit_2(capsys):
    assert main(["profile", "--derive", "llama-3.1-8b-instruct", "v100-16gb"]) == 2
    assert "no memory left for the KV cache" in _err(capsys)


@pytest.mark.parametrize("argv, needle", [
    (["--tensor-parallel", "3"], "--tensor-parallel 3"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--quick"], "--quick applies to --endpoint"),
    (["--model", "x"], "--model applies to --endpoint"),
])
def test_bad_derive_flags_exit_2(capsys, argv, needle):
    assert main(["profile", "--derive", "llama-2-7b", "a100-80gb-sxm", *argv]) == 2
    assert needle in _err(capsys)


def test_endpoint_and_derive_are_exclusive_and_endpoint_still_needs_output(capsys):
    with pytest.raises(SystemExit) as e:
        main(["profile", "--endpoint", "http://127.0.0.1:9", "--derive", "llama-2-7b", "a100-80gb-sxm"])
    assert e.value.code == 2
    capsys.readouterr()
    assert main(["profile", "--endpoint", "http://127.0.0.1:9"]) == 2
    assert "--output is required with --endpoint" in _err(capsys)
    assert main(["profile", "--endpoint", "http://127.0.0.1:9", "--output", "x.yaml", "--max-model-len", "9"]) == 2
    assert "--max-model-len applies to --derive" in _err(capsys)


def test_shipped_tables_load():
    assert {"a100-80gb-sxm", "h100-80gb-sxm", "v100-32gb", "v100-16gb", "l40s", "a10g"} <= set(gpu_names())
    for g in gpu_names():
        spec = load_gpu(g)
        assert spec.visible_memory_gib <= spec.memory_gib and "datasheet" in spec.sources
    assert model_names() == ["llama-2-7b", "llama-3.1-8b-instruct"]
    for m in model_names():
        assert load_model_config(m).source.startswith("https://huggingface.co/")
    with pytest.raises(DeriveError):
        load_gpu("nope")


# ---------------------------------------------------------------- adversarial inputs

_GPU_FIELDS = {"device_name": "X", "memory_gib": 48, "visible_memory_gib": 45, "memory_bandwidth_gb_s": 960,
               "bf16_dense_tflops": 364, "fp16_dense_tflops": 364}


@pytest.mark.parametrize("field, text", [
    ("memory_bandwidth_gb_s", "inf"),   # YAML string "inf": pydantic parses it as float('inf')
    ("memory_bandwidth_gb_s", ".inf"),  # YAML's own infinity
    ("fp16_dense_tflops", ".inf"),
    ("bf16_dense_tflops", ".nan"),
    ("memory_gib", ".inf"),
])
def test_gpu_spec_non_finite_number_exits_2(tmp_path, capsys, field, text):
    gpu = tmp_path / "mygpu.yaml"
    gpu.write_text("".join(f"{k}: {text if k == field else v}\n" for k, v in _GPU_FIELDS.items()))
    out = tmp_path / "p.yaml"
    assert main(["profile", "--derive", "llama-3.1-8b-instruct", str(gpu), "--max-model-len", "32768",
                 "--output", str(out)]) == 2
    err = _err(capsys)
    assert str(gpu) in err and f"field {field}" in err and "finite" in err
    assert not out.exists()


def test_model_config_non_finite_number_exits_2(tmp_path, capsys):
    # Python's json reads Infinity and NaN; an integer field must refuse them.
    path = tmp_path / "config.json"
    path.write_text(_write_config(tmp_path).read_text().replace('"hidden_size": 4096', '"hidden_size": Infinity'))
    assert main(["profile", "--derive", str(path), "h100-80gb-sxm"]) == 2
    err = _err(capsys)
    assert str(path) in err and "field hidden_size" in err


@pytest.mark.parametrize("change, field, needle", [
    ({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}, "quantization_config",
     "quantized checkpoints are not supported by --derive"),
    ({"sliding_window": 4096}, "sliding_window", "sliding-window attention is not supported by --derive"),
])
def test_quantized_and_sliding_window_configs_are_refused(tmp_path, capsys, change, field, needle):
    path = _write_config(tmp_path, **change)
    out = tmp_path / "out.yaml"
    assert main(["profile", "--derive", str(path), "h100-80gb-sxm", "--output", str(out)]) == 2
    err = _err(capsys)
    assert str(path) in err and f"field {field}" in err and needle in err
    assert not out.exists()


def test_disabled_or_null_sliding_window_and_null_quantization_are_accepted(tmp_path):
    # Qwen2 configs carry sliding_window with use_sliding_window false (transformers then sets it to None).
    ref = derive_profile(load_model_config("llama-3.1-8b-instruct"), load_gpu("h100-80gb-sxm")).profile
    for change in ({"sliding_window": None}, {"sliding_window": 131072, "use_sliding_window": False},
                   {"quantization_config": None}):
        data = json.loads((REPO / "routerd/routerd/data/models/llama-3.1-8b-instruct.json").read_text())
        data.update(change)
        path = tmp_path / "config.json"
        path.write_text(json.dumps(data))
        p = derive_profile(load_model_config(str(path)), load_gpu("h100-80gb-sxm")).profile
        assert p.kv_capacity_tokens == ref.kv_capacity_tokens and p.overhead_s == ref.overhead_s


def test_float32_checkpoint_is_sized_at_16_bits(tmp_path, capsys):
    # vLLM dtype=auto serves float32 checkpoints in a 16-bit dtype (vllm/config/model.py _resolve_auto_dtype:
    # "Downcast for float32 models"), so weights and KV are 2 bytes a value: the profile equals the bf16 one.
    path = _write_config(tmp_path, torch_dtype="float32")
    m = load_model_config(str(path))
    assert m.dtype_bytes == 2 and m.kv_bytes_per_token == 128 * 1024
    d32 = derive_profile(m, load_gpu("h100-80gb-sxm"))
    d16 = derive_profile(load_model_config("llama-3.1-8b-instruct"), load_gpu("h100-80gb-sxm"))
    p32, p16 = d32.profile, d16.profile
    for f in ("kv_capacity_tokens", "overhead_s", "prefill_per_token_s", "prefill_attn_s", "decode_per_seq_s",
              "decode_per_ctx_token_s"):
        assert getattr(p32, f) == getattr(p16, f), f
    assert d32.numbers["weights_gib"] == pytest.approx(8_030_261_248 * 2 / GIB)
    assert "float32" in p32.sources["dtype"] and "16-bit" in p32.sources["dtype"]
    assert "dtype" not in p16.sources
    assert main(["profile", "--derive", str(path), "h100-80gb-sxm"]) == 0
    assert "16-bit" in capsys.readouterr().out


def test_max_model_len_above_the_model_limit_exits_2(capsys, tmp_path):
    out = tmp_path / "p.yaml"
    assert main(["profile", "--derive", "llama-3.1-8b-instruct", "h100-80gb-sxm", "--max-model-len", "200000",
                 "--output", str(out)]) == 2
    err = _err(capsys)
    assert "--max-model-len 200000" in err and "max_position_embeddings=131072" in err
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN" in err
    assert not out.exists()
    # The limit itself is accepted (the shipped profiles use it).
    assert main(["profile", "--derive", "llama-3.1-8b-instruct", "h100-80gb-sxm", "--max-model-len",
                 "131072"]) == 0


def test_max_model_len_limit_follows_vllms_rope_scaling(tmp_path):
    # vLLM multiplies the limit by a linear/dynamic/yarn RoPE factor (not for llama3, su, longrope).
    path = _write_config(tmp_path, max_position_embeddings=4096,
                         rope_scaling={"rope_type": "linear", "factor": 4.0})
    m = load_model_config(str(path))
    assert m.max_len_limit == 16384
    derive_profile(m, load_gpu("h100-80gb-sxm"), DeriveOptions(max_model_len=16384))
    with pytest.raises(DeriveError, match="16384"):
        derive_profile(m, load_gpu("h100-80gb-sxm"), DeriveOptions(max_model_len=16385))
    assert load_model_config("llama-3.1-8b-instruct").max_len_limit == 131072  # rope_type llama3: unscaled


def test_tensor_parallel_above_kv_heads_replicates_them(capsys):
    # vLLM ModelConfig.get_num_kv_heads: max(1, kv_heads // tp); QKVParallelLinear replicates the KV heads
    # tp / kv_heads times, so tp must be a multiple of kv_heads (8 for Llama-3.1-8B).
    m, gpu, eff = load_model_config("llama-3.1-8b-instruct"), load_gpu("h100-80gb-sxm"), DEFAULT_EFFICIENCY
    d = derive_profile(m, gpu, DeriveOptions(tensor_parallel=16))
    kv_per_gpu = 2 * 32 * 1 * 128 * 2  # one KV head per GPU: 16 KiB per token, not 128 KiB / 16 = 8 KiB
    assert d.profile.decode_per_ctx_token_s == pytest.approx(kv_per_gpu / (3350e9 * eff.mbu_kv), rel=1e-5)
    # Each GPU holds its 1/16 of the weights plus the second copy of its KV projection (2 replicas).
    weights = (8_030_261_248 + 32 * 2 * 4096 * 1024) * 2 / 16
    assert d.numbers["weights_gib"] == pytest.approx(weights / GIB)
    assert d.profile.overhead_s == pytest.approx(weights / (3350e9 * eff.mbu_weights), rel=1e-5)
    assert main(["profile", "--derive", "llama-3.1-8b-instruct", "h100-80gb-sxm", "--tensor-parallel", "16"]) == 0
    capsys.readouterr()
    assert main(["profile", "--derive", "llama-3.1-8b-instruct", "h100-80gb-sxm", "--tensor-parallel", "3"]) == 2
    assert "--tensor-parallel 3" in _err(capsys)
    # 12 divides the 48 query heads but neither divides nor is a multiple of the 8 KV heads.
    m48 = m.model_copy(update={"num_attention_heads": 48, "head_dim": 128})
    with pytest.raises(DeriveError, match="num_key_value_heads"):
        derive_profile(m48, gpu, DeriveOptions(tensor_parallel=12))


def test_absent_kv_heads_default_to_the_attention_heads(tmp_path):
    # transformers' LlamaConfig: num_key_value_heads None -> num_attention_heads (multi-head attention).
    path = _write_config(tmp_path, num_key_value_heads=None)
    m = load_model_config(str(path))
    assert m.num_key_value_heads == 32 and m.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2


def test_nested_text_config_is_refused(tmp_path, capsys):
    data = json.loads((REPO / "routerd/routerd/data/models/llama-3.1-8b-instruct.json").read_text())
    text = {k: data.pop(k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                     "num_key_value_heads", "intermediate_size", "vocab_size")}
    data["text_config"] = text
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    assert main(["profile", "--derive", str(path), "h100-80gb-sxm"]) == 2
    err = _err(capsys)
    assert str(path) in err and "field text_config" in err and "nested (multimodal) configs are not supported" in err


def test_output_that_names_no_file_exits_2(tmp_path, capsys):
    assert main(["profile", "--derive", "llama-2-7b", "a100-80gb-sxm", "-o", ""]) == 2
    assert "--output must name a file" in _err(capsys)
    assert main(["profile", "--derive", "llama-2-7b", "a100-80gb-sxm", "-o", str(tmp_path)]) == 2
    assert "--output must name a file" in _err(capsys)
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    for out in (blocker / "p.yaml", blocker / "sub" / "p.yaml"):
        assert main(["profile", "--derive", "llama-2-7b", "a100-80gb-sxm", "-o", str(out)]) == 2
        err = _err(capsys)
        assert f"{blocker} is a file, not a directory" in err
    assert blocker.read_text() == "x" and sorted(tmp_path.iterdir()) == [blocker]
