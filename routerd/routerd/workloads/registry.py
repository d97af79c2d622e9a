"""Workloads by name: the bundled sample, the shared traces, the generators, or a file path.

``load_workload("sample")`` needs nothing outside the package. Every other named
workload reads the shared data directory (``shared/data``, see its ``PROVENANCE.md``),
found by :func:`resolve_data_dir`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from routerd.model import Request

from .conversations import describe as describe_conversations
from .conversations import conversations, parse_conversations_spec
from .errors import WorkloadError
from .paper_mix import paper_mix
from .public_mix import DEFAULT_ALPACA_MODEL, public_mix_groups, public_mix
from .shared_prefix import describe as describe_shared_prefix
from .shared_prefix import parse_shared_prefix_spec, shared_prefix
from .traces import load_azure_csv, load_mooncake_jsonl, mean_rate, rescale_to_rate

#: Named workloads, the default first.
WORKLOAD_NAMES: tuple[str, ...] = (
    "sample", "azure-conv", "azure-code", "mooncake", "public-mix", "paper-mix", "shared-prefix",
    "conversations",
)
#: Names of the generated workloads (they take ``n`` and ``seed``).
GENERATOR_NAMES: tuple[str, ...] = ("public-mix", "paper-mix", "shared-prefix", "conversations")
#: ``shared-prefix:SPEC`` passes a preset and/or parameter overrides to the generator.
SHARED_PREFIX = "shared-prefix"
#: ``conversations:SPEC`` likewise (:mod:`routerd.workloads.conversations`).
CONVERSATIONS = "conversations"
DEFAULT_WORKLOAD = "sample"
#: Generator defaults: number of requests and arrival rate (req/s).
DEFAULT_N = 2000
DEFAULT_RATE = 20.0
#: Environment variable naming the shared data directory.
DATA_DIR_ENV = "PHASEWISE_DATA_DIR"
#: Bundled sample, relative to the ``routerd`` package.
SAMPLE_RESOURCE = ("data", "traces", "azure2023_conv_sample.csv")

_AZURE_CITE = "CC-BY-4.0, Patel et al., Splitwise, ISCA 2024"
_TRACES: dict[str, tuple[str, str]] = {
    "azure-conv": (
        "traces/azure2023_conv.csv",
        f"Azure LLM inference trace 2023, conversation service (full hour; {_AZURE_CITE})",
    ),
    "azure-code": (
        "traces/azure2023_code.csv",
        f"Azure LLM inference trace 2023, coding service (full hour; {_AZURE_CITE})",
    ),
    "mooncake": (
        "traces/mooncake_fast25_synthetic.jsonl.gz",
        "Mooncake FAST'25 synthetic trace (built by Mooncake from public datasets with Poisson "
        "arrivals, not production traffic; Apache-2.0, Qin et al., FAST 2025), prefix identity "
        "from hash_ids (512-token units)",
    ),
}
_TRACE_SUFFIXES = (".csv", ".jsonl", ".jsonl.gz")


@dataclass(frozen=True)
class Workload:
    """A loaded workload.

    ``requests`` are sorted by ``arrival_s`` (seconds) with ids 0..len-1. ``native_rate``
    is the workload's own mean arrival rate in req/s before any rescaling: for a trace
    ``len / (last - first arrival)`` of the loaded (possibly limited) requests, NaN when
    that is undefined (a single request or zero span); for a generator the rate it was
    asked for.
    """

    name: str
    requests: list[Request]
    description: str
    native_rate: float


def _repo_root() -> Path:
    # routerd/routerd/workloads/registry.py -> the repository holding routerd/.
    return Path(__file__).resolve().parents[3]


def _candidates() -> list[Path]:
    return [Path.cwd() / ".." / "shared" / "data", _repo_root() / ".." / "shared" / "data"]


def resolve_data_dir(data_dir: str | Path | None = None, *, needed_by: str = "this workload") -> Path:
    """Find the shared data directory (the one holding ``traces/`` and ``prompts/``).

    Order: the ``data_dir`` argument; else the ``PHASEWISE_DATA_DIR`` environment
    variable; else the first existing of ``Path.cwd()/"../shared/data"`` and
    ``<repo root>/../shared/data`` (repo root = the directory holding ``routerd/``).

    Args:
        data_dir: explicit directory, or ``None`` to search.
        needed_by: who needs it, for the error message (e.g. ``"workload 'azure-conv'"``).

    Raises:
        WorkloadError: an explicit ``data_dir`` or the environment variable names a
            directory that does not exist, or nothing was found; the message says what
            needs the data and how to point at it.
    """
    if data_dir is not None:
        p = Path(data_dir)
        if not p.is_dir():
            raise WorkloadError(
                f"{needed_by} needs the shared data directory, but data_dir {str(p)!r} is not a directory"
            )
        return p
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        p = Path(env)
        if not p.is_dir():
            raise WorkloadError(
                f"{needed_by} needs the shared data directory, but {DATA_DIR_ENV}={env!r} is not a directory"
            )
        return p
    tried = _candidates()
    for p in tried:
        if p.is_dir():
            return p.resolve()
    raise WorkloadError(
        f"{needed_by} needs the shared data directory (shared/data with traces/ and prompts/), "
        f"but none was found in {', '.join(dict.fromkeys(str(p) for p in tried))}; pass --data-dir DIR "
        f"(data_dir= in Python) or set "
        f"{DATA_DIR_ENV}=/path/to/shared/data (the 'sample' workload needs no data directory)"
    )


def _positive_int(name: str, v: int | None) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise WorkloadError(f"{name} must be a positive integer or None, got {v!r}")


def _native(requests: list[Request]) -> float:
    try:
        return mean_rate(requests)
    except WorkloadError:
        return math.nan


def _finish_trace(
    name: str, requests: list[Request], what: str, *, rate: float | None, limit: int | None
) -> Workload:
    native = _native(requests)
    span = requests[-1].arrival_s - requests[0].arrival_s
    desc = f"{what}; {len(requests)} requests" + (f" (first {limit})" if limit is not None else "")
    desc += f" over {span:.1f} s, native {native:.2f} req/s"
    if rate is not None:
        requests = rescale_to_rate(requests, rate)
        desc += f", rescaled to {rate:g} req/s"
    return Workload(name, requests, desc, native)


def load_workload(
    name: str = DEFAULT_WORKLOAD,
    *,
    rate: float | None = None,
    limit: int | None = None,
    n: int | None = None,
    seed: int = 0,
    data_dir: str | Path | None = None,
) -> Workload:
    """Load a workload by name or path.

    Names (:data:`WORKLOAD_NAMES`):

    - ``sample``: 2,000 requests of the Azure 2023 conversation trace bundled in the
      package (data rows 6,001-8,000; 314.5 s, 6.36 req/s native). Needs no shared data.
    - ``azure-conv`` / ``azure-code``: the full Azure LLM inference trace 2023 hours
      (19,366 / 8,819 requests; 5.53 / 2.57 req/s native).
    - ``mooncake``: the Mooncake FAST'25 synthetic trace (3,993 requests, 3.91 req/s), with
      ``Request.prefix`` from its ``hash_ids`` (required on every line; 512-token units).
    - ``public-mix``: :func:`~routerd.workloads.public_mix.public_mix`, real prompt and
      response lengths from public datasets, Poisson arrivals.
    - ``paper-mix``: :func:`~routerd.workloads.paper_mix.paper_mix`, a SYNTHETIC stand-in
      for the router paper's 5-task mix, Poisson arrivals.
    - ``shared-prefix`` or ``shared-prefix:SPEC``:
      :func:`~routerd.workloads.shared_prefix.shared_prefix`, the SYNTHETIC shared-prefix
      generator in llm-d's capacity-benchmark shape (prefix identity in ``Request.prefix``).
      ``SPEC`` is a preset (``default``, ``llmd-capacity``), optionally followed by
      ``,field=value`` overrides of
      :class:`~routerd.workloads.shared_prefix.SharedPrefixParams`, or only overrides:
      ``shared-prefix:llmd-capacity``, ``shared-prefix:groups=8,jitter=0.1``. A comma in
      place of the colon is read the same (``shared-prefix,groups=8`` =
      ``shared-prefix:default,groups=8``).
    - ``conversations`` or ``conversations:SPEC``:
      :func:`~routerd.workloads.conversations.conversations`, SYNTHETIC multi-turn chat sessions
      with growing history, shared system prompts and bursty, quantized arrivals (the shape of
      the Mooncake/Kimi conversation trace). ``SPEC`` as for ``shared-prefix``: a preset
      (``default``, ``long-sessions``, ``chat-8k``) and/or ``field=value`` overrides of
      :class:`~routerd.workloads.conversations.ConversationParams`. Unlike the other
      generators its own clock is meaningful (think times, 3 s timestamp steps): ``rate=None``
      keeps it (native, about 3.5 req/s for ``default``) and a ``rate`` rescales it as a
      trace is rescaled.
    - a path ending in ``.csv`` (Azure format, no prefix identity) or ``.jsonl`` /
      ``.jsonl.gz`` (Mooncake format; prefix identity when its lines carry ``hash_ids``).

    Args:
        name: a workload name or a trace file path.
        rate: traces and ``conversations``: rescale to this mean rate in req/s (``None`` =
            native timing); other generators: arrival rate in req/s (``None`` = 20.0).
        limit: keep only the first ``limit`` requests (any workload).
        n: generators only: number of requests (``None`` = 2000; ``shared-prefix``: the
            preset's own count, 2,000 for ``default``, 3,000 for ``llmd-capacity``;
            ``conversations``: 2,000).
        seed: generators only: RNG seed (traces are deterministic and ignore it).
        data_dir: the shared data directory; ``None`` = :func:`resolve_data_dir`'s search.

    Returns:
        A :class:`Workload`.

    Raises:
        WorkloadError: an unknown name, ``n`` given for a trace, a bad ``rate``/``limit``/
            ``n``, no shared data directory for a workload that needs one, or any
            loader error (file, row and field named).
    """
    if not isinstance(name, str):
        raise WorkloadError(f"workload name must be a string, got {name!r}")
    _positive_int("limit", limit)
    _positive_int("n", n)
    if rate is not None and (
        isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0
    ):
        raise WorkloadError(f"rate must be a finite number of requests/s > 0 or None, got {rate!r}")

    is_path = name.lower().endswith(_TRACE_SUFFIXES)
    # "shared-prefix,groups=4" (comma for colon) reads as "shared-prefix:groups=4": the
    # comma form is a natural slip, and a preset first still works ("shared-prefix,llmd-capacity").
    if name == SHARED_PREFIX or name.startswith((SHARED_PREFIX + ":", SHARED_PREFIX + ",")):
        preset, params, default_n = parse_shared_prefix_spec(name[len(SHARED_PREFIX) + 1:])
        count = default_n if n is None else n
        r = DEFAULT_RATE if rate is None else float(rate)
        requests = shared_prefix(params, count, r, seed)
        if limit is not None:
            requests = requests[:limit]
        desc = (f"{describe_shared_prefix(preset, params)}; {len(requests)} requests, Poisson arrivals "
                f"at {r:g} req/s, seed {seed}")
        return Workload(name, requests, desc, r)
    if name == CONVERSATIONS or name.startswith((CONVERSATIONS + ":", CONVERSATIONS + ",")):
        preset, cparams, default_n = parse_conversations_spec(name[len(CONVERSATIONS) + 1:])
        count = default_n if n is None else n
        requests = conversations(cparams, count, seed)
        if limit is not None:
            requests = requests[:limit]
        native = _native(requests)
        desc = f"{describe_conversations(preset, cparams)}; {len(requests)} requests, seed {seed}, native " \
               f"{native:.2f} req/s"
        if rate is not None:
            requests = rescale_to_rate(requests, rate)
            desc += f", rescaled to {rate:g} req/s"
        return Workload(name, requests, desc, native)
    if name in ("public-mix", "paper-mix"):
        count = DEFAULT_N if n is None else n
        r = DEFAULT_RATE if rate is None else float(rate)
        if name == "public-mix":
            ddir = resolve_data_dir(data_dir, needed_by="workload 'public-mix'")
            requests = public_mix(count, r, seed, data_dir=ddir)
            groups, skipped = public_mix_groups(ddir)
            what = (
                f"public prompt/response mix from {ddir / 'prompts'}: {len(groups)} task groups "
                f"(AlpacaEval model {DEFAULT_ALPACA_MODEL}, prompts <= 1000 tokens, {skipped} zero-token "
                f"rows dropped), real cl100k token lengths"
            )
        else:
            requests = paper_mix(count, r, seed)
            what = "SYNTHETIC 5-task mix fitted to arXiv 2408.13510 Table 1 aggregates (no prompt text)"
        if limit is not None:
            requests = requests[:limit]
        desc = f"{what}; {len(requests)} requests, Poisson arrivals at {r:g} req/s, seed {seed}"
        return Workload(name, requests, desc, r)

    if not (name == "sample" or name in _TRACES or is_path):
        raise WorkloadError(
            f"unknown workload {name!r}; valid: {', '.join(sorted(WORKLOAD_NAMES))} "
            f"(shared-prefix:PRESET[,field=value...] or shared-prefix:field=value[,...]; "
            f"conversations:PRESET[,field=value...] likewise), "
            f"or a path to a .csv (Azure) / .jsonl / .jsonl.gz (Mooncake) trace"
        )
    if n is not None:
        raise WorkloadError(
            f"n applies only to the generators ({', '.join(GENERATOR_NAMES)}); use limit for {name!r}"
        )
    if name == "sample":
        res = resources.files("routerd").joinpath(*SAMPLE_RESOURCE)
        with resources.as_file(res) as p:
            requests = load_azure_csv(p, limit=limit)
        what = (
            "Azure LLM inference trace 2023, conversation service, bundled sample "
            f"(data rows 6,001-8,000 of AzureLLMInferenceTrace_conv.csv; {_AZURE_CITE})"
        )
        return _finish_trace(name, requests, what, rate=rate, limit=limit)
    if name in _TRACES:
        rel, what = _TRACES[name]
        path = resolve_data_dir(data_dir, needed_by=f"workload {name!r}") / rel
        if rel.endswith((".jsonl", ".jsonl.gz")):
            requests = load_mooncake_jsonl(path, limit=limit, prefix=True)
        else:
            requests = load_azure_csv(path, limit=limit)
        return _finish_trace(name, requests, what, rate=rate, limit=limit)
    path = Path(name)
    if name.lower().endswith(".csv"):
        requests, what = load_azure_csv(path, limit=limit), f"Azure-format trace {path}"
    else:
        requests, what = load_mooncake_jsonl(path, limit=limit), f"Mooncake-format trace {path}"
    return _finish_trace(name, requests, what, rate=rate, limit=limit)
