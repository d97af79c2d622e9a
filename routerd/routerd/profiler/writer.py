"""Turn fits into a hardware profile and write it as commented YAML.

Measured: ``overhead_s``, ``prefill_per_token_s`` (= ``grad1``, the paper's prefill
slope, as in the shipped profiles), ``prefill_attn_s``, ``decode_per_seq_s``,
``decode_per_ctx_token_s``; ``decode_token_time_s`` is the fitted decode iteration at
32 sequences of 1,024 context tokens (the shipped A100 profile's reference point).
Read from the endpoint when it serves them: ``max_model_len`` (vLLM's
``/v1/models`` card), the KV capacity and block size (``vllm:cache_config_info``), and
the scheduler limits ``max_num_seqs``, ``max_num_batched_tokens`` and ``chunked_prefill``
(``scheduler_config`` of ``GET /server_info?config_format=json``, which vLLM serves only
in development mode, ``VLLM_SERVER_DEV_MODE=1``). Taken from a base profile (or flags):
the scheduler limits when not served, and ``grad2`` and the heavy thresholds, which are
the mixing estimator's scales (paper §5.2), not latencies, so no timing measurement can
recover them.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from routerd.errors import ConfigError
from routerd.profiler.fit import Fit
from routerd.profiler.measure import DecodePoint, PrefillPoint
from routerd.profiler.plan import MeasurementPlan
from routerd.profiles import HardwareProfile, load_profile_file

_FIELD_ORDER = ["name", "description", "overhead_s", "prefill_per_token_s", "prefill_attn_s", "decode_per_seq_s",
                "decode_per_ctx_token_s", "kv_capacity_tokens", "block_size", "max_num_seqs",
                "max_num_batched_tokens", "chunked_prefill", "max_model_len", "grad1", "grad2",
                "decode_token_time_s", "heavy_prefill_s", "heavy_decode_s", "sources"]


def build_profile(name: str, endpoint: str, model: str, decode: Fit, prefill: Fit, base: HardwareProfile,
                  overrides: dict[str, Any], from_endpoint: list[str] | None = None) -> HardwareProfile:
    """The profile from the fits, endpoint facts and flags (``overrides``) and ``base`` for the rest.

    ``from_endpoint`` names the ``overrides`` the endpoint reported (default: all of them), for
    the ``sources`` map.

    Raises:
        ConfigError: the combination is not a valid profile (message names the field).
    """
    k_pf = prefill.value("prefill_per_token_s")
    if k_pf <= 0:
        raise ConfigError("the prefill fit found no cost per prompt token; the endpoint's prefill time did not "
                          "grow with prompt length (is it caching prompts?)")
    fields = base.model_dump()
    fields.update(
        name=name,
        description=f"{model} at {endpoint}, profiled by phasewise profile on "
                    f"{_dt.date.today().isoformat()}",
        overhead_s=decode.value("overhead_s"),
        prefill_per_token_s=k_pf,
        prefill_attn_s=prefill.value("prefill_attn_s"),
        decode_per_seq_s=decode.value("decode_per_seq_s"),
        decode_per_ctx_token_s=decode.value("decode_per_ctx_token_s"),
        grad1=k_pf,
    )
    fields.update(overrides)
    endpoint_facts = {k: v for k, v in overrides.items() if from_endpoint is None or k in from_endpoint}
    fields["decode_token_time_s"] = (fields["overhead_s"] + 32 * fields["decode_per_seq_s"]
                                     + 32 * 1024 * fields["decode_per_ctx_token_s"])
    fields["sources"] = {
        "latency": f"phasewise profile of {endpoint} (model {model}): least squares over "
                   f"{len(decode.residuals)} decode windows (rms residual {decode.rms_s * 1e3:.3f} ms) and "
                   f"{len(prefill.residuals)} prefill batches (rms residual {prefill.rms_s * 1e3:.3f} ms)",
        "grad1": "the fitted prefill slope (prefill_per_token_s)",
        "decode_token_time_s": "fitted decode iteration at 32 sequences x 1,024 context tokens",
        **{k: f"read from the endpoint ({v})" for k, v in _endpoint_sources(endpoint_facts).items()},
        "grad2": f"mixing-estimator scale from base profile {base.name!r} (not a latency; not measurable)",
    }
    limits = [k for k in _SCHEDULER if k not in endpoint_facts]
    if limits:
        fields["sources"]["scheduler limits"] = (f"{', '.join(limits)} from base profile {base.name!r} or flags "
                                                 "(not reported by the endpoint)")
    try:
        return HardwareProfile.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "profile"
        raise ConfigError(f"profile field {loc}: {err['msg']} (fix it with the matching flag or --base-profile)") \
            from None


_SCHEDULER = ("max_num_seqs", "max_num_batched_tokens", "chunked_prefill")


def _endpoint_sources(facts: dict[str, Any]) -> dict[str, str]:
    src = {}
    for k in ("max_model_len", "kv_capacity_tokens", "block_size") + _SCHEDULER:
        if k in facts:
            src[k] = {"max_model_len": "/v1/models", "kv_capacity_tokens": "vllm:cache_config_info",
                      "block_size": "vllm:cache_config_info"}.get(k, "/server_info scheduler_config")
    return src


def profile_yaml(profile: HardwareProfile, plan: MeasurementPlan, decode_pts: list[DecodePoint],
                 prefill_pts: list[PrefillPoint], decode: Fit, prefill: Fit, notes: list[str],
                 command: str) -> str:
    """The profile as YAML, headed by comments recording the plan, every point and its residual."""
    lines = [
        f"# Hardware profile measured by: {command}",
        f"# on {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')}.",
        "# Latency model (routerd/profiles.py): iteration = overhead_s + prefill_per_token_s*P",
        "#   + prefill_attn_s*sum c*(kv+c) + decode_per_seq_s*B + decode_per_ctx_token_s*S.",
        "# Plan: " + plan.model_dump_json(),
        "#",
        f"# Decode windows (iteration time = overhead + k_seq*B + k_ctx*S; from: the engine's inter-token "
        "latency histogram, or this client's read times), rms residual "
        f"{decode.rms_s * 1e3:.4f} ms, max relative {decode.max_rel:.2%}:",
        "#   B     prompt  context_S   gap_ms    residual_ms  tokens  from    reads_gap_ms",
    ]
    for k, (p, r) in enumerate(zip(decode_pts, decode.residuals)):
        reads = f"{p.reads_gap_s * 1e3:.4f}" if p.reads_gap_s else "-"
        lines.append(f"#   {p.batch:<5d} {p.prompt_tokens:<7d} {p.context_tokens:<11.0f} {p.gap_s * 1e3:<9.4f} "
                     f"{r * 1e3:<+12.4f} {p.window_tokens:<7d} {p.source:<7} {reads}"
                     f"{'  (outlier, not fitted)' if k in decode.dropped else ''}")
    lines += [
        "#",
        f"# Prefill batches beside a probe (excess = k_pf*P + k_attn*sum L^2), rms residual "
        f"{prefill.rms_s * 1e3:.4f} ms, max relative {prefill.max_rel:.2%}:",
        "#   N     P_tokens  sum_L2        excess_ms  residual_ms  iterations  baseline_ms",
    ]
    for k, (p, r) in enumerate(zip(prefill_pts, prefill.residuals)):
        lines.append(f"#   {p.requests:<5d} {p.prefill_tokens:<9d} {p.attn_tokens2:<13.0f} {p.excess_s * 1e3:<10.3f} "
                     f"{r * 1e3:<+12.4f} {p.iterations:<11d} {p.baseline_s * 1e3:.3f}"
                     f"{'  (outlier, not fitted)' if k in prefill.dropped else ''}")
    for n in notes:
        lines.append(f"# Note: {n}")
    data = profile.model_dump(mode="json")
    ordered = {k: data[k] for k in _FIELD_ORDER if k in data}
    body = yaml.safe_dump(ordered, sort_keys=False, width=120)
    return "\n".join(lines) + "\n" + body


def write_profile(path: str | Path, text: str) -> HardwareProfile:
    """Write ``text`` to ``path`` and load it back with :func:`routerd.profiles.load_profile_file`.

    Raises:
        ConfigError: the file cannot be written (names ``--output``).
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--output {path}: cannot write ({e.strerror})") from None
    return load_profile_file(path)
