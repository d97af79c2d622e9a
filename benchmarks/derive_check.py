"""Validate ``phasewise profile --derive`` (routerd/profiler/derive.py) against published numbers.

1. The seven Vidur calibration points of the shipped ``llama2-7b-a100`` profile (its header
   comment; vllm-and-simulators.md §6.1, microsoft/vidur data/profiling/compute/a100/
   meta-llama/Llama-2-7b-hf/{mlp,attention}.csv), predicted by the DERIVED Llama-2-7B / A100-80GB
   profile; the deviation of each in %. The efficiency factors (derive.Efficiency) were fitted to
   these seven points only; ``--fit`` redoes that fit (weighted least squares on relative error,
   linear in 1/efficiency) and prints it beside the shipped, rounded factors.
2. KV capacity of Llama-2-7B / A100-80GB against vLLM's own count and Vidur's planner (not fitted).
3. Published vLLM figures for Llama-3.1-8B on H100 and A100 (not fitted; the factors are applied
   unchanged): decode iteration = TPOT at a steady concurrency.

Usage: python benchmarks/derive_check.py [--fit]
"""

from __future__ import annotations

import argparse
from pathlib import Path
import sys

import numpy as np

from routerd.profiler.derive import (DEFAULT_EFFICIENCY, DeriveOptions, Efficiency, derive_profile, load_gpu,
                                     load_model_config)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibration import A100_POINTS as VIDUR_A100_LLAMA2_7B  # noqa: E402  (label, kind, x, context, published s)

# (label, model, gpu, batch, context per request, published TPOT s, source)
PUBLISHED_VLLM = [
    ("Llama-3.1-8B H100, concurrency 1", "llama-3.1-8b-instruct", "h100-80gb-sxm", 1, 300, 0.0065,
     "yobitelcomm.github.io/bench/recipes/concurrency-sweep (vLLM 0.21, short chat prompts; TPOT p50)"),
    ("Llama-3.1-8B H100, concurrency 4", "llama-3.1-8b-instruct", "h100-80gb-sxm", 4, 300, 0.0066,
     "same sweep"),
    ("Llama-3.1-8B H100, concurrency 16", "llama-3.1-8b-instruct", "h100-80gb-sxm", 16, 300, 0.0109,
     "same sweep (TPOT includes chunked prefills of arriving requests)"),
    ("Llama-3.1-8B A100-40GB, concurrency 1", "llama-3.1-8b-instruct", "a100-40gb-sxm", 1, 1088, 1 / 75,
     "johnmusgrave.com/p/vllm-throughput-latency-sweep-on (vLLM 0.23, 1024 in / 128 out, ~75 tokens/s)"),
]

VLLM_BLOCKS_LLAMA2_7B_A100 = 7351
"""``# GPU blocks: 7351`` for Llama2-7B, TP 1, A100-80GB, gpu_memory_utilization 0.9 (vllm-project/vllm PR #2031,
Dec 2023, V0 profiler)."""
VIDUR_BLOCKS_LLAMA2_7B_A100 = 7424
"""Vidur's memory planner: 29 requests of 4,096 tokens (vllm-and-simulators.md §3.5)."""


def dev(x: float, ref: float) -> str:
    return f"{100 * (x - ref) / ref:+.1f}%"


def predict(profile, kind: str, x: int, ctx: int) -> float:
    return profile.prefill_time(x) if kind == "prefill" else profile.decode_time(x, x * ctx)


def fit_efficiency() -> Efficiency:
    """Efficiency factors fitted to the Vidur points only (cpu_overhead_s = 0: Vidur times are kernel-only).

    Every term is a unit cost divided by one efficiency, so with ``u = 1/efficiency`` the prediction
    is linear in ``u`` (the decode chord too, where it is positive): weighted least squares on
    relative error, ``min sum ((t(u) - t_ref) / t_ref)^2``."""
    model, gpu = load_model_config("llama-2-7b"), load_gpu("a100-80gb-sxm")
    unit = derive_profile(model, gpu, DeriveOptions(),
                          Efficiency(mfu=1, mbu_weights=1, mbu_kv=1, attn_flops_eff=1, cpu_overhead_s=0))
    seqs = unit.profile.max_num_seqs
    t_w, t_dec = unit.numbers["t_weights_s"], unit.numbers["t_decode_token_s"]
    p = unit.profile
    rows, refs = [], []
    for _, kind, x, ctx, ref in VIDUR_A100_LLAMA2_7B:
        if kind == "prefill":
            row = [t_w, x * p.prefill_per_token_s, x * x * p.prefill_attn_s, 0.0]
        else:
            # chord: B * (t_dec * u_mfu - t_w * u_w / seqs)
            row = [t_w * (1 - x / seqs), x * t_dec, 0.0, x * ctx * p.decode_per_ctx_token_s]
        rows.append([v / ref for v in row])
        refs.append(1.0)
    u, *_ = np.linalg.lstsq(np.array(rows), np.array(refs), rcond=None)
    u_w, u_f, u_a, u_kv = u
    if seqs * t_dec * u_f <= t_w * u_w:
        raise SystemExit("fit left the roofline chord's positive branch; the linear fit does not apply")
    return Efficiency(mbu_weights=1 / u_w, mfu=1 / u_f, attn_flops_eff=1 / u_a, mbu_kv=1 / u_kv, cpu_overhead_s=0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="redo the efficiency fit and compare with the shipped factors")
    args = ap.parse_args(argv)
    eff = DEFAULT_EFFICIENCY
    print(f"efficiency factors (derive.Efficiency defaults): mfu {eff.mfu}, mbu_weights {eff.mbu_weights}, "
          f"mbu_kv {eff.mbu_kv}, attn_flops_eff {eff.attn_flops_eff}, cpu_overhead_s {eff.cpu_overhead_s}")
    if args.fit:
        f = fit_efficiency()
        print(f"  refitted to the 7 Vidur points: mfu {f.mfu:.4f}, mbu_weights {f.mbu_weights:.4f}, "
              f"mbu_kv {f.mbu_kv:.4f}, attn_flops_eff {f.attn_flops_eff:.4f}")

    llama2, a100 = load_model_config("llama-2-7b"), load_gpu("a100-80gb-sxm")
    d = derive_profile(llama2, a100)
    print("\n1. Derived Llama-2-7B / A100-80GB vs the Vidur points of llama2-7b-a100 (factors fitted to these)")
    worst = 0.0
    for label, kind, x, ctx, ref in VIDUR_A100_LLAMA2_7B:
        t = predict(d.profile, kind, x, ctx)
        worst = max(worst, abs(t - ref) / ref)
        print(f"  {label:32} derived {1000 * t:7.1f} ms   Vidur {1000 * ref:6.1f} ms   {dev(t, ref)}")
    print(f"  worst deviation {100 * worst:.1f}%")

    blocks = d.profile.num_blocks
    print("\n2. KV capacity, Llama-2-7B / A100-80GB, gpu_memory_utilization 0.9 (not fitted)")
    print(f"  derived {blocks} blocks ({d.profile.kv_capacity_tokens} tokens); vLLM PR #2031 logged "
          f"{VLLM_BLOCKS_LLAMA2_7B_A100} ({dev(blocks, VLLM_BLOCKS_LLAMA2_7B_A100)}); Vidur planner "
          f"{VIDUR_BLOCKS_LLAMA2_7B_A100} ({dev(blocks, VIDUR_BLOCKS_LLAMA2_7B_A100)})")
    m = d.numbers
    print(f"  weights {m['weights_gib']:.2f} GiB, activations "
          f"{m['activation_gib']:.2f} GiB, non-torch {m['non_torch_gib']:.2f} GiB")
    l3 = derive_profile(load_model_config("llama-3.1-8b-instruct"), load_gpu("h100-80gb-sxm"),
                        DeriveOptions(max_model_len=8192, max_num_seqs=256))
    print(f"  Llama-3(.1)-8B / 80 GB GPU, 8,192 tokens, 256 seqs (V0's profile run): weights "
          f"{l3.numbers['weights_gib']:.2f} GiB (vLLM PR #10511: 14.96), activations "
          f"{l3.numbers['activation_gib']:.2f} GiB (1.26), KV {l3.numbers['kv_gib']:.2f} GiB (53.29, "
          f"{dev(l3.numbers['kv_gib'], 53.29)})")

    print("\n3. Published vLLM TPOT, Llama-3.1-8B (factors applied unchanged; decode-only iteration)")
    for label, model, gpu, batch, ctx, ref, src in PUBLISHED_VLLM:
        p = derive_profile(load_model_config(model), load_gpu(gpu)).profile
        t = p.decode_time(batch, batch * ctx)
        print(f"  {label:38} derived {1000 * t:6.2f} ms  published {1000 * ref:6.2f} ms  {dev(t, ref):>7}  ({src})")


if __name__ == "__main__":
    main()
