"""``phasewise profile``: measure an OpenAI-compatible endpoint, or derive from a model config and a GPU's
specs (:mod:`routerd.profiler.derive`), and write a hardware profile."""

from __future__ import annotations

import argparse
import asyncio
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable

from routerd.errors import ConfigError


@dataclass
class ProfileResult:
    """Everything one profiling run produced."""

    profile: Any
    """The :class:`routerd.profiles.HardwareProfile` written."""
    yaml_text: str
    decode: Any
    """:class:`routerd.profiler.fit.Fit` of the decode terms."""
    prefill: Any
    decode_points: list = field(default_factory=list)
    prefill_points: list = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0


async def profile_endpoint(endpoint: str, *, model: str | None = None, plan=None, base_profile: str | None = None,
                           name: str | None = None, overrides: dict[str, Any] | None = None,
                           command: str = "phasewise profile", log: Callable[[str], None] = print) -> ProfileResult:
    """Profile ``endpoint`` (base URL of an OpenAI-compatible server) and build the profile.

    Args:
        plan: a :class:`routerd.profiler.plan.MeasurementPlan` (default: :func:`default_plan`).
        base_profile: shipped name or YAML path supplying what cannot be measured.
        overrides: profile fields that win over the endpoint and the base (from flags).

    Raises:
        ConfigError: unreachable or non-OpenAI endpoint, unknown model, a server that
            misbehaves while profiled, or a profile that fails validation.
    """
    import time

    from routerd.cli import DEFAULT_PROFILE
    from routerd.profiler.client import ProfilerClient
    from routerd.profiler.fit import FitError, fit_decode, fit_prefill
    from routerd.profiler.measure import Measurer
    from routerd.profiler.plan import default_plan
    from routerd.profiler.writer import build_profile, profile_yaml
    from routerd.profiles import ProfileError, get_profile

    t0 = time.perf_counter()
    try:
        base = get_profile(base_profile or DEFAULT_PROFILE)
    except ProfileError as e:
        raise ConfigError(f"--base-profile: {e}") from None
    plan = plan or default_plan()
    async with ProfilerClient(endpoint) as client:
        info = await client.discover(model)
        sched = ", ".join(f"{k} {v}" for k, v in info.scheduler.items()) or "not served"
        log(f"profiling {info.model!r} at {info.base_url} (max_model_len {info.max_model_len or 'unknown'}, "
            f"KV {info.kv_capacity_tokens or 'unknown'} tokens, block size {info.block_size or 'unknown'}, vLLM "
            f"metrics {'yes' if info.has_metrics else 'no'}, scheduler: {sched})")
        m = Measurer(client, info, plan, log)
        got = await m.prompts.calibrate(client, info.model)
        log(f"calibration: a 1000-token prompt is {got} server tokens ({m.prompts.ratio:.3f} tokens per 4 bytes "
            f"+ {m.prompts.offset:.1f})")
        log("prefill batches beside a probe request:")
        prefill_pts, pre = await _measured(m.measure_prefill, fit_prefill, "prefill_per_token_s", "prefill", m, log)
        log("decode batches:")
        decode_pts, dec = await _measured(m.measure_decode, fit_decode, None, "decode", m, log)
    if isinstance(pre, FitError) or isinstance(dec, FitError):
        e = pre if isinstance(pre, FitError) else dec
        raise ConfigError(f"--endpoint {endpoint}: {e}; notes: {'; '.join(m.notes) or 'none'}") from None
    m.notes += [f.note for f in (dec, pre) if f.note]
    found: dict[str, Any] = {}
    if info.max_model_len is not None:
        found["max_model_len"] = info.max_model_len
    if info.kv_capacity_tokens is not None:
        found["kv_capacity_tokens"] = info.kv_capacity_tokens
        found["block_size"] = info.block_size
    found.update(info.scheduler)
    found.update(overrides or {})
    prof_name = name or re.sub(r"[^A-Za-z0-9._-]+", "-", info.model).strip("-") + "-profiled"
    profile = build_profile(prof_name, info.base_url, info.model, dec, pre, base, found,
                            from_endpoint=[k for k in found if k not in (overrides or {})])
    text = profile_yaml(profile, plan, decode_pts, prefill_pts, dec, pre, m.notes, command)
    return ProfileResult(profile, text, dec, pre, decode_pts, prefill_pts, m.notes, time.perf_counter() - t0)


async def _measured(measure, fit, key: str | None, what: str, m, log):
    """``(points, fit)`` of one phase, measured again once when its points cannot be fitted or
    the fit finds no ``key`` term (when given; a real engine on a few shared cores sometimes
    gives a whole phase of points spoilt by other load); the fit is a :class:`FitError` when
    both fail."""
    from routerd.profiler.fit import FitError

    for attempt in range(2):
        points = await measure()
        try:
            got = fit(points)
        except FitError as e:
            got = e
        if not isinstance(got, FitError) and (key is None or got.value(key) > 0):
            return points, got
        why = str(got) if isinstance(got, FitError) else f"the fit found {key} = 0"
        if attempt == 0:
            m.notes.append(f"{what} points measured again: {why}")
            log(f"{what} points unusable ({why}); measuring them again:")
    if not isinstance(got, FitError):
        got = FitError(f"{what} fit: {key} came out 0 twice (the endpoint's {what} time did not grow as "
                       "expected; is it caching prompts, or is the machine too loaded to time it?)")
    return points, got


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``profile`` subcommand."""
    p = sub.add_parser(
        "profile",
        help="measure an OpenAI-compatible endpoint (vLLM or the emulator), or derive from a model config and "
             "a GPU's specs, and write a hardware profile",
        description="With --endpoint: send decode-heavy batches (B concurrent requests, long outputs) and "
        "prefill-heavy batches (N prompts of L tokens beside a probe request) to the endpoint, time the streamed "
        "tokens, fit overhead, prefill and decode terms by least squares and write a hardware-profile YAML "
        "(loadable with --profile) whose header records the plan, every point and its residual. Prompts carry "
        "random prefixes, so prefix caching does not hide prefill cost. With --derive MODEL_CONFIG GPU: derive "
        "the profile from a Hugging Face config.json (or a shipped model name) and a GPU's datasheet numbers "
        "(a shipped GPU name or a YAML file) with stated efficiency factors (docs/profiles.md); prints the YAML "
        "or writes --output.",
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--endpoint", default=None, help="base URL of the server, e.g. http://127.0.0.1:8000")
    mode.add_argument("--derive", nargs=2, metavar=("MODEL_CONFIG", "GPU"), default=None,
                      help="derive instead of measuring: MODEL_CONFIG is a shipped model name ("
                           + ", ".join(_shipped("model")) + ") or a config.json path; GPU a shipped GPU name ("
                           + ", ".join(_shipped("gpu")) + ") or a GPU spec YAML path")
    p.add_argument("--model", default=None, help="served model to profile (default: the first of /v1/models)")
    p.add_argument("--output", "-o", default=None,
                   help="profile YAML to write (required with --endpoint; with --derive the YAML is printed "
                        "when absent)")
    p.add_argument("--name", default=None, help="profile name (default: <model>-profiled)")
    p.add_argument("--base-profile", default=None,
                   help="profile supplying what the endpoint does not report: grad2, heavy thresholds, and "
                        "max_num_seqs, max_num_batched_tokens, chunked_prefill unless vLLM's development "
                        "endpoint /server_info serves them (default: the project's default profile)")
    p.add_argument("--quick", action="store_true", help="a shorter plan (fewer, smaller batches)")
    p.add_argument("--max-batch-tokens", type=int, default=2000,
                   help="largest prefill batch in tokens; keep it under the server's max_num_batched_tokens "
                        "(default 2000, under vLLM's smallest default budget of 2048)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="the server's max_num_seqs (profile field)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the server's max_num_batched_tokens (profile field)")
    p.add_argument("--chunked-prefill", choices=("true", "false"), default=None,
                   help="whether the server chunks prefills (profile field)")
    p.add_argument("--kv-capacity-tokens", type=int, default=None,
                   help="KV-cache capacity in tokens, when the endpoint's /metrics does not tell (--endpoint only)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="--derive: longest request in tokens (default: the model's max_position_embeddings, as "
                        "vLLM); an error when the derived KV capacity cannot hold it")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="--derive: vLLM's gpu_memory_utilization (default 0.9)")
    p.add_argument("--tensor-parallel", type=int, default=None,
                   help="--derive: GPUs per instance, vLLM tensor_parallel_size (default 1; all-reduce time is "
                        "not modelled)")


def _shipped(kind: str) -> list[str]:
    from routerd.profiler.derive import gpu_names, model_names

    try:
        return model_names() if kind == "model" else gpu_names()
    except Exception:  # a broken data file must not break the parser; --derive reports it
        return []


def _output_path(output: str):
    """``--output`` as a :class:`~pathlib.Path`, checked before any work: it must name a file, and the
    nearest existing folder above it must be a folder.

    Raises:
        ConfigError: empty, a folder (or ending in a separator), or below an existing file."""
    import os
    from pathlib import Path

    if not output or output.endswith(("/", os.sep)) or Path(output).is_dir():
        raise ConfigError(f"--output must name a file, got {output!r}")
    out = Path(output)
    for parent in out.parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise ConfigError(f"--output {out}: {parent} is a file, not a directory")
            break
    return out


_ENDPOINT_ONLY = ("model", "base_profile", "quick", "kv_capacity_tokens", "chunked_prefill")
_DERIVE_ONLY = ("max_model_len", "gpu_memory_utilization", "tensor_parallel")


def run_derive(args: argparse.Namespace) -> int:
    """``phasewise profile --derive MODEL_CONFIG GPU``: print the derived profile YAML or write ``--output``.

    The file is written to a temporary file beside it and renamed, so a failure leaves no partial file.

    Raises:
        ConfigError: an endpoint-only flag, an ``--output`` that names no file or lies below a file, an
            unknown or invalid model config or GPU (names the file and field), or a profile vLLM would
            refuse (e.g. KV capacity below ``--max-model-len``).
    """
    import os
    import tempfile

    from pydantic import ValidationError

    from routerd.profiler.derive import DeriveOptions, derive_command, derive_profile, load_gpu, load_model_config
    from routerd.profiles import load_profile_file

    for flag in _ENDPOINT_ONLY:
        if getattr(args, flag) not in (None, False):
            raise ConfigError(f"--{flag.replace('_', '-')} applies to --endpoint, not --derive")
    if args.max_batch_tokens != 2000:
        raise ConfigError("--max-batch-tokens applies to --endpoint, not --derive")
    model_arg, gpu_arg = args.derive
    out = None if args.output is None else _output_path(args.output)
    try:
        options = DeriveOptions(
            name=args.name, max_model_len=args.max_model_len,
            gpu_memory_utilization=0.9 if args.gpu_memory_utilization is None else args.gpu_memory_utilization,
            tensor_parallel=1 if args.tensor_parallel is None else args.tensor_parallel,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    except ValidationError as e:
        err = e.errors()[0]
        flag = "--" + str(err["loc"][0]).replace("_", "-")
        raise ConfigError(f"{flag}: {err['msg']} (got {err.get('input')!r})") from None
    model = load_model_config(model_arg)
    gpu = load_gpu(gpu_arg)
    derivation = derive_profile(model, gpu, options)
    from routerd.profiler.derive import profile_yaml

    text = profile_yaml(derivation, derive_command(model_arg, gpu_arg, options, args.output))
    if out is None:
        print(text, end="")
        return 0
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    except OSError as e:
        raise ConfigError(f"--output {out}: cannot write ({e.strerror})") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        load_profile_file(tmp)  # what is renamed into place loads
        os.replace(tmp, out)
    except OSError as e:
        raise ConfigError(f"--output {out}: cannot write ({e.strerror})") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    p = derivation.profile
    print(f"derived {p.name}: KV {p.kv_capacity_tokens} tokens, max_model_len {p.max_model_len}, overhead_s "
          f"{p.overhead_s:.4g}, prefill_per_token_s {p.prefill_per_token_s:.4g}, prefill_attn_s "
          f"{p.prefill_attn_s:.4g}, decode_per_seq_s {p.decode_per_seq_s:.4g}, decode_per_ctx_token_s "
          f"{p.decode_per_ctx_token_s:.4g}")
    print(f"wrote {out}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Profile (``--endpoint``) or derive (``--derive``), write ``--output``, print a summary; returns 0.

    Raises :class:`ConfigError` on bad input."""
    from routerd.profiler.plan import default_plan, quick_plan
    from routerd.profiler.writer import write_profile

    if getattr(args, "derive", None) is not None:
        return run_derive(args)
    for flag in _DERIVE_ONLY:
        if getattr(args, flag, None) is not None:
            raise ConfigError(f"--{flag.replace('_', '-')} applies to --derive, not --endpoint")
    if args.output is None:
        raise ConfigError("--output is required with --endpoint")
    if args.max_batch_tokens < 64:
        raise ConfigError(f"--max-batch-tokens must be >= 64, got {args.max_batch_tokens}")
    for flag in ("max_num_seqs", "max_num_batched_tokens", "kv_capacity_tokens"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if not re.match(r"^https?://[^/\s]+", args.endpoint):
        raise ConfigError(f"--endpoint {args.endpoint!r}: expected an http(s) URL such as http://127.0.0.1:8000")
    overrides: dict[str, Any] = {}
    for flag in ("max_num_seqs", "max_num_batched_tokens", "kv_capacity_tokens"):
        if getattr(args, flag) is not None:
            overrides[flag] = getattr(args, flag)
    if args.chunked_prefill is not None:
        overrides["chunked_prefill"] = args.chunked_prefill == "true"
    plan = (quick_plan if args.quick else default_plan)(args.max_batch_tokens)
    command = "phasewise profile " + " ".join(
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {shlex.quote(str(v))}")
        for k, v in vars(args).items() if k != "command" and v not in (None, False))
    res = asyncio.run(profile_endpoint(args.endpoint, model=args.model, plan=plan, base_profile=args.base_profile,
                                       name=args.name, overrides=overrides, command=command))
    write_profile(args.output, res.yaml_text)
    p = res.profile
    print(f"fitted in {res.elapsed_s:.1f} s: overhead_s {p.overhead_s:.4g}, prefill_per_token_s (grad1) "
          f"{p.prefill_per_token_s:.4g}, prefill_attn_s {p.prefill_attn_s:.4g}, decode_per_seq_s "
          f"{p.decode_per_seq_s:.4g}, decode_per_ctx_token_s {p.decode_per_ctx_token_s:.4g}")
    print(f"residuals: decode rms {res.decode.rms_s * 1e3:.3f} ms, prefill rms {res.prefill.rms_s * 1e3:.3f} ms")
    for n in res.notes:
        print(f"note: {n}")
    print(f"wrote {args.output}")
    return 0
