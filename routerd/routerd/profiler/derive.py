"""Derive a :class:`~routerd.profiles.HardwareProfile` from a model's configuration and a GPU's specs.

``phasewise profile --derive MODEL_CONFIG GPU`` (:mod:`routerd.profiler.cli`). For GPUs and
models that nobody has profiled per iteration, every term of the profile's closed form
(:mod:`routerd.profiles`) follows from FLOPs and bytes, the GPU's datasheet and four stated
efficiency factors (:class:`Efficiency`); the KV capacity follows from vLLM's memory
accounting (:class:`MemoryBudget`). docs/profiles.md has the derivation, every number's
source and the validation (``benchmarks/derive_check.py``).

Model (Llama-style decoder: Llama, Mistral, Qwen2; gated MLP of three matrices; unquantized, full
attention), per GPU at tensor parallelism ``tp``, ``b`` = 2 bytes per value (vLLM serves float32
checkpoints in 16 bits, :data:`SERVED_DTYPE_BYTES`). At ``tp > kv_heads`` vLLM replicates the KV
heads (one per GPU): the K/V weights count ``tp / kv_heads`` times and ``kv_bytes/token / tp``
becomes ``2 * L * head_dim * b`` (:meth:`ModelConfig.kv_bytes_per_token_per_gpu`)::

    params        = V*h*(1 + untied) + L*(h*q + 2*h*kv + q*h + 3*h*I + 2*h) + h     (+ biases)
    kv_bytes/token = 2 * L * kv_heads * head_dim * b                            (K and V, all layers)
    T_w           = params * b / tp / (bandwidth * mbu_weights)          a step reads the weights once
    overhead_s    = cpu_overhead_s + T_w
    prefill_per_token_s    = 2 * matmul_params / tp / (flops * mfu)       matmul params: layers only
    prefill_attn_s         = 2 * L * q / tp / (flops * attn_flops_eff)    per unit of c*(kv+c)
    decode_per_ctx_token_s = kv_bytes/token / tp / (bandwidth * mbu_kv)   decode reads every resident token
    decode_per_seq_s       = max(0, B_max * t_dec - T_w) / B_max,   t_dec = 2*(matmul + lm_head params)/tp/(flops*mfu)

``q = heads * head_dim``, ``kv = kv_heads * head_dim``. The prefill attention unit: a
chunk of ``c`` tokens costs ``4*L*q`` FLOPs per (query, key) pair, and a causal prefill
from zero has ``c**2 / 2`` pairs, so ``2*L*q`` per unit of ``c**2`` (the profile's form
counts pairs with cached tokens at the same rate). ``decode_per_seq_s`` is the chord of
the roofline ``max(T_w, B*t_dec)`` of a decode step's linear layers between ``B = 0`` and
``B = max_num_seqs``: exact at both ends, since a decode step is weight-read bound at small
batches and compute bound past ``B = T_w / t_dec``.

KV capacity (vLLM V1 ``gpu_worker.determine_available_memory``)::

    kv_bytes = gpu_memory_utilization * visible_memory
               - weights/tp - activation_peak - non_torch - cuda_graphs
    kv_capacity_tokens = floor(kv_bytes / (kv_bytes/token / tp) / block_size) * block_size

Pure: no I/O in the math. :func:`load_model_config` and :func:`load_gpu` read files.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from routerd.errors import ConfigError
from routerd.profiles import HardwareProfile, read_yaml_mapping

GIB = 1024**3

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
"""Bytes per value of each ``torch_dtype`` a config may name, as stored in the checkpoint."""

SERVED_DTYPE_BYTES = 2
"""Bytes per weight / KV value as vLLM serves every unquantized checkpoint with ``dtype=auto``: 16-bit
models as they are, float32 ones downcast to a 16-bit dtype (vllm/config/model.py ``_resolve_auto_dtype``:
"Downcast for float32 models"; older releases: ``_get_and_verify_dtype``, "we use float16 for float32
models"). vLLM's KV dtype is the served model dtype (``CacheConfig.cache_dtype`` "auto")."""

FLOAT32_DTYPES = ("float32", "float")
"""``torch_dtype`` spellings of a float32 checkpoint (sized as served, at :data:`SERVED_DTYPE_BYTES`)."""

_ROPE_UNSCALED = ("su", "longrope", "llama3", "default")
"""RoPE types whose ``factor`` vLLM does not apply to the length limit (``_get_and_verify_max_len``)."""

PAPER_GRAD2 = 3.3e-5
"""Mixing-estimator decode gradient of arXiv 2408.13510 §5.2, kept as in the shipped profiles:
a scale of the estimator (routerd/estimator.py), not a latency, so no derivation gives it."""

DECODE_REFERENCE_BATCH = 32
"""``decode_token_time_s`` is the decode iteration at this batch (requests) ..."""
DECODE_REFERENCE_CONTEXT = 1024
"""... each with this many resident tokens: the Vidur point of ``llama2-7b-a100`` (B = 32 at 1K),
the same reference as the endpoint profiler (routerd/profiler/writer.py)."""


class DeriveError(ConfigError):
    """A model config or GPU spec is unknown or invalid, or the derived profile is impossible.

    The message is one line naming the file and field (the CLI prints it and exits 2)."""


class ModelConfig(BaseModel):
    """The fields of a Hugging Face ``config.json`` that the derivation uses."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True, allow_inf_nan=False)

    name: str
    """Model name (the shipped config's name, or the file's stem)."""
    num_hidden_layers: int = Field(gt=0)
    """Decoder layers ``L``."""
    hidden_size: int = Field(gt=0)
    """Model width ``h``."""
    num_attention_heads: int = Field(gt=0)
    """Query heads."""
    num_key_value_heads: int = Field(gt=0)
    """KV heads (grouped-query attention; equal to the query heads for multi-head attention)."""
    intermediate_size: int = Field(gt=0)
    """MLP width ``I`` (gated: gate, up and down projections)."""
    vocab_size: int = Field(gt=0)
    """Vocabulary ``V`` (embedding rows, LM-head columns)."""
    torch_dtype: str
    """Weight and KV dtype, one of :data:`DTYPE_BYTES`."""
    max_position_embeddings: int = Field(gt=0)
    """Longest context the model supports (tokens); vLLM's default ``max_model_len``."""
    head_dim: int | None = Field(default=None, gt=0)
    """Per-head width; absent means ``hidden_size / num_attention_heads`` (as in transformers)."""
    tie_word_embeddings: bool = False
    """Whether the LM head shares the embedding matrix (then it is counted once)."""
    attention_bias: bool = False
    """Biases on the Q, K, V and O projections."""
    mlp_bias: bool = False
    """Biases on the MLP projections."""
    rope_scaling: dict[str, Any] | None = None
    """RoPE scaling (``rope_type`` or ``type``, ``factor``, ``original_max_position_embeddings``); only its
    effect on the longest allowed ``max_model_len`` is used (:attr:`max_len_limit`)."""
    source: str = Field(default="", alias="_source")
    """Where the config's values come from (the shipped files cite the Hugging Face page)."""
    config_file: str = ""
    """The file the config was read from (for error messages); empty when built in code."""

    @property
    def dtype_bytes(self) -> int:
        """Bytes per weight / KV value as vLLM serves the model: :data:`SERVED_DTYPE_BYTES` (2) for every
        dtype, float32 checkpoints included (vLLM downcasts them to 16 bits)."""
        return SERVED_DTYPE_BYTES

    @property
    def is_float32(self) -> bool:
        """Whether the checkpoint is float32 (served downcast to 16 bits)."""
        return self.torch_dtype in FLOAT32_DTYPES

    @property
    def max_len_limit(self) -> int:
        """Longest ``max_model_len`` vLLM accepts without ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` (tokens).

        vLLM ``_get_and_verify_max_len`` (vllm/config/model.py): ``max_position_embeddings``, times the RoPE
        ``factor`` unless the type is llama3, su, longrope or default; for yarn the base is
        ``original_max_position_embeddings``. Llama-3.1 (llama3): 131,072."""
        rope = self.rope_scaling or {}
        kind = rope.get("rope_type", rope.get("type"))
        factor = rope.get("factor")
        if kind in _ROPE_UNSCALED or not isinstance(factor, (int, float)) or isinstance(factor, bool) \
                or not math.isfinite(factor) or factor <= 0:
            return self.max_position_embeddings
        base = self.max_position_embeddings
        if kind == "yarn" and isinstance(rope.get("original_max_position_embeddings"), int):
            base = rope["original_max_position_embeddings"]
        return int(base * factor)

    def kv_heads_per_gpu(self, tp: int) -> int:
        """KV heads each GPU holds at tensor parallelism ``tp``: ``max(1, kv_heads // tp)`` (vLLM
        ``ModelConfig.get_num_kv_heads``; at ``tp > kv_heads`` the heads are replicated)."""
        return max(1, self.num_key_value_heads // tp)

    def kv_bytes_per_token_per_gpu(self, tp: int) -> float:
        """KV-cache bytes of one token on each GPU: ``kv_bytes_per_token / tp`` while ``tp`` divides the KV
        heads, ``2 * L * 1 * head_dim * bytes`` once they are replicated."""
        if tp <= self.num_key_value_heads:
            return self.kv_bytes_per_token / tp
        return 2 * self.num_hidden_layers * self.kv_heads_per_gpu(tp) * self.head_width * self.dtype_bytes

    def replicated_kv_params(self, tp: int) -> int:
        """Parameters added over all GPUs by replicating K and V projections at ``tp > kv_heads``:
        ``(tp / kv_heads - 1)`` extra copies of every layer's K and V weights (and biases); 0 otherwise.
        vLLM ``QKVParallelLinear``: ``num_kv_head_replicas = tp_size / total_num_kv_heads``."""
        if tp <= self.num_key_value_heads:
            return 0
        copies = tp // self.num_key_value_heads - 1
        kv = 2 * self.hidden_size * self.kv_dim + (2 * self.kv_dim if self.attention_bias else 0)
        return self.num_hidden_layers * kv * copies

    @property
    def head_width(self) -> int:
        """``head_dim``, or ``hidden_size // num_attention_heads``."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def q_dim(self) -> int:
        """Query projection width ``heads * head_dim``."""
        return self.num_attention_heads * self.head_width

    @property
    def kv_dim(self) -> int:
        """K (or V) projection width ``kv_heads * head_dim``."""
        return self.num_key_value_heads * self.head_width

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: Q, K, V, O, gate, up, down, two RMSNorm weights (+ biases)."""
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        n = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        if self.attention_bias:
            n += q + 2 * kv + h
        if self.mlp_bias:
            n += 2 * i + h
        return n

    @property
    def matmul_params(self) -> int:
        """Parameters every token multiplies through (the decoder layers; norms counted, negligible)."""
        return self.num_hidden_layers * self.layer_params

    @property
    def lm_head_params(self) -> int:
        """LM-head parameters (``V * h``), applied only to tokens that are sampled."""
        return self.vocab_size * self.hidden_size

    @property
    def param_count(self) -> int:
        """All parameters: embedding, layers, final norm, LM head unless tied. Llama-3.1-8B: 8,030,261,248."""
        embed = self.vocab_size * self.hidden_size
        return embed + self.matmul_params + self.hidden_size + (0 if self.tie_word_embeddings else self.lm_head_params)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes of one token over all layers: ``2 * L * kv_heads * head_dim * bytes``."""
        return 2 * self.num_hidden_layers * self.kv_dim * self.dtype_bytes


class GpuSpec(BaseModel):
    """One GPU's published numbers (``routerd/data/gpus.yaml`` or a user's YAML file)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str
    """GPU key, e.g. ``h100-80gb-sxm``."""
    description: str = ""
    """What the GPU is."""
    device_name: str
    """The name torch reports; vLLM's batch defaults look for ``a100`` in it."""
    memory_gib: float = Field(gt=0)
    """Datasheet memory capacity (GiB)."""
    visible_memory_gib: float = Field(gt=0)
    """Total memory the driver reports (GiB); vLLM's ``gpu_memory_utilization`` applies to it."""
    memory_bandwidth_gb_s: float = Field(gt=0)
    """Peak memory bandwidth (GB/s, 1e9 bytes/s)."""
    bf16_dense_tflops: float | None = Field(default=None, gt=0)
    """Peak dense BF16 tensor TFLOP/s; None where the GPU has no BF16 (then FP16 is used)."""
    fp16_dense_tflops: float = Field(gt=0)
    """Peak dense FP16 tensor TFLOP/s."""
    sources: dict[str, str] = Field(default_factory=dict)
    """Where each number comes from."""

    def dense_flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for a model of ``dtype`` (bfloat16 falls back to FP16 where there is no BF16,
        as vLLM runs bfloat16 models in float16 on such GPUs; float32 uses the FP16 tensor rate too, since
        vLLM casts float32 checkpoints to a 16-bit dtype by default)."""
        if dtype == "bfloat16" and self.bf16_dense_tflops is not None:
            return self.bf16_dense_tflops * 1e12
        return self.fp16_dense_tflops * 1e12


class Efficiency(BaseModel):
    """Fractions of the datasheet peaks that the kernels reach (0 < x <= 1), and a CPU term.

    The defaults were fitted ONLY to the seven Vidur calibration points of ``llama2-7b-a100``
    (weighted least squares, relative error; ``python benchmarks/derive_check.py --fit``) and
    rounded to two digits; they are applied unchanged to every other model and GPU."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    mfu: float = Field(default=0.85, gt=0, le=1)
    """Model FLOP utilisation of the linear layers (prefill tokens, and decode past the roofline knee)."""
    mbu_weights: float = Field(default=0.67, gt=0, le=1)
    """Bandwidth utilisation of the weight read that every step does (the decode floor)."""
    mbu_kv: float = Field(default=0.86, gt=0, le=1)
    """Bandwidth utilisation of the decode attention's KV-cache read."""
    attn_flops_eff: float = Field(default=0.087, gt=0, le=1)
    """FLOP utilisation of prefill attention (paged prefill kernels, as Vidur profiled them)."""
    cpu_overhead_s: float = Field(default=0.0, ge=0)
    """CPU time per step not hidden behind the GPU (s). 0: the Vidur points are kernel-only, and
    vLLM V1's concurrency-1 TPOT for Llama-3.1-8B on H100 (6.5 ms, vllm-and-simulators.md §6.3) sits
    at the weight-read floor, leaving no room for a separate CPU term."""


class MemoryBudget(BaseModel):
    """What vLLM subtracts from ``gpu_memory_utilization * memory`` before the KV cache."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    non_torch_gib_tp1: float = Field(default=1.79, ge=0)
    """Memory outside PyTorch's allocator at TP 1 (CUDA context, cuBLAS workspaces), GiB: vLLM's memory
    profile of Meta-Llama-3-8B on an 80 GB GPU, ``non_torch_memory 1.79GiB`` (vllm-project/vllm PR #10511)."""
    non_torch_gib_tp_multi: float = Field(default=3.58, ge=0)
    """The same at TP > 1 (adds NCCL buffers), GiB: ``3.58GiB`` at ``-tp 2`` in the same log."""
    cuda_graph_gib: float = Field(default=0.0, ge=0)
    """CUDA-graph memory subtracted before the KV cache, GiB. 0: vLLM V1 captures graphs after the KV cache
    is allocated (gpu_worker: ``initialize_from_config`` then ``compile_or_warm_up_model``), so the graphs
    come out of the ``1 - gpu_memory_utilization`` headroom."""
    sampler_logit_copies: int = Field(default=2, ge=0)
    """Float32 ``max_num_seqs x vocab`` tensors alive at the sampler's peak in vLLM's profile run
    (logits and probabilities)."""


class DeriveOptions(BaseModel):
    """The command's choices (flags of ``phasewise profile --derive``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str | None = None
    """Profile name; None gives ``<model>-<gpu>``."""
    max_model_len: int | None = Field(default=None, gt=0)
    """Longest request (tokens); None takes the model's ``max_position_embeddings`` (vLLM's default)."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    """vLLM's ``gpu_memory_utilization`` (0.9 in released versions, vllm-and-simulators.md §1.1)."""
    tensor_parallel: int = Field(default=1, gt=0)
    """GPUs per instance (vLLM ``tensor_parallel_size``); all-reduce time is not modelled."""
    block_size: int = Field(default=16, gt=0)
    """KV block size (tokens; vLLM ``CacheConfig`` default 16)."""
    max_num_seqs: int | None = Field(default=None, gt=0)
    """Override of vLLM's default ``max_num_seqs`` for the GPU class."""
    max_num_batched_tokens: int | None = Field(default=None, gt=0)
    """Override of vLLM's default ``max_num_batched_tokens`` for the GPU class."""


DEFAULT_EFFICIENCY = Efficiency()
DEFAULT_MEMORY = MemoryBudget()


@dataclass(frozen=True)
class Derivation:
    """A derived profile and the intermediate numbers behind it (for the YAML's comments)."""

    profile: HardwareProfile
    model: ModelConfig
    gpu: GpuSpec
    options: DeriveOptions
    efficiency: Efficiency
    memory: MemoryBudget
    numbers: dict[str, float] = field(default_factory=dict)
    """Intermediate values: weights_gib, activation_gib, kv_gib, t_weights_s, ... (units in the key)."""
    comments: dict[str, str] = field(default_factory=dict)
    """Profile field -> one-line source comment."""


def vllm_batch_defaults(gpu: GpuSpec) -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` of vLLM's OpenAI API server on ``gpu``.

    vLLM ``EngineArgs.get_batch_defaults`` (vllm/engine/arg_utils.py): device memory >= 70 GiB and
    "a100" not in the device name (H100, H200, MI300X): 8192 / 1024; otherwise (A100 deliberately,
    vLLM PR #17885; L40S, A10G, V100, ...): 2048 / 256."""
    if gpu.visible_memory_gib >= 70 and "a100" not in gpu.device_name.lower():
        return 8192, 1024
    return 2048, 256


def _sig(x: float, digits: int = 6) -> float:
    """``x`` rounded to ``digits`` significant digits, so the profile equals its YAML text."""
    return float(f"{x:.{digits}g}")


def derive_profile(model: ModelConfig, gpu: GpuSpec, options: DeriveOptions = DeriveOptions(),
                   efficiency: Efficiency = DEFAULT_EFFICIENCY, memory: MemoryBudget = DEFAULT_MEMORY) -> Derivation:
    """The hardware profile of ``model`` served by vLLM on ``gpu`` (formulas in the module docstring).

    Raises:
        DeriveError: ``tensor_parallel`` does not divide the attention heads, or neither divides nor is a
            multiple of the KV heads (vLLM ``verify_with_parallel_config`` and ``QKVParallelLinear``);
            ``max_model_len`` above the model's limit (:attr:`ModelConfig.max_len_limit`); the weights do
            not fit; or the KV capacity cannot hold one request of ``max_model_len`` tokens (vLLM refuses
            to start in each case).
    """
    tp = options.tensor_parallel
    heads, kv_heads = model.num_attention_heads, model.num_key_value_heads
    if heads % tp:
        raise DeriveError(f"--tensor-parallel {tp}: does not divide num_attention_heads={heads} "
                          f"of model {model.name!r}")
    if (kv_heads % tp) if tp <= kv_heads else (tp % kv_heads):
        raise DeriveError(f"--tensor-parallel {tp}: neither divides nor is a multiple of num_key_value_heads="
                          f"{kv_heads} of model {model.name!r} (vLLM splits or replicates whole KV heads)")
    limit = model.max_len_limit
    if options.max_model_len and options.max_model_len > limit:
        derived = ("max_position_embeddings" if limit == model.max_position_embeddings
                   else "max_position_embeddings x rope_scaling")
        raise DeriveError(f"--max-model-len {options.max_model_len}: above the model's {derived}={limit} "
                          f"({model.config_file or model.name}); vLLM refuses it unless "
                          "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 is set (positions past the trained length give NaN "
                          "or out-of-bounds errors)")
    b = model.dtype_bytes
    bw = gpu.memory_bandwidth_gb_s * 1e9
    flops = gpu.dense_flops(model.torch_dtype)
    max_len = options.max_model_len or model.max_position_embeddings
    batched_default, seqs_default = vllm_batch_defaults(gpu)
    batched = options.max_num_batched_tokens or batched_default
    seqs = options.max_num_seqs or seqs_default
    if options.max_num_batched_tokens is None:
        batched = min(seqs * max_len, batched)  # vLLM: never above max_num_seqs * max_model_len
    if options.max_num_seqs is None:
        seqs = min(seqs, batched)  # vLLM: every running decode must fit one step's budget

    # Memory (bytes, per GPU)
    replicated = model.replicated_kv_params(tp)  # 0 unless tp > kv_heads
    weights = (model.param_count + replicated) * b / tp
    # K and V outputs over all GPUs: 2*kv, or tp copies of one GPU's heads once they are replicated.
    kv_out = 2 * (model.kv_dim if tp <= kv_heads else model.kv_heads_per_gpu(tp) * model.head_width * tp)
    per_token_act = (2 * model.hidden_size + (3 * model.intermediate_size + model.q_dim + kv_out) / tp) * b
    activation = batched * per_token_act + memory.sampler_logit_copies * seqs * model.vocab_size * 4
    non_torch = (memory.non_torch_gib_tp1 if tp == 1 else memory.non_torch_gib_tp_multi) * GIB
    graphs = memory.cuda_graph_gib * GIB
    budget = options.gpu_memory_utilization * gpu.visible_memory_gib * GIB
    kv_bytes = budget - weights - activation - non_torch - graphs
    where = f"model {model.name!r} on GPU {gpu.name!r}"
    if kv_bytes <= 0:
        raise DeriveError(
            f"{where}: no memory left for the KV cache: {options.gpu_memory_utilization:g} x "
            f"{gpu.visible_memory_gib:g} GiB = {budget / GIB:.2f} GiB < weights {weights / GIB:.2f} GiB + "
            f"activations {activation / GIB:.2f} GiB + non-torch {(non_torch + graphs) / GIB:.2f} GiB "
            f"(raise --tensor-parallel or --gpu-memory-utilization)")
    kv_per_token = model.kv_bytes_per_token_per_gpu(tp)
    blocks = int(kv_bytes // (kv_per_token * options.block_size))
    capacity = blocks * options.block_size
    if capacity < -(-max_len // options.block_size) * options.block_size:
        fits = capacity if capacity > 0 else 0
        what = (f"--max-model-len {max_len}" if options.max_model_len else
                f"{model.config_file or model.name}: field max_position_embeddings={max_len} (the default "
                "max_model_len)")
        raise DeriveError(
            f"{what}: the KV capacity of {where} is {capacity} tokens "
            f"({kv_bytes / GIB:.2f} GiB / {kv_per_token / 1024:g} KiB per token), which cannot hold one "
            f"request of max_model_len={max_len} tokens (vLLM would refuse to start); "
            f"use --max-model-len {fits} or less")

    # Latency terms (s)
    t_w = weights / (bw * efficiency.mbu_weights)
    matmul = model.matmul_params + replicated
    t_prefill_token = 2 * matmul / tp / (flops * efficiency.mfu)
    t_decode_token = 2 * (matmul + model.lm_head_params) / tp / (flops * efficiency.mfu)
    attn = 2 * model.num_hidden_layers * model.q_dim / tp / (flops * efficiency.attn_flops_eff)
    ctx = kv_per_token / (bw * efficiency.mbu_kv)
    per_seq = max(0.0, seqs * t_decode_token - t_w) / seqs
    overhead = efficiency.cpu_overhead_s + t_w

    overhead, t_prefill_token, attn, per_seq, ctx = (_sig(x) for x in (overhead, t_prefill_token, attn, per_seq, ctx))
    decode_ref = _sig(overhead + DECODE_REFERENCE_BATCH * per_seq
                      + DECODE_REFERENCE_BATCH * DECODE_REFERENCE_CONTEXT * ctx)
    name = options.name or f"{model.name}-{gpu.name}"
    eff = efficiency
    model_src = model.source or f"config of {model.name}"
    gpu_src = gpu.sources.get("datasheet", f"GPU spec {gpu.name}")
    sources = {
        "model": model_src,
        "gpu": gpu_src,
        "derivation": "phasewise profile --derive (routerd/profiler/derive.py; docs/profiles.md)",
        "efficiency": (f"mfu {eff.mfu:g}, mbu_weights {eff.mbu_weights:g}, mbu_kv {eff.mbu_kv:g}, attn_flops_eff "
                       f"{eff.attn_flops_eff:g}, cpu_overhead_s {eff.cpu_overhead_s:g}: fitted only to the seven "
                       "Vidur llama2-7b-a100 points (benchmarks/derive_check.py), applied unchanged"),
        "kv_capacity_tokens": ("vLLM V1 gpu_worker.determine_available_memory: gpu_memory_utilization x visible "
                               "memory - weights - activation peak - non-torch (vLLM PR #10511 log) - CUDA graphs "
                               "(captured after the KV cache in V1)"),
        "max_num_seqs": "vLLM EngineArgs.get_batch_defaults (OpenAI API server) for this GPU class",
        "max_num_batched_tokens": "vLLM EngineArgs.get_batch_defaults (OpenAI API server) for this GPU class",
        "chunked_prefill": "vLLM V1 default (enable_chunked_prefill)",
        "prefix_caching": "vLLM V1 default (enable_prefix_caching)",
        "max_model_len": ("--max-model-len" if options.max_model_len
                          else "the model's max_position_embeddings (vLLM's default max_model_len)"),
        "grad1": "the derived prefill slope (prefill_per_token_s), as the shipped profiles set it",
        "grad2": "arXiv 2408.13510 §5.2 (3.3e-5), the mixing estimator's scale (routerd/estimator.py), kept",
        "decode_token_time_s": "the derived decode iteration at 32 requests x 1,024 context tokens",
    }
    if model.is_float32:
        sources["dtype"] = (f"torch_dtype {model.torch_dtype} checkpoint served in 16-bit (2 bytes per weight and "
                            "KV value): vLLM dtype=auto downcasts float32 models (vllm/config/model.py "
                            "_get_and_verify_dtype / _resolve_auto_dtype)")
    if gpu.visible_memory_gib != gpu.memory_gib:
        sources["visible_memory"] = gpu.sources.get("visible_memory_gib", "GPU spec visible_memory_gib")
    fields: dict[str, Any] = dict(
        name=name,
        description=(f"{model.name} on {tp} x {gpu.description or gpu.name} (vLLM V1 defaults, chunked prefill "
                     f"{batched}); derived from the model config and the GPU datasheet, not measured."),
        overhead_s=overhead, prefill_per_token_s=t_prefill_token, prefill_attn_s=attn, decode_per_seq_s=per_seq,
        decode_per_ctx_token_s=ctx, kv_capacity_tokens=capacity, block_size=options.block_size,
        max_num_seqs=seqs, max_num_batched_tokens=batched, chunked_prefill=True, max_model_len=max_len,
        prefix_caching=True, grad1=t_prefill_token, grad2=PAPER_GRAD2, decode_token_time_s=decode_ref,
        heavy_prefill_s=0.5, heavy_decode_s=5.0, sources=sources)
    try:
        profile = HardwareProfile.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "profile"
        raise DeriveError(f"{where}: derived profile field {loc}: {err['msg']}") from None

    fl = flops / 1e12
    numbers = dict(params=model.param_count, kv_bytes_per_token=model.kv_bytes_per_token,
                   weights_gib=weights / GIB, activation_gib=activation / GIB, non_torch_gib=non_torch / GIB,
                   cuda_graph_gib=graphs / GIB, budget_gib=budget / GIB, kv_gib=kv_bytes / GIB, blocks=blocks,
                   t_weights_s=t_w, t_decode_token_s=t_decode_token, knee_batch=t_w / t_decode_token)
    comments = {
        "overhead_s": (f"cpu {eff.cpu_overhead_s:g} s + weight read {weights / 1e9:.3f} GB / "
                       f"({gpu.memory_bandwidth_gb_s:g} GB/s x mbu_weights {eff.mbu_weights:g})"),
        "prefill_per_token_s": (f"2 x {matmul / tp / 1e9:.4f}e9 layer params / ({fl:g} TFLOP/s x "
                                f"mfu {eff.mfu:g})"),
        "prefill_attn_s": (f"2 x {model.num_hidden_layers} layers x {model.q_dim // tp} q dims / ({fl:g} TFLOP/s x "
                           f"attn_flops_eff {eff.attn_flops_eff:g})"),
        "decode_per_seq_s": (f"roofline chord to B={seqs}: ({seqs} x {t_decode_token * 1e6:.2f} us - "
                             f"{t_w * 1e3:.3f} ms) / {seqs}"),
        "decode_per_ctx_token_s": (f"{kv_per_token / 1024:g} KiB KV per token / ({gpu.memory_bandwidth_gb_s:g} GB/s x "
                                   f"mbu_kv {eff.mbu_kv:g})"),
        "kv_capacity_tokens": (f"{blocks} blocks: {options.gpu_memory_utilization:g} x {gpu.visible_memory_gib:g} GiB"
                               f" - {weights / GIB:.2f} weights - {activation / GIB:.2f} activations - "
                               f"{(non_torch + graphs) / GIB:.2f} non-torch = {kv_bytes / GIB:.2f} GiB"),
        "block_size": "vLLM CacheConfig default",
        "max_num_seqs": f"vLLM get_batch_defaults, API server ({gpu.device_name})",
        "max_num_batched_tokens": f"vLLM get_batch_defaults, API server ({gpu.device_name})",
        "chunked_prefill": "vLLM V1 default",
        "max_model_len": ("--max-model-len" if options.max_model_len else "model max_position_embeddings"),
        "prefix_caching": "vLLM V1 default",
        "grad1": "= prefill_per_token_s",
        "grad2": "paper §5.2 value, estimator scale (routerd/estimator.py)",
        "decode_token_time_s": "decode iteration at B=32, 1K context",
        "heavy_prefill_s": "paper §4.2",
        "heavy_decode_s": "paper §4.2",
    }
    return Derivation(profile, model, gpu, options, efficiency, memory, numbers, comments)


_FIELD_ORDER = ["name", "description", "overhead_s", "prefill_per_token_s", "prefill_attn_s", "decode_per_seq_s",
                "decode_per_ctx_token_s", "kv_capacity_tokens", "block_size", "max_num_seqs",
                "max_num_batched_tokens", "chunked_prefill", "max_model_len", "prefix_caching", "grad1", "grad2",
                "decode_token_time_s", "heavy_prefill_s", "heavy_decode_s"]


def derive_command(model_arg: str, gpu_arg: str, options: DeriveOptions, output: str | None = None) -> str:
    """The ``phasewise profile --derive`` command line that makes this profile (for the YAML header)."""
    parts = ["phasewise", "profile", "--derive", model_arg, gpu_arg]
    if options.name:
        parts += ["--name", options.name]
    if options.max_model_len:
        parts += ["--max-model-len", str(options.max_model_len)]
    if options.gpu_memory_utilization != 0.9:
        parts += ["--gpu-memory-utilization", f"{options.gpu_memory_utilization:g}"]
    if options.tensor_parallel != 1:
        parts += ["--tensor-parallel", str(options.tensor_parallel)]
    if options.max_num_seqs:
        parts += ["--max-num-seqs", str(options.max_num_seqs)]
    if options.max_num_batched_tokens:
        parts += ["--max-num-batched-tokens", str(options.max_num_batched_tokens)]
    if output:
        parts += ["--output", output]
    return " ".join(shlex.quote(p) for p in parts)


def _dtype_note(m: ModelConfig) -> str:
    return f"{m.torch_dtype} checkpoint, served in 16-bit" if m.is_float32 else m.torch_dtype


def profile_yaml(d: Derivation, command: str) -> str:
    """The derived profile as YAML: a header with ``command`` and the derivation, each field with its source.

    Deterministic (no dates), so a shipped profile can be checked against a fresh derivation."""
    m, p, n = d.model, d.profile, d.numbers
    lines = [
        f"# {m.name} on {d.options.tensor_parallel} x {d.gpu.name}: DERIVED from the model config and the GPU",
        "# datasheet (not measured). Regenerate with:",
        f"#   {command}",
        "# Derivation and validation: docs/profiles.md; routerd/profiler/derive.py; benchmarks/derive_check.py.",
        f"# Model: {n['params'] / 1e9:.3f}e9 parameters ({_dtype_note(m)}), {m.num_hidden_layers} layers, hidden "
        f"{m.hidden_size}, {m.num_attention_heads} heads / {m.num_key_value_heads} KV heads x {m.head_width}, "
        f"vocab {m.vocab_size};",
        f"#   KV {m.kv_bytes_per_token // 1024} KiB per token = 2 x {m.num_hidden_layers} x "
        f"{m.num_key_value_heads} x {m.head_width} x {m.dtype_bytes} bytes.",
        f"# GPU: {d.gpu.visible_memory_gib:g} GiB visible of {d.gpu.memory_gib:g}, "
        f"{d.gpu.memory_bandwidth_gb_s:g} GB/s, {d.gpu.dense_flops(m.torch_dtype) / 1e12:g} dense TFLOP/s.",
        f"# Memory: {d.options.gpu_memory_utilization:g} x {d.gpu.visible_memory_gib:g} = {n['budget_gib']:.2f} GiB; "
        f"weights {n['weights_gib']:.2f}, activation peak {n['activation_gib']:.2f}, non-torch "
        f"{n['non_torch_gib']:.2f}, CUDA graphs {n['cuda_graph_gib']:.2f}; KV {n['kv_gib']:.2f} GiB.",
        f"# max_model_len {p.max_model_len}: the KV cache holds {p.kv_capacity_tokens / p.max_model_len:.2f} requests "
        f"of that length (vLLM starts only if it holds one).",
        f"# A decode step's linear layers turn compute bound at B = {n['knee_batch']:.0f} "
        f"(weight read {n['t_weights_s'] * 1e3:.3f} ms / {n['t_decode_token_s'] * 1e6:.2f} us per decode token).",
    ]
    data = p.model_dump(mode="json")
    for key in _FIELD_ORDER:
        text = yaml.safe_dump({key: data[key]}, width=10_000, sort_keys=False, allow_unicode=True).rstrip("\n")
        note = d.comments.get(key)
        lines.append(f"{text}  # {note}" if note else text)
    lines.append(yaml.safe_dump({"sources": data["sources"]}, width=10_000, sort_keys=False,
                                allow_unicode=True).rstrip("\n"))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- loaders (I/O)

def _data_dir() -> Path:
    return Path(str(resources.files("routerd") / "data"))


def model_names() -> list[str]:
    """Names of the shipped model configs (``routerd/data/models/*.json``), sorted."""
    return sorted(p.stem for p in (_data_dir() / "models").glob("*.json"))


def gpu_names() -> list[str]:
    """Names of the shipped GPUs (``routerd/data/gpus.yaml``)."""
    return list(_read_gpu_table(_data_dir() / "gpus.yaml"))


def _looks_like_path(arg: str, suffixes: tuple[str, ...]) -> bool:
    return arg.endswith(suffixes) or "/" in arg or "\\" in arg


def _first_error(e: ValidationError, path: Path | str, prefix: str = "") -> DeriveError:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"]) or "config"
    what = "missing" if err["type"] == "missing" else err["msg"]
    return DeriveError(f"{path}: field {prefix}{loc}: {what}")


_LAYER_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "vocab_size")


def load_model_config(name_or_path: str) -> ModelConfig:
    """A shipped model config by name, or a Hugging Face ``config.json`` by path.

    Raises:
        DeriveError: unknown name (lists the shipped ones), unreadable or non-JSON file, a missing,
            invalid or non-finite field, an unknown ``torch_dtype``, or a config the derivation does not
            model: layer fields nested under ``text_config`` (multimodal), mixture of experts, a
            ``quantization_config``, or an enabled ``sliding_window`` (one line naming the file and field).

    An absent or null ``num_key_value_heads`` means multi-head attention (``num_attention_heads``), as
    transformers' ``LlamaConfig`` defaults it.
    """
    if _looks_like_path(name_or_path, (".json",)):
        path = Path(name_or_path)
        name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    else:
        path = _data_dir() / "models" / f"{name_or_path}.json"
        name = name_or_path
        if not path.exists():
            raise DeriveError(f"unknown model config {name_or_path!r}; shipped: {', '.join(model_names())} "
                              "(or give the path of a config.json)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise DeriveError(f"{path}: cannot read model config: {e.strerror}") from None
    except UnicodeDecodeError:
        raise DeriveError(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise DeriveError(f"{path}: not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise DeriveError(f"{path}: a model config must be a JSON object of fields")
    if "torch_dtype" not in data and isinstance(data.get("dtype"), str):
        data["torch_dtype"] = data["dtype"]  # newer transformers write "dtype"
    nested = data.get("text_config")
    if isinstance(nested, dict) and any(k in nested for k in _LAYER_FIELDS):
        raise DeriveError(f"{path}: field text_config: nested (multimodal) configs are not supported by --derive; "
                          "give a text-only decoder's config.json")
    for moe in ("num_local_experts", "num_experts", "n_routed_experts"):
        if data.get(moe):
            raise DeriveError(f"{path}: field {moe}: mixture-of-experts models are not supported by the derivation")
    if data.get("quantization_config") is not None:
        # Weights, KV and kernels would all be sized wrongly at the 16-bit rate.
        raise DeriveError(f"{path}: field quantization_config: quantized checkpoints are not supported by --derive")
    if data.get("sliding_window") is not None and data.get("use_sliding_window", True) is not False:
        # vLLM caps each layer's KV at the window, which the paged-capacity formula does not model.
        # (Qwen2 writes sliding_window with use_sliding_window false; transformers then drops it.)
        raise DeriveError(f"{path}: field sliding_window: sliding-window attention is not supported by --derive "
                          f"(sliding_window={data['sliding_window']!r})")
    dtype = data.get("torch_dtype")
    if isinstance(dtype, str) and dtype not in DTYPE_BYTES:
        raise DeriveError(f"{path}: field torch_dtype: {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    for key in _LAYER_FIELDS + ("max_position_embeddings", "head_dim"):
        # Reject 4096.0, "4096" and Infinity: a config with those is malformed, not a loose spelling.
        v = data.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise DeriveError(f"{path}: field {key}: expected an integer, got {v!r}")
    if data.get("num_key_value_heads") is None and "num_attention_heads" in data:
        data["num_key_value_heads"] = data["num_attention_heads"]  # transformers: no GQA field means MHA
    try:
        model = ModelConfig.model_validate({**data, "name": name, "config_file": str(path)})
    except ValidationError as e:
        raise _first_error(e, path) from None
    if model.head_dim is None and model.hidden_size % model.num_attention_heads:
        raise DeriveError(f"{path}: field num_attention_heads: {model.num_attention_heads} does not divide "
                          f"hidden_size {model.hidden_size} (give head_dim)")
    if model.num_attention_heads % model.num_key_value_heads:
        raise DeriveError(f"{path}: field num_key_value_heads: {model.num_key_value_heads} does not divide "
                          f"num_attention_heads {model.num_attention_heads}")
    return model


def _read_gpu_table(path: Path) -> dict[str, Any]:
    return read_yaml_mapping(path, "GPU spec", DeriveError)


def load_gpu(name_or_path: str) -> GpuSpec:
    """A shipped GPU by name (``routerd/data/gpus.yaml``), or a GPU spec YAML file by path.

    A file holds one GPU's fields (``name`` optional, default the file's stem).

    Raises:
        DeriveError: unknown name (lists the shipped ones), unreadable or invalid file (names the field).
    """
    if _looks_like_path(name_or_path, (".yaml", ".yml")):
        path = Path(name_or_path)
        data = _read_gpu_table(path)
        data = {"name": path.stem, **data}
        prefix = ""
    else:
        path = _data_dir() / "gpus.yaml"
        table = _read_gpu_table(path)
        if name_or_path not in table:
            raise DeriveError(f"unknown GPU {name_or_path!r}; shipped: {', '.join(table)} "
                              "(or give the path of a GPU spec YAML, see docs/profiles.md)")
        data = {"name": name_or_path, **table[name_or_path]}
        prefix = f"{name_or_path}."
    try:
        gpu = GpuSpec.model_validate(data)
    except ValidationError as e:
        raise _first_error(e, path, prefix) from None
    if not math.isfinite(gpu.visible_memory_gib) or gpu.visible_memory_gib > gpu.memory_gib:
        raise DeriveError(f"{path}: field {prefix}visible_memory_gib: {gpu.visible_memory_gib:g} exceeds memory_gib "
                          f"{gpu.memory_gib:g}")
    return gpu
