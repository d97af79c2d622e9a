"""Profiler accuracy: profile emulators of the shipped profiles and compare with what they simulate.

For each profile, starts ``phasewise emulate --profile NAME`` on loopback, runs the
profiler (``phasewise profile``'s measurement plan) against it, and prints the
configured and fitted latency terms with their relative errors:

* ``prefill_per_token_s`` is the paper's ``grad1`` (prefill seconds per prompt token);
* ``decode_per_seq_s`` is the decode seconds per sequence per iteration (what the
  issue calls ``grad2``; the profile field named ``grad2`` is the mixing estimator's
  scale, which timing cannot reveal);
* ``overhead_s`` is the per-iteration overhead.

Target (issue #5): ``grad1`` and ``grad2`` within 10 %.
Usage: python benchmarks/profiler_accuracy.py [--quick] [--profiles llama2-7b-a100,llama2-7b-v100]
"""

from __future__ import annotations

import argparse
import asyncio

from routerd.emulator.process import EmulatorProcess
from routerd.profiler.cli import profile_endpoint
from routerd.profiler.plan import default_plan, quick_plan
from routerd.profiles import get_profile

FIELDS = [("prefill_per_token_s", "grad1"), ("decode_per_seq_s", "grad2 (s/seq/iter)"),
          ("overhead_s", "overhead"), ("decode_per_ctx_token_s", ""), ("prefill_attn_s", "")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profiles", default="llama2-7b-a100,llama2-7b-v100")
    ap.add_argument("--quick", action="store_true", help="the profiler's --quick plan")
    ap.add_argument("--verbose", action="store_true", help="print every batch")
    args = ap.parse_args()
    worst: dict[str, float] = {}
    for name in args.profiles.split(","):
        true = get_profile(name)
        plan = quick_plan() if args.quick else default_plan()
        with EmulatorProcess("--port", "0", "--profile", name) as emu:
            res = asyncio.run(profile_endpoint(emu.url, plan=plan, base_profile=name,
                                               log=print if args.verbose else (lambda _m: None)))
        fit = res.profile
        print(f"\n{name}: profiled in {res.elapsed_s:.1f} s ({'quick' if args.quick else 'default'} plan; "
              f"decode rms residual {res.decode.rms_s * 1e3:.3f} ms, prefill {res.prefill.rms_s * 1e3:.3f} ms)")
        print(f"  {'field':<46} {'configured':>12} {'fitted':>12} {'error':>8}")
        for field, alias in FIELDS:
            c, f = getattr(true, field), getattr(fit, field)
            label = f"{field}" + (f" = {alias}" if alias else "")
            if c == 0:
                print(f"  {label:<46} {c:>12.4g} {f:>12.4g} {'(zero)':>8}")
                continue
            err = f / c - 1
            worst[field] = max(worst.get(field, 0.0), abs(err))
            print(f"  {label:<46} {c:>12.4g} {f:>12.4g} {err:>+8.2%}")
        for note in res.notes:
            print(f"  note: {note}")
    ok = worst["prefill_per_token_s"] < 0.10 and worst["decode_per_seq_s"] < 0.10
    print(f"\ntarget grad1 and grad2 within 10%: {'met' if ok else 'MISSED'} (worst grad1 "
          f"{worst['prefill_per_token_s']:.2%}, grad2 {worst['decode_per_seq_s']:.2%}, overhead "
          f"{worst['overhead_s']:.2%})")


if __name__ == "__main__":
    main()
