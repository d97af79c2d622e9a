"""The robustness grid (issue 32): every routing policy on every workload, pool and load.

A *cell* is one ``(workload, pool, load)``. In a cell every policy runs on the same requests, seed
by seed (:func:`routerd.bench.seed_workloads`: a generator redrawn per seed, a trace cut into one
window per seed), at ``load`` times round robin's saturated throughput on that seed's requests
(:func:`routerd.bench.load_to_rate`, the definition of load of ``phasewise bench --load``).

**Predictions as routerd would have them.** The main column runs every policy with the buckets
of the shipped predictor (``predictor:default``, assigned once per request before simulating, as
``phasewise bench --prediction predictor:default`` does; on traces without prompt text it gives
every request its training prior). The second column, ``true``, gives the policies the true
output bucket. Only the policies whose decisions read predictions are run again under ``true``
(:data:`PREDICTION_READERS`); the others' runs are the same whatever the buckets say, so their
``true`` values are their main-column runs (``tests/test_robustness.py`` checks that on the
grid's policies).

Which policies read predictions (read in ``routerd/policies/*.py``: a policy reads them when it
uses ``RequestFeatures.predicted_bucket`` / ``predicted_output_tokens``, a resident's
``predicted_output_tokens``, ``InstanceView.load_summary()`` (decode bins, prompt + predicted
tokens) or ``outstanding_tokens`` (predicted remaining decode)): ``join_shortest_queue``,
``least_outstanding_tokens``, ``power_of_two_choices`` (outstanding tokens), ``late_binding`` and
``max_capacity_usage`` (predicted KV footprint), ``min_min`` (bucket upper edges),
``mixing_penalty``, ``phasewise`` and ``predicted_latency`` (predicted decode time, load
summaries), ``learned_linear`` and ``dqn`` (features). The rest read none: ``round_robin``,
``random``, ``queue_kv_scorer``, ``llmd``, ``sglang_cache_aware``, ``dynamo_kv``, ``lmetric``,
``decode_balancer`` and ``oracle`` (which reads the true length itself).

**Outputs.** One JSON per cell in ``OUT/cells/`` (written atomically: a temporary file renamed
into place), named by the cell and a hash of what decides its numbers (seeds, requests per seed,
prediction, format version), so an interrupted grid resumes where it stopped and a grid with other
sizes never mixes in old numbers. A cell file that already holds every requested policy run is
not run again; one that lacks some (a policy or a ``--policy-spec`` candidate added) runs only the
missing ones and is rewritten. Then ``OUT/summary.md`` (:func:`format_summary`), ``OUT/summary.json``
and ``OUT/summary.png`` (:func:`plot_summary`, when matplotlib is installed).

**The summary** (per prediction column, for each candidate: ``phasewise`` and every extra
``--policy-spec``): per cell the candidate's mean-E2E change against the best other policy (the
non-candidate policy with the lowest mean E2E over seeds) with its paired 95% interval
(:func:`routerd.bench.paired_interval` over the seeds), a *loss* when that interval lies wholly
above +1% (:data:`LOSS_MARGIN_PCT`), its p90-TTFT change against the same policy (target at most
+5%, :data:`TTFT_MARGIN_PCT`), and across the grid the geometric mean over cells of the
candidate's mean-E2E ratio to each anchor (:data:`ANCHORS`; per cell the ratio of the means over
seeds), which must be at most 0.97 (:data:`ANCHOR_TARGET`, "at least 3% better").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

#: Workloads of the full grid: three traces, the llm-d capacity shape (single turn, long shared
#: prefixes), a shared-prefix shape with long multi-turn sessions (20 turns, answers resent,
#: prompts up to ~14K tokens), the public prompt mix (real prompt text, so the predictor reads
#: text there) and the conversation generator.
DEFAULT_WORKLOADS: tuple[str, ...] = (
    "mooncake",
    "azure-conv",
    "azure-code",
    "shared-prefix:llmd-capacity",
    "shared-prefix:turns_per_session=20,jitter=0.5",
    "public-mix",
    "conversations",
)
#: Pools of the full grid: 4, 8 and 16 instances of each Llama-3.1-8B profile, and one mixed pool.
DEFAULT_POOLS: tuple[str, ...] = (
    "4xllama3.1-8b-a100",
    "8xllama3.1-8b-a100",
    "16xllama3.1-8b-a100",
    "4xllama3.1-8b-h100",
    "8xllama3.1-8b-h100",
    "16xllama3.1-8b-h100",
    "4xllama3.1-8b-a100,4xllama3.1-8b-h100",
)
#: Loads: multiples of round robin's saturated throughput (``docs/results.md``'s 0.8x, 1.5x, 2x).
DEFAULT_LOADS: tuple[float, ...] = (0.8, 1.5, 2.0)
DEFAULT_SEEDS = 3
REFERENCE = "round_robin"
#: The single anchor policies the candidate must beat on the geometric mean (issue 32).
ANCHORS: tuple[str, ...] = ("lmetric", "llmd", "sglang_cache_aware", "dynamo_kv")
CANDIDATE = "phasewise"
DEFAULT_POLICIES: tuple[str, ...] = (
    REFERENCE, "llmd", "sglang_cache_aware", "dynamo_kv", "lmetric", "queue_kv_scorer",
    "late_binding", "join_shortest_queue", "predicted_latency", CANDIDATE,
)
#: Policies whose decisions read predicted output lengths (module docstring).
PREDICTION_READERS: frozenset[str] = frozenset({
    "join_shortest_queue", "least_outstanding_tokens", "power_of_two_choices", "late_binding",
    "max_capacity_usage", "min_min", "mixing_penalty", "phasewise", "predicted_latency",
    "learned_linear", "dqn",
})
#: Policies whose decisions read no prediction (the complement, listed so that a new policy
#: must be classified: ``tests/test_robustness.py`` checks the two cover the registry).
PREDICTION_BLIND: frozenset[str] = frozenset({
    "round_robin", "random", "queue_kv_scorer", "llmd", "sglang_cache_aware", "dynamo_kv", "lmetric",
    "decode_balancer", "oracle",
})
DEFAULT_PREDICTION = "predictor:default"
TRUE = "true"
#: Requests per seed of the full grid: chosen so that the whole grid runs in under 60 minutes on
#: two cores: ~6.3 CPU-s per cell and seed at 1,000 (:data:`CPU_S_PER_SEED_1000`), so 147 cells x
#: 3 seeds ~ 46 CPU-min ~ 23 min on 2 processes; 1,500 would be ~1.9x that (~44 min), too close.
DEFAULT_LIMIT = 1000
LOSS_MARGIN_PCT = 1.0
TTFT_MARGIN_PCT = 5.0
ANCHOR_TARGET = 0.97
#: Summary fields recorded per policy and seed (s; ``prefix_hit_rate`` a fraction or None).
METRICS: tuple[str, ...] = (
    "e2e_mean", "e2e_p90", "ttft_mean", "ttft_p90", "tpot_mean", "makespan", "prefix_hit_rate",
)
#: Fields compared by paired intervals in the cell files.
INTERVAL_METRICS: tuple[str, ...] = ("e2e_mean", "ttft_p90")
FORMAT_VERSION = 1
#: CPU seconds of one cell per seed at 1,000 requests, the default policies and both columns: the
#: mean over 42 cells measured (every workload x 4xA100, 16xH100, the mixed pool x loads 0.8, 2;
#: ``benchmarks/robustness.py`` docstring). Only for the printed estimate.
CPU_S_PER_SEED_1000 = 6.3
#: Cost grows faster than the request count (queues grow with the sample at loads > 1): 1,500
#: requests took 1.9x the CPU of 1,000 on the 12 heaviest cells measured, i.e. ``(n/1000)**1.6``.
CPU_EXPONENT = 1.6


#: Largest load accepted (multiples of round robin's capacity): beyond it every request arrives
#: at once, which says nothing a smaller multiple does not.
MAX_LOAD = 1000.0


class GridInputError(ValueError):
    """Bad grid input (one line): an unknown workload, pool or policy, an unwritable folder."""


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


# ---------------------------------------------------------------------------------------------
# Configuration and cells


@dataclass(frozen=True)
class Cell:
    """One ``(workload, pool, load)`` of the grid."""

    workload: str
    pool: str
    load: float

    @property
    def label(self) -> str:
        return f"{self.workload} | {self.pool} | {self.load:g}x"


@dataclass(frozen=True)
class GridConfig:
    """What a grid runs. ``policies`` includes the candidates (``phasewise`` when listed and every
    extra ``--policy-spec``); ``true_column`` adds the ``true`` re-runs of the prediction readers."""

    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    pools: tuple[str, ...] = DEFAULT_POOLS
    loads: tuple[float, ...] = DEFAULT_LOADS
    seeds: tuple[int, ...] = tuple(range(DEFAULT_SEEDS))
    policies: tuple[str, ...] = DEFAULT_POLICIES
    candidates: tuple[str, ...] = (CANDIDATE,)
    limit: int = DEFAULT_LIMIT
    prediction: str = DEFAULT_PREDICTION
    true_column: bool = True
    data_dir: str | None = None

    def cells(self) -> list[Cell]:
        """Every cell, workloads outermost, in the order given."""
        return [Cell(w, p, float(x)) for w in self.workloads for p in self.pools for x in self.loads]

    def columns(self) -> tuple[str, ...]:
        """Prediction columns: the main one, then ``true`` (when asked and not the main one)."""
        return (self.prediction,) + ((TRUE,) if self.true_column and self.prediction != TRUE else ())

    def runs(self) -> list[tuple[str, str]]:
        """``(column, policy spec)`` pairs a cell runs."""
        out = [(self.prediction, s) for s in self.policies]
        if len(self.columns()) > 1:
            out += [(TRUE, s) for s in self.policies if reads_predictions(s)]
        return out


def reads_predictions(spec: str) -> bool:
    """Whether policy ``spec``'s decisions read predicted output lengths (:data:`PREDICTION_READERS`;
    an unclassified name counts as a reader, so it is run under both columns)."""
    from routerd.policies.registry import parse_policy_spec

    name = parse_policy_spec(spec)[0]
    return name in PREDICTION_READERS or name not in PREDICTION_BLIND


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")[:60]


def cell_filename(cell: Cell, config: GridConfig) -> str:
    """``<workload>__<pool>__<load>x__<hash>.json``: the hash covers everything that decides the
    cell's numbers besides its policies (those are merged into one file)."""
    key = json.dumps({"v": FORMAT_VERSION, "workload": cell.workload, "pool": cell.pool, "load": cell.load,
                      "seeds": list(config.seeds), "limit": config.limit, "prediction": config.prediction},
                     sort_keys=True)
    h = hashlib.sha256(key.encode()).hexdigest()[:10]
    return f"{_slug(cell.workload)}__{_slug(cell.pool)}__{cell.load:g}x__{h}.json"


def cell_path(out: Path, cell: Cell, config: GridConfig) -> Path:
    return Path(out) / "cells" / cell_filename(cell, config)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file in the same folder and a rename,
    so a reader (or a resumed grid) never sees a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a plain open() would not
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def read_cell(path: Path) -> dict | None:
    """A cell file's data, or None when it is missing or unreadable (then the cell runs again)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION or not _well_formed(data):
        return None
    return data


def _well_formed(data: dict) -> bool:
    """The fields the summary reads, with the types it reads them as (a file edited or written by
    another tool runs again instead of crashing the summary)."""
    try:
        if not (isinstance(data["workload"], str) and isinstance(data["pool"], str)
                and isinstance(data["prediction"], str) and isinstance(data["load"], (int, float))):
            return False
        cols = data["columns"]
        if not isinstance(cols, dict):
            return False
        for col in cols.values():
            if not isinstance(col, dict):
                return False
            for e in col.values():
                for k, v in e["mean"].items():
                    if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                        return False
                for k, vs in e["per_seed"].items():
                    if not isinstance(vs, list) or any(
                            v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)
                            for v in vs):
                        return False
    except (KeyError, TypeError, AttributeError):
        return False
    return True


def missing_runs(data: dict | None, config: GridConfig) -> list[tuple[str, str]]:
    """The ``(column, spec)`` runs of ``config`` that ``data`` (a cell file) does not hold."""
    have = (data or {}).get("columns", {})
    return [(c, s) for c, s in config.runs() if s not in have.get(c, {})]


# ---------------------------------------------------------------------------------------------
# Validation


def _pool_arg(pool: Sequence):
    """What bench takes for a pool: the profile when homogeneous, else one per instance."""
    return pool[0] if len({p.name for p in pool}) == 1 else tuple(pool)


def validate(config: GridConfig, out: Path | None = None) -> None:
    """Check every input before anything runs.

    Raises:
        GridInputError: one line naming the bad workload, pool, policy spec, load, seed count,
            limit, prediction or output folder.
    """
    from routerd.bench import policy_context
    from routerd.policies.registry import PolicyError, build_policy_from_spec
    from routerd.profiles import PoolError, ProfileError, parse_pool
    from routerd.workloads.errors import WorkloadError
    from routerd.workloads.registry import load_workload

    for name, vals in (("workloads", config.workloads), ("pools", config.pools), ("loads", config.loads),
                       ("policies", config.policies)):
        if not vals:
            raise GridInputError(f"no {name} given")
    if len(config.seeds) < 1:
        raise GridInputError("--seeds must be >= 1")
    if isinstance(config.limit, bool) or not isinstance(config.limit, int) or config.limit < 2:
        raise GridInputError(f"--limit must be an integer >= 2 requests per seed, got {config.limit!r}")
    for x in config.loads:
        if not (isinstance(x, (int, float)) and math.isfinite(x) and 0 < x <= MAX_LOAD):
            raise GridInputError(f"load {x!r} is not a multiple of round robin's capacity in (0, {MAX_LOAD:g}]")
    if len(set(config.policies)) != len(config.policies):
        dup = next(s for s in config.policies if config.policies.count(s) > 1)
        raise GridInputError(f"policy {dup!r} is given twice")
    for w in config.workloads:
        try:
            gen = w.partition(":")[0].partition(",")[0] in _generators()
            load_workload(w, n=2 if gen else None, limit=2, data_dir=config.data_dir)
        except WorkloadError as e:
            raise GridInputError(f"workload {w!r}: {_one_line(e)}") from None
    pools = []
    for p in config.pools:
        try:
            pools.append(parse_pool(p))
        except (PoolError, ProfileError) as e:
            raise GridInputError(f"pool {p!r}: {_one_line(e)}") from None
    for pool in pools:
        for spec in config.policies:
            try:
                build_policy_from_spec(spec, policy_context(_pool_arg(pool), len(pool)))
            except (PolicyError, ValueError) as e:
                raise GridInputError(f"policy {spec!r}: {_one_line(e)}") from None
    if config.prediction != TRUE:
        if not config.prediction.startswith("predictor:"):
            raise GridInputError(f"--prediction {config.prediction!r}: expected predictor:SPEC or true")
        try:
            _predictor(config.prediction, config.data_dir)
        except Exception as e:  # PredictorError and the errors of a broken model folder
            raise GridInputError(f"--prediction {config.prediction}: {_one_line(e)}") from None
    if out is not None:
        check_output_folder(Path(out))


def check_output_folder(out: Path) -> None:
    """Create ``out/cells`` and prove a file can be written there (then removed).

    Raises:
        GridInputError: the folder cannot be created or written.
    """
    if not str(out).strip():
        raise GridInputError("--out is empty; give a folder")
    try:
        (out / "cells").mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".probe.", dir=out / "cells")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise GridInputError(f"--out {str(out)!r} cannot be written: {e.strerror or e}") from None


def _generators() -> tuple[str, ...]:
    from routerd.workloads import registry

    return tuple(registry.GENERATOR_NAMES)


_PREDICTORS: dict[tuple[str, str | None], Any] = {}


def _predictor(prediction: str, data_dir: str | None):
    from routerd.model import PREDICTOR_BUCKET_EDGES
    from routerd.predictor import load_predictor

    key = (prediction, data_dir)
    if key not in _PREDICTORS:
        _PREDICTORS[key] = load_predictor(prediction.partition(":")[2], data_dir=data_dir,
                                          edges=PREDICTOR_BUCKET_EDGES)
    return _PREDICTORS[key]


# ---------------------------------------------------------------------------------------------
# Running a cell


def _trace_limit(workload: str, seeds: int, limit: int, data_dir: str | None) -> tuple[int, str | None]:
    """Requests per seed for ``workload``: ``limit``, or for a trace too short to give every seed a
    window of ``limit`` requests, ``len // seeds`` (with a note)."""
    if workload.partition(":")[0].partition(",")[0] in _generators():
        return limit, None
    from routerd.workloads.registry import load_workload

    have = len(load_workload(workload, limit=limit * seeds, data_dir=data_dir).requests)
    if have >= limit * seeds:
        return limit, None
    size = have // seeds
    return size, (f"{workload}: {have} requests cannot give {seeds} windows of {limit}; "
                  f"{size} requests per seed instead")


def _generator_n(workload: str, size: int) -> int | None:
    """``n`` for :func:`routerd.bench.seed_workloads`: None (the generator's own count, cut to
    ``size`` by ``limit``, exactly as ``phasewise bench --limit`` draws it) unless that count is
    below ``size``; None for a trace."""
    from routerd.workloads.conversations import parse_conversations_spec
    from routerd.workloads.registry import CONVERSATIONS, DEFAULT_N, SHARED_PREFIX
    from routerd.workloads.shared_prefix import parse_shared_prefix_spec

    base = workload.partition(":")[0].partition(",")[0]
    if base not in _generators():
        return None
    if base == SHARED_PREFIX:
        default = parse_shared_prefix_spec(workload[len(SHARED_PREFIX) + 1:])[2]
    elif base == CONVERSATIONS:
        default = parse_conversations_spec(workload[len(CONVERSATIONS) + 1:])[2]
    else:
        default = DEFAULT_N
    return None if default >= size else size


def _values(summary) -> dict[str, float | None]:
    return {m: getattr(summary, m) for m in METRICS}


def run_cell(cell: Cell, config: GridConfig, out: Path) -> dict:
    """Run the runs of ``cell`` its file does not hold yet, merge and write the file atomically.

    Returns the cell's data (also when nothing had to run: then the file is untouched and
    ``data["ran"]`` is 0).
    """
    from routerd.bench import load_to_rate, run_bench, seed_workloads
    from routerd.model import PREDICTOR_BUCKET_EDGES, bucket_of
    from routerd.predictor import assign_predictions
    from routerd.profiles import parse_pool

    path = cell_path(out, cell, config)
    data = read_cell(path)
    todo = missing_runs(data, config)
    if not todo:
        data["ran"] = 0
        return data
    t_wall, t_cpu = time.perf_counter(), time.process_time()
    pool = parse_pool(cell.pool)
    prof = _pool_arg(pool)
    m = len(pool)
    seeds = list(config.seeds)
    size, note = _trace_limit(cell.workload, len(seeds), config.limit, config.data_dir)
    wls = seed_workloads(cell.workload, seeds, limit=size, n=_generator_n(cell.workload, size),
                         data_dir=config.data_dir)
    if data is None:
        data = {"version": FORMAT_VERSION, "workload": cell.workload, "pool": cell.pool, "load": cell.load,
                "instances": m, "seeds": seeds, "limit": config.limit, "requests_per_seed": size,
                "prediction": config.prediction, "notes": [note] if note else [],
                "workload_description": [w.description for w in wls], "capacity_rps": [], "rate_rps": [],
                "predictor_exact_share": None, "columns": {}, "cpu_s": 0.0}
    cols: dict[str, dict] = data["columns"]
    per_col = {c: [s for cc, s in todo if cc == c] for c in config.columns()}
    caps, rates, exact, total = [], [], 0, 0
    for i, (seed, wl) in enumerate(zip(seeds, wls)):
        reqs, cap, rate = load_to_rate(wl.requests, prof, m, cell.load)
        caps.append(cap)
        rates.append(rate)
        for col, specs in per_col.items():
            if not specs:
                continue
            if col == TRUE:
                run_reqs, mode = reqs, TRUE
            else:
                run_reqs = assign_predictions(reqs, _predictor(col, config.data_dir), edges=PREDICTOR_BUCKET_EDGES)
                mode = "given"
                exact += sum(1 for r in run_reqs if r.predicted_bucket == bucket_of(r.output_tokens,
                                                                                     PREDICTOR_BUCKET_EDGES))
                total += len(run_reqs)
            for spec in specs:
                c0 = time.process_time()
                res = run_bench(run_reqs, prof, m, [spec], workload_name=cell.workload, prediction=mode,
                                seed=seed).results[0]
                entry = cols.setdefault(col, {}).setdefault(spec, {
                    "per_seed": {k: [None] * len(seeds) for k in METRICS}, "cpu_s": 0.0,
                    "decisions": [None] * len(seeds), "holds": [None] * len(seeds)})
                for k, v in _values(res.summary).items():
                    entry["per_seed"][k][i] = v
                entry["decisions"][i] = res.decisions
                entry["holds"][i] = res.holds
                entry["cpu_s"] += time.process_time() - c0
    data["capacity_rps"], data["rate_rps"] = caps, rates
    if total:
        data["predictor_exact_share"] = exact / total
    for col in cols.values():
        for e in col.values():
            e["mean"] = {k: _mean(v) for k, v in e["per_seed"].items()}
    data["intervals"] = cell_intervals(data, config.candidates)
    data["cpu_s"] = data.get("cpu_s", 0.0) + time.process_time() - t_cpu
    data["wall_s"] = time.perf_counter() - t_wall
    write_json_atomic(path, data)
    data["ran"] = len(todo)
    return data


def _mean(vals: Sequence[float | None]) -> float | None:
    xs = [v for v in vals if v is not None]
    return statistics.fmean(xs) if xs and len(xs) == len(vals) else None


# ---------------------------------------------------------------------------------------------
# Aggregation


def full_column(data: dict, column: str) -> dict[str, dict]:
    """``spec -> entry`` of one column of a cell, the ``true`` column completed with the main
    column's runs of the policies that read no prediction (identical runs)."""
    cols = data["columns"]
    main = cols.get(data["prediction"], {})
    if column == data["prediction"]:
        return dict(main)
    out = {s: e for s, e in main.items() if not reads_predictions(s)}
    out.update(cols.get(column, {}))
    return out


def best_other(column: dict[str, dict], spec: str, candidates: Iterable[str], metric: str = "e2e_mean") -> str | None:
    """The non-candidate policy other than ``spec`` with the lowest mean ``metric`` over seeds
    (ties: the first in column order); None when there is none."""
    cand = set(candidates)
    best, best_v = None, math.inf
    for s, e in column.items():
        v = e["mean"].get(metric)
        if s == spec or s in cand or v is None:
            continue
        if v < best_v:
            best, best_v = s, v
    return best


def _interval(values: Sequence[float], base: Sequence[float]) -> dict:
    """:func:`routerd.bench.paired_interval` as a dict (% change, 95% bounds, seeds). Where it has
    no answer (a value or base that is not > 0 has no log ratio) the change of the means over
    seeds without bounds (None where the base mean is 0)."""
    from routerd.bench import paired_interval

    try:
        iv = paired_interval(list(values), list(base))
    except ValueError:
        mv, mb = statistics.fmean(values), statistics.fmean(base)
        return {"mean_pct": 100.0 * (mv - mb) / mb if mb > 0 else None, "low_pct": None, "high_pct": None,
                "n": len(values)}
    return {"mean_pct": iv.mean, "low_pct": iv.low, "high_pct": iv.high, "n": iv.n}


def cell_intervals(data: dict, candidates: Iterable[str]) -> dict:
    """``column -> spec -> {"best_other", "vs_best": metric -> interval, "vs": other -> metric ->
    interval}``: every policy against the best other policy, round robin and each anchor."""
    candidates = tuple(candidates)
    out: dict = {}
    for column in data["columns"]:
        col = full_column(data, column)
        res: dict = {}
        for spec, e in col.items():
            best = best_other(col, spec, candidates)

            def against(other: str) -> dict:
                return {m: _interval(e["per_seed"][m], col[other]["per_seed"][m]) for m in INTERVAL_METRICS
                        if None not in e["per_seed"][m] and None not in col[other]["per_seed"][m]}

            res[spec] = {"best_other": best, "vs_best": against(best) if best else {},
                         "vs": {o: against(o) for o in (REFERENCE, *ANCHORS) if o in col and o != spec}}
        out[column] = res
    return out


@dataclass
class CellRow:
    """One cell of the summary for one candidate and one column."""

    workload: str
    pool: str
    load: float
    best: str | None
    """The best other (non-candidate) policy by mean E2E over seeds."""
    e2e: dict | None
    """The candidate's mean-E2E change against ``best`` (paired interval, %)."""
    loss: bool | None
    """The interval lies wholly above +:data:`LOSS_MARGIN_PCT` % (None without an interval)."""
    ttft_p90_pct: float | None
    """The candidate's p90 TTFT against ``best``'s, % change of the means over seeds."""
    ttft_ok: bool | None
    anchor_ratio: dict[str, float] = field(default_factory=dict)
    """Anchor -> the candidate's mean E2E over seeds / the anchor's."""


@dataclass
class CandidateSummary:
    """One candidate over the grid in one column."""

    candidate: str
    column: str
    rows: list[CellRow]

    @property
    def losses(self) -> int:
        return sum(1 for r in self.rows if r.loss)

    @property
    def ttft_violations(self) -> int:
        return sum(1 for r in self.rows if r.ttft_ok is False)

    def geomean_ratio(self, anchor: str) -> float | None:
        """Geometric mean over cells of the candidate's mean-E2E ratio to ``anchor``."""
        rs = [r.anchor_ratio[anchor] for r in self.rows if anchor in r.anchor_ratio]
        return geometric_mean(rs) if rs else None

    def geomean_vs_best(self) -> float | None:
        rs = [1 + r.e2e["mean_pct"] / 100 for r in self.rows
              if r.e2e is not None and r.e2e["mean_pct"] is not None]
        rs = [x for x in rs if x > 0]
        return geometric_mean(rs) if rs else None

    def as_dict(self) -> dict:
        return {
            "candidate": self.candidate, "column": self.column, "cells": len(self.rows),
            "losses": self.losses, "ttft_violations": self.ttft_violations,
            "geomean_ratio": {a: self.geomean_ratio(a) for a in ANCHORS},
            "geomean_ratio_vs_best": self.geomean_vs_best(),
            "anchor_target_met": {a: (g is not None and g <= ANCHOR_TARGET)
                                  for a in ANCHORS for g in [self.geomean_ratio(a)]},
            "rows": [r.__dict__ for r in self.rows],
        }


def geometric_mean(values: Sequence[float]) -> float:
    """``exp(mean(log v))`` of positive values.

    Raises:
        ValueError: no values or a value <= 0.
    """
    if not values or any(not (v > 0) for v in values):
        raise ValueError(f"geometric mean needs positive values, got {list(values)!r}")
    return math.exp(statistics.fmean(math.log(v) for v in values))


def summarize(cells: Sequence[dict], candidates: Sequence[str], column: str) -> list[CandidateSummary]:
    """One :class:`CandidateSummary` per candidate present in the cells' ``column``."""
    out = []
    for cand in candidates:
        rows = []
        for data in cells:
            col = full_column(data, column)
            if cand not in col:
                continue
            e = col[cand]
            best = best_other(col, cand, candidates)
            e2e = loss = ttft = ok = None
            if best is not None:
                if None not in e["per_seed"]["e2e_mean"]:
                    e2e = _interval(e["per_seed"]["e2e_mean"], col[best]["per_seed"]["e2e_mean"])
                    loss = None if e2e["low_pct"] is None else e2e["low_pct"] > LOSS_MARGIN_PCT
                bt, ct = col[best]["mean"]["ttft_p90"], e["mean"]["ttft_p90"]
                if bt is not None and ct is not None:
                    ttft = 100.0 * (ct - bt) / bt if bt > 0 else (0.0 if ct == bt else math.inf)
                    ok = ttft <= TTFT_MARGIN_PCT
            ratios = {}
            for a in ANCHORS:
                if a in col and a != cand and col[a]["mean"]["e2e_mean"] and e["mean"]["e2e_mean"] is not None:
                    ratios[a] = e["mean"]["e2e_mean"] / col[a]["mean"]["e2e_mean"]
            rows.append(CellRow(data["workload"], data["pool"], data["load"], best, e2e, loss, ttft, ok, ratios))
        if rows:
            out.append(CandidateSummary(cand, column, rows))
    return out


@dataclass
class HeldOut:
    """One fold of :func:`leave_one_workload_out`: the candidate chosen without ``workload`` and
    how it did on it."""

    workload: str
    chosen: str
    train_geomean: float
    """The chosen candidate's geometric-mean mean-E2E ratio to the best other policy on every
    other workload's cells (what it was chosen by; lower is better)."""
    held_out_geomean: float | None
    """The same ratio on the held-out workload's cells."""
    held_out_losses: int
    held_out_ttft_violations: int
    cells: int


def _ratio_vs_best(row: CellRow) -> float | None:
    if row.e2e is None or row.e2e["mean_pct"] is None:
        return None
    x = 1.0 + row.e2e["mean_pct"] / 100.0
    return x if x > 0 else None


def leave_one_workload_out(summaries: Sequence[CandidateSummary]) -> list[HeldOut]:
    """Leave-one-workload-out choice among candidates of one column: for each workload, the
    candidate with the lowest geometric mean over the *other* workloads' cells of its mean-E2E
    ratio to the best other policy (ties: the first candidate), then that candidate's figures on
    the held-out workload. A default that only fits the workloads it was chosen on shows as a
    held-out ratio above the training one. Empty with fewer than two workloads or candidates."""
    if len(summaries) < 2:
        return []
    workloads = list(dict.fromkeys(r.workload for s in summaries for r in s.rows))
    if len(workloads) < 2:
        return []
    out = []
    for w in workloads:
        best: tuple[float, CandidateSummary] | None = None
        for s in summaries:
            rs = [x for r in s.rows if r.workload != w for x in [_ratio_vs_best(r)] if x is not None]
            if not rs:
                continue
            g = geometric_mean(rs)
            if best is None or g < best[0]:
                best = (g, s)
        if best is None:
            continue
        g, s = best
        test = [r for r in s.rows if r.workload == w]
        hs = [x for r in test for x in [_ratio_vs_best(r)] if x is not None]
        out.append(HeldOut(w, s.candidate, g, geometric_mean(hs) if hs else None,
                           sum(1 for r in test if r.loss), sum(1 for r in test if r.ttft_ok is False), len(test)))
    return out


def _fmt_iv(iv: dict | None) -> str:
    if iv is None or iv["mean_pct"] is None:
        return "-"
    if iv["low_pct"] is None:
        return f"{iv['mean_pct']:+.1f}"
    return f"{iv['mean_pct']:+.1f} [{iv['low_pct']:+.1f}, {iv['high_pct']:+.1f}]"


def format_summary(summaries: Sequence[CandidateSummary], *, seeds: int, limit: int) -> str:
    """Markdown: per candidate and column a per-cell table, then the grid-wide figures."""
    lines = ["# Robustness grid", ""]
    lines.append(f"{seeds} seeds per cell, up to {limit} requests per seed. Changes are against the best other "
                 f"policy (lowest mean E2E over seeds among the non-candidate policies); intervals are paired "
                 f"95% intervals over the seeds (routerd.bench.paired_interval: a t-interval on the per-seed "
                 f"log ratios, shown as % changes, so both ends stay above -100%). A cell is a loss when the "
                 f"mean-E2E interval lies wholly above +{LOSS_MARGIN_PCT:g}%; p90 TTFT must be at most "
                 f"+{TTFT_MARGIN_PCT:g}%. Anchor ratios: the candidate's mean E2E / the anchor's (means over "
                 f"seeds); the grid figure is their geometric mean over cells, target <= {ANCHOR_TARGET:g}.")
    lines.append("")
    compact = ["| candidate | column | cells | losses | p90 TTFT > +5% | geomean vs best | "
               + " | ".join(f"geomean vs {a}" for a in ANCHORS) + " |",
               "|---|---|---:|---:|---:|---:|" + "---:|" * len(ANCHORS)]
    for s in summaries:
        g = [s.geomean_ratio(a) for a in ANCHORS]
        gb = s.geomean_vs_best()
        compact.append(
            f"| {s.candidate} | {s.column} | {len(s.rows)} | {s.losses} | {s.ttft_violations} | "
            f"{'-' if gb is None else f'{gb:.3f}'} | "
            + " | ".join("-" if x is None else f"{x:.3f}{'' if x <= ANCHOR_TARGET else ' (miss)'}" for x in g) + " |")
    lines += ["## Overview", ""] + compact + [""]
    for column in dict.fromkeys(s.column for s in summaries):
        folds = leave_one_workload_out([s for s in summaries if s.column == column])
        if not folds:
            continue
        lines += [f"## Leave one workload out, predictions: {column}", "",
                  "Each row: the candidate with the lowest geometric-mean mean-E2E ratio to the best other policy "
                  "on the other workloads (train), and its figures on the workload left out.", "",
                  "| held out | chosen | train geomean vs best | held-out geomean vs best | held-out losses | "
                  "held-out p90 TTFT > +5% |", "|---|---|---:|---:|---:|---:|"]
        for f in folds:
            ho = "-" if f.held_out_geomean is None else f"{f.held_out_geomean:.3f}"
            lines.append(f"| {f.workload} | {f.chosen} | {f.train_geomean:.3f} | {ho} | {f.held_out_losses}/{f.cells} | "
                         f"{f.held_out_ttft_violations}/{f.cells} |")
        lines.append("")
    for s in summaries:
        lines += [f"## {s.candidate}, predictions: {s.column}", ""]
        lines.append("| workload | pool | load | best other | mean E2E % vs best [95%] | loss | p90 TTFT % vs best | "
                     + " | ".join(f"vs {a}" for a in ANCHORS) + " |")
        lines.append("|---|---|---:|---|---|---|---:|" + "---:|" * len(ANCHORS))
        for r in s.rows:
            ttft = "-" if r.ttft_p90_pct is None else f"{r.ttft_p90_pct:+.1f}{'' if r.ttft_ok else ' (!)'}"
            loss = "-" if r.loss is None else ("LOSS" if r.loss else "no")
            anchors = " | ".join(f"{100 * (r.anchor_ratio[a] - 1):+.1f}%" if a in r.anchor_ratio else "-"
                                 for a in ANCHORS)
            lines.append(f"| {r.workload} | {r.pool} | {r.load:g} | {r.best or '-'} | {_fmt_iv(r.e2e)} | {loss} | "
                         f"{ttft} | {anchors} |")
        lines.append("")
    return "\n".join(lines)


def plot_summary(summaries: Sequence[CandidateSummary], path: Path) -> bool:
    """Per column, each candidate's mean-E2E change vs the best other policy per cell with its
    interval (red: a loss); the +1% loss line dashed. Returns False (nothing written) without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    columns = list(dict.fromkeys(s.column for s in summaries))
    if not columns:
        return False
    n_cells = max(len(s.rows) for s in summaries)
    fig, axes = plt.subplots(len(columns), 1, figsize=(max(8, 0.12 * n_cells + 4), 4 * len(columns)), squeeze=False)
    for ax, column in zip(axes[:, 0], columns):
        subset = [s for s in summaries if s.column == column]
        for k, s in enumerate(subset):
            xs = [i + 0.8 * (k - (len(subset) - 1) / 2) / max(1, len(subset)) for i in range(len(s.rows))]
            labelled = False
            for x, r in zip(xs, s.rows):
                if r.e2e is None:
                    continue
                m = r.e2e["mean_pct"]
                if m is None:
                    continue
                lo = r.e2e["low_pct"] if r.e2e["low_pct"] is not None else m
                hi = r.e2e["high_pct"] if r.e2e["high_pct"] is not None else m
                ax.errorbar([x], [m], yerr=[[m - lo], [hi - m]], fmt="o", ms=3, capsize=2,
                            color="tab:red" if r.loss else f"C{k}", label=None if labelled else s.candidate)
                labelled = True
        ax.axhline(LOSS_MARGIN_PCT, color="grey", ls="--", lw=0.8, label=f"+{LOSS_MARGIN_PCT:g}% (loss if the "
                                                                         f"interval is above; red: a loss)")
        ax.axhline(0.0, color="black", lw=0.5)
        ax.set_ylabel("mean E2E vs best other (%)")
        ax.set_title(f"predictions: {column}")
        rows = subset[0].rows
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([f"{r.workload[:18]} {r.pool.replace('llama3.1-8b-', '')[:18]} {r.load:g}x" for r in rows],
                           rotation=90, fontsize=5)
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------
# The grid


class CellError(RuntimeError):
    """A cell could not run (one line naming the cell and why)."""


def _run_one(args: tuple[Cell, GridConfig, str]) -> tuple[Cell, dict]:
    from routerd.workloads.errors import WorkloadError

    cell, config, out = args
    try:
        return cell, run_cell(cell, config, Path(out))
    except (WorkloadError, ValueError) as e:
        raise CellError(f"cell {cell.label}: {_one_line(e)}") from None


def run_grid(config: GridConfig, out: Path, *, jobs: int = 1,
             on_done: Callable[[Cell, dict, int, int], None] | None = None,
             runner: Callable[[tuple[Cell, GridConfig, str]], tuple[Cell, dict]] | None = None) -> list[dict]:
    """Run every cell that is not complete yet (``jobs`` processes), then return every cell's data
    in grid order. ``on_done(cell, data, done, total)`` after each finished cell. ``runner``
    replaces :func:`_run_one` (tests); with ``jobs == 1`` cells run in this process."""
    runner = runner or _run_one
    cells = config.cells()
    todo = [c for c in cells if missing_runs(read_cell(cell_path(out, c, config)), config)]
    # The costliest cells first (high load, few instances: long queues), so that the last
    # process does not run a long cell alone at the end.
    todo.sort(key=lambda c: (-c.load, len(_pool_items(c.pool))))
    done = 0
    args = [(c, config, str(out)) for c in todo]
    if jobs <= 1 or len(args) <= 1:
        for a in args:
            cell, data = runner(a)
            done += 1
            if on_done:
                on_done(cell, data, done, len(args))
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        ex = ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"))
        try:
            futs = [ex.submit(runner, a) for a in args]
            for f in as_completed(futs):
                cell, data = f.result()
                done += 1
                if on_done:
                    on_done(cell, data, done, len(args))
        except BaseException:
            # Interrupted (or a cell failed): queued cells never start and the workers are
            # stopped, so nothing runs on after this process is gone; finished cells are on disk.
            ex.shutdown(wait=False, cancel_futures=True)
            for proc in list(getattr(ex, "_processes", {}).values()):
                proc.terminate()
            raise
        ex.shutdown(wait=True)
    return [d for c in cells if (d := read_cell(cell_path(out, c, config))) is not None]


def _pool_items(pool: str) -> list[str]:
    out = []
    for item in pool.split(","):
        count, _, _name = item.strip().partition("x")
        out += [item] * (int(count) if count.strip().isdigit() else 1)
    return out


def estimate_cpu_s(config: GridConfig, cells: int) -> float:
    """Rough CPU seconds of ``cells`` cells: :data:`CPU_S_PER_SEED_1000` per seed, scaled by
    ``(limit / 1000) ** CPU_EXPONENT`` and by the policy runs per seed against the default 14."""
    runs = len(config.runs())
    return cells * len(config.seeds) * CPU_S_PER_SEED_1000 * (config.limit / 1000) ** CPU_EXPONENT * runs / 14


# ---------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="robustness.py",
        description="Robustness grid (issue 32): every policy on every workload x pool x load, several seeds, "
                    "predictions from the shipped predictor and true buckets; one JSON per cell (resumable), "
                    "then a summary table and plot.")
    p.add_argument("--out", default="robustness-out", help="output folder (cells/, summary.md, summary.json, "
                                                             "summary.png); default robustness-out")
    p.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS), metavar="W",
                   help=f"workload names (space-separated; default: {' '.join(DEFAULT_WORKLOADS)})")
    p.add_argument("--pools", nargs="+", default=list(DEFAULT_POOLS), metavar="POOL",
                   help=f"pools COUNTxPROFILE[,COUNTxPROFILE] (space-separated; default: {' '.join(DEFAULT_POOLS)})")
    p.add_argument("--loads", nargs="+", type=float, default=list(DEFAULT_LOADS), metavar="X",
                   help="loads as multiples of round robin's saturated throughput (default 0.8 1.5 2)")
    p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help="seeds per cell, 0..N-1 (default 3)")
    p.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), metavar="SPEC",
                   help=f"policy specs (default: {' '.join(DEFAULT_POLICIES)})")
    p.add_argument("--policy-spec", action="append", default=[], metavar="SPEC",
                   help="an extra candidate policy spec, compared like phasewise (e.g. "
                        "phasewise:interference_weight=0.2); repeatable")
    p.add_argument("--limit", "-n", type=int, default=DEFAULT_LIMIT,
                   help=f"requests per seed (default {DEFAULT_LIMIT}; a trace too short for all seeds' windows "
                        f"gets len // seeds)")
    p.add_argument("--prediction", default=DEFAULT_PREDICTION,
                   help="main prediction column: predictor:SPEC (default predictor:default) or true")
    p.add_argument("--no-true", action="store_true", help="skip the second column (true buckets)")
    p.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 1,
                   help="parallel processes (default: os.cpu_count())")
    p.add_argument("--data-dir", default=None, help="shared data directory (default: the usual search)")
    p.add_argument("--summary-only", action="store_true", help="run nothing; summarize the cell files present")
    p.add_argument("--no-plot", action="store_true", help="write no plot")
    return p


def config_from_args(args: argparse.Namespace) -> GridConfig:
    if args.seeds < 1:
        raise GridInputError(f"--seeds must be >= 1, got {args.seeds}")
    if args.jobs < 1:
        raise GridInputError(f"--jobs must be >= 1, got {args.jobs}")
    for spec in args.policy_spec:
        if spec in args.policies and spec != CANDIDATE:
            raise GridInputError(f"--policy-spec {spec!r} is also in --policies: a candidate is never "
                                 "another candidate's baseline, so it would drop out of the comparison")
    for flag, vals in (("--workloads", args.workloads), ("--pools", args.pools), ("--loads", args.loads)):
        seen = set()
        for v in vals:
            if v in seen:
                raise GridInputError(f"{flag}: {v!r} is given twice")
            seen.add(v)
    if not str(args.out).strip():
        raise GridInputError("--out is empty; give a folder")
    extra = [s for s in args.policy_spec if s not in args.policies]
    policies = tuple(args.policies) + tuple(extra)
    candidates = tuple(s for s in policies if s == CANDIDATE) + tuple(args.policy_spec)
    candidates = tuple(dict.fromkeys(candidates))
    return GridConfig(workloads=tuple(args.workloads), pools=tuple(args.pools), loads=tuple(args.loads),
                      seeds=tuple(range(args.seeds)), policies=policies, candidates=candidates,
                      limit=args.limit, prediction=args.prediction, true_column=not args.no_true,
                      data_dir=args.data_dir)


def main(argv: Sequence[str] | None = None, *, runner=None) -> int:
    """The command line of ``benchmarks/robustness.py``; returns the exit status (2: bad input)."""
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    try:
        config = config_from_args(args)
        validate(config, out)
    except GridInputError as e:
        print(f"robustness.py: error: {_one_line(e)}", file=sys.stderr)
        return 2
    cells = config.cells()
    if not args.summary_only:
        todo = [c for c in cells if missing_runs(read_cell(cell_path(out, c, config)), config)]
        est = estimate_cpu_s(config, len(todo))
        jobs = min(args.jobs, max(1, len(todo)))
        print(f"{len(cells)} cells ({len(config.workloads)} workloads x {len(config.pools)} pools x "
              f"{len(config.loads)} loads), {len(config.seeds)} seeds, {config.limit} requests per seed, "
              f"{len(config.runs())} policy runs per seed; {len(cells) - len(todo)} done, {len(todo)} to run; "
              f"estimate ~{est / 60:.0f} CPU-min, ~{est / 60 / jobs:.0f} min on {jobs} processes", flush=True)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        bar = _progress(len(todo))
        t0 = time.perf_counter()

        def on_done(cell: Cell, data: dict, done: int, total: int) -> None:
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(cell.label[:60])
            else:
                el = time.perf_counter() - t0
                eta = el / done * (total - done)
                print(f"[{done}/{total}] {cell.label}: {data.get('ran', 0)} runs, {data.get('cpu_s', 0):.0f} CPU-s "
                      f"(elapsed {el / 60:.1f} min, ETA {eta / 60:.1f} min)", flush=True)

        import signal

        def _term(signum, frame):  # kill / timeout: stop as Ctrl-C does
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, _term)
        try:
            run_grid(config, out, jobs=jobs, on_done=on_done, runner=runner)
        except KeyboardInterrupt:
            print("robustness.py: interrupted; finished cells are kept and a rerun resumes from them",
                  file=sys.stderr)
            return 130
        except CellError as e:
            print(f"robustness.py: error: {_one_line(e)}", file=sys.stderr)
            return 1
        finally:
            signal.signal(signal.SIGTERM, previous)
            if bar is not None:
                bar.close()
        print(f"grid done in {(time.perf_counter() - t0) / 60:.1f} min", flush=True)
    datas = [d for c in cells if (d := read_cell(cell_path(out, c, config))) is not None]
    if not datas:
        print("no cell files to summarize", file=sys.stderr)
        return 1
    summaries = [s for col in config.columns() for s in summarize(datas, config.candidates, col)]
    text = format_summary(summaries, seeds=len(config.seeds), limit=config.limit)
    if len(datas) < len(cells):
        text += f"\n{len(cells) - len(datas)} of {len(cells)} cells have no file yet.\n"
    print(text)
    (out / "summary.md").write_text(text + "\n", encoding="utf-8")
    write_json_atomic(out / "summary.json", {"config": {k: v for k, v in config.__dict__.items()},
                                             "summaries": [s.as_dict() for s in summaries]})
    written = ["summary.md", "summary.json"]
    if not summaries:
        print(f"no candidate ({', '.join(config.candidates) or 'phasewise'}) among the runs: nothing to compare "
              "or plot", file=sys.stderr)
    elif not args.no_plot:
        if plot_summary(summaries, out / "summary.png"):
            written.append("summary.png")
        else:
            print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
    print("wrote " + ", ".join(str(out / w) for w in written))
    return 0


def _progress(total: int):
    if total <= 0 or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="cell", dynamic_ncols=True)
