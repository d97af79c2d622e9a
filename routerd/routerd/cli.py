"""The ``phasewise`` command line.

Bad input (unknown names, invalid traces or parameters) ends with a one-line error
on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Sequence

DEFAULT_PROFILE = "llama2-7b-v100"
DEFAULT_INSTANCES = 4


class UsageError(Exception):
    """Raised for bad command-line input; printed as one line, exit code 2."""


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    from routerd.policies.registry import DEFAULT_BENCH_POLICIES
    from routerd.workloads.registry import DEFAULT_WORKLOAD, WORKLOAD_NAMES

    p = sub.add_parser(
        "bench",
        help="compare routing policies on a workload in the simulator",
        description="Run policies on the same workload, instances and profile; print a table, "
        "write JSON and a PNG plot.",
    )
    p.add_argument("--workload", "-w", default=DEFAULT_WORKLOAD,
                   help=f"one of {', '.join(WORKLOAD_NAMES)} or a trace path (default: {DEFAULT_WORKLOAD}, "
                        "the bundled Azure conv sample)")
    p.add_argument("--profile", "-p", default=None,
                   help=f"hardware profile name or YAML path of every instance (default: {DEFAULT_PROFILE})")
    p.add_argument("--instances", "-m", default=str(DEFAULT_INSTANCES),
                   help="number of instances (each of --profile), or a mixed pool of one model as COUNTxPROFILE "
                        "items separated by ',' (e.g. 2xllama3.1-8b-a100,2xllama3.1-8b-h100; then no --profile)")
    p.add_argument("--policies", "--policy", default=None,
                   help="policy specs separated by ';' or ',' (name or name:key=value|key=value); default: "
                        + ",".join(DEFAULT_BENCH_POLICIES) + " (a mixed --instances pool adds predicted_latency)")
    p.add_argument("--rate", type=float, default=None, help="arrival rate (req/s); traces are rescaled")
    p.add_argument("--limit", type=int, default=None, help="first N requests of a trace")
    p.add_argument("-n", type=int, default=None, help="requests of a generated workload (public-mix, paper-mix, shared-prefix[:SPEC], conversations[:SPEC])")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prediction", default="true",
                   help="true (bucket of the true length) | noisy[:ACC] (right with probability ACC, default "
                        "0.7915, the paper's accuracy) | predictor:SPEC (run a length predictor once per "
                        "request: predictor:default is the shipped n-gram predictor (numpy only); also majority, "
                        "task-prior, length-only, length+task or a folder saved by 'phasewise predictor train'; "
                        "on traces without prompt text it predicts from prompt length and task label alone) | "
                        "given (the workload's own predictions) | none")
    p.add_argument("--action-interval", type=float, default=0.02, help="router tick while holding (s)")
    p.add_argument("--data-dir", default=None, help="folder with traces/ and prompts/ (../shared/data)")
    p.add_argument("--out", "-o", default="bench-out",
                   help="folder for bench.json, requests.csv (one row per simulated request) and bench.png")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--study8", action="store_true",
                   help="the paper's 8-request study: all 2^8 assignments to 2 instances (writes study8.json; "
                        "uses --profile, --policies, --seed; ignores the workload and --instances)")
    p.add_argument("--seeds", type=int, default=1,
                   help="run seeds SEED..SEED+N-1: generators are re-drawn per seed, traces cut into N "
                        "contiguous windows (of --limit requests each if given); prints paired 95%% intervals "
                        "of the change against round_robin (default 1)")
    p.add_argument("--load", type=float, default=None,
                   help="arrival rate as a multiple of round robin's saturated throughput on this workload and "
                        "pool (e.g. 0.8, 1.5, 2); excludes --rate")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="override the profile's max_model_len (tokens); must fit its KV cache")
    p.add_argument("--capacity-slo", default=None, metavar="LIMITS",
                   help="capacity-at-SLO mode: per policy, the highest arrival rate whose summary meets LIMITS, "
                        "e.g. ttft_p90=2,tpot_p90=0.05 (seconds; keys ttft/tpot/e2e _mean/_p50/_p90/_p99); "
                        "writes capacity.json")
    p.add_argument("--slo-tolerance", type=float, default=0.02,
                   help="relative tolerance of --capacity-slo's bisection (default 0.02 = 2%%)")
    p.add_argument("--jobs", "-j", type=int, default=None,
                   help="worker processes for --capacity-slo's searches, one per policy and seed (default: "
                        "the CPU count; 1 runs them in this process; results are identical either way)")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help="write change.png (change vs round_robin with 95%% intervals), ttft_cdf.png and "
                        "e2e_cdf.png (capacity.png with --capacity-slo) into DIR")


def _split_specs(text: str) -> list[str]:
    # ';' separates specs when parameters use ','; otherwise ',' separates names.
    if ";" in text:
        parts = text.split(";")
    elif ":" in text:
        parts = [text]
    else:
        parts = text.split(",")
    return [p.strip() for p in parts if p.strip()]


def _dqn_profile_notes(specs: list[str], profile: str) -> list[str]:
    """A note for each ``dqn`` spec whose checkpoint was trained on another hardware profile
    (the run goes ahead: a user may mean to test transfer). Unusable checkpoints are left
    to the policy's own error."""
    from routerd.policies.dqn.checkpoint import DEFAULT_CHECKPOINT, CheckpointError, load_checkpoint
    from routerd.policies.registry import PolicyError, parse_policy_spec

    notes = []
    for spec in specs:
        try:
            name, params = parse_policy_spec(spec)
            if name != "dqn":
                continue
            ck = load_checkpoint(str(params.get("checkpoint") or DEFAULT_CHECKPOINT))
        except (PolicyError, CheckpointError):
            continue
        mismatch = ck.profile_mismatch(profile)
        if mismatch:
            notes.append(f"{spec}: {mismatch}")
    return notes


def _print_notes(notes: list[str]) -> None:
    for note in notes:
        print(f"phasewise: note: {note}", file=sys.stderr)


#: Share of rejected requests (prompt >= max_model_len) above which bench prints a note.
REJECTED_NOTE_FRACTION = 0.10


class _Outputs:
    """A command's output files, checked before any simulation and written all or none.

    :meth:`file` refuses, before any time is spent, a path that is a folder or whose folder
    cannot be created or written. :meth:`write` writes each file to a temporary name in its
    own folder (so the final rename is atomic, same file system) and renames them into
    place only once all are written; an ``OSError`` on the way removes the temporaries and
    the folders it created and becomes a one-line :class:`UsageError` naming the path.
    """

    def __init__(self) -> None:
        self._flags: dict[Path, str] = {}

    @staticmethod
    def folder(flag: str, path: Path) -> None:
        """Refuse a folder ``path`` that exists as a non-folder, or that cannot be created or
        written (its nearest existing ancestor is not a writable folder).

        Raises:
            UsageError: naming ``flag`` and the path.
        """
        import os

        if path.exists() and not path.is_dir():
            raise UsageError(f"{flag} {path}: exists and is not a folder")
        parent = path
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise UsageError(f"{flag} {path}: {parent} is not a folder")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {path}: cannot write into {parent}")

    def file(self, flag: str, path: Path) -> None:
        """Register output file ``path`` (given by option ``flag``) after checking it.

        Raises:
            UsageError: ``path`` is a folder (or another non-file), or its folder fails
                :meth:`folder`.
        """
        self.folder(flag, path.parent)
        if path.is_dir():
            raise UsageError(f"{flag} {path.parent}: {path} is a folder; cannot write {path.name} there")
        if path.exists() and not path.is_file():
            raise UsageError(f"{flag} {path.parent}: {path} exists and is not a regular file")
        self._flags[path] = flag

    def write(self, writers) -> list[str]:
        """Run ``writers`` (``(path, fn)`` pairs, ``fn(tmp_path)`` writes the file; a return of
        ``False`` means it wrote nothing) and rename every result into place; returns the
        paths written, in order.

        Raises:
            UsageError: an ``OSError`` while writing or renaming (one line, naming the path).
        """
        import os
        import secrets

        created: list[Path] = []
        temps: list[tuple[Path, Path]] = []
        path = None
        try:
            for path, fn in writers:
                missing = []
                d = path.parent
                while not d.exists():
                    missing.append(d)
                    d = d.parent
                for d in reversed(missing):
                    d.mkdir()
                    created.append(d)
                tmp = path.with_name(f".{path.stem}.{os.getpid()}-{secrets.token_hex(4)}.tmp{path.suffix}")
                temps.append((tmp, path))
                if fn(tmp) is False:
                    temps.pop()
                    tmp.unlink(missing_ok=True)
            for tmp, path in temps:
                os.replace(tmp, path)
        except OSError as e:
            for tmp, _ in temps:
                try:
                    tmp.unlink(missing_ok=True)
                except OSError:
                    pass
            for d in reversed(created):
                try:
                    d.rmdir()
                except OSError:
                    pass
            flag = self._flags.get(path, "output")
            raise UsageError(f"{flag} {path}: cannot write the file ({e.strerror or e})") from None
        return [str(p) for _, p in temps]


def _textless_note(prediction: str, workload: str, textless: int, with_task: int, total: int,
                   pred: object = None) -> str:
    """The note for ``--prediction predictor:SPEC`` on requests without prompt text (traces:
    ``Request.prompt`` is None): what the predictor reads there instead. The baselines never read
    text, so for them it only says so."""
    from routerd.predictor import BASELINE_NAMES

    spec = prediction.partition(":")[2].strip()
    where = (f"workload {workload!r} has no prompt text" if textless == total else
             f"{textless} of {total} requests of workload {workload!r} have no prompt text")
    if spec in BASELINE_NAMES:
        return f"{where}; {prediction} never reads prompt text, so this changes nothing for it"
    prior = getattr(pred, "prior", None)
    if prior is not None:
        # The n-gram predictor gives text-less requests its training prior (ngram_predictor.py).
        b = int(prior.argmax())
        return (f"{where}; {prediction} gives {'them' if textless == total else 'those'} its training prior "
                f"(the class frequencies of its training rows, of their task when it knows it; overall "
                f"most likely bucket {b}), not a prediction from the prompt")
    if with_task == 0:
        uses = "prompt length alone (the requests have no task label either)"
    elif with_task == textless:
        uses = "prompt length and task label alone"
    else:
        uses = "prompt length (and task label when present) alone"
    return f"{where}; {prediction} predicts {'from' if textless == total else 'those from'} {uses}"


def _cmd_bench(args: argparse.Namespace) -> int:
    import math

    from routerd.bench import (SeedsResult, capacity_at_slo, eight_request_study, load_to_rate, parse_slo,
                               run_bench, seed_workloads, with_max_model_len)
    from routerd.bench_report import (format_capacity, format_intervals, format_study, format_table,
                                      plot_bench, plot_capacity, plot_cdfs, plot_changes, write_requests_csv)
    from routerd.profiles import get_profile, parse_pool, pool_admission_profile, pool_label, terms_key

    try:
        count: int | None = int(args.instances)
    except ValueError:
        count = None  # a pool: COUNTxPROFILE,...
    if count is not None and count < 1:
        raise UsageError(f"--instances must be >= 1, got {args.instances}")
    if count is None and args.profile is not None:
        raise UsageError(f"--instances {args.instances} names each instance's profile; drop --profile "
                         f"{args.profile}")
    if not (1e-4 <= args.action_interval < float("inf")):
        raise UsageError(f"--action-interval must be a finite number of seconds >= 1e-4, got {args.action_interval}")
    if args.seeds < 1:
        raise UsageError(f"--seeds must be >= 1, got {args.seeds}")
    if args.rate is not None and not (math.isfinite(args.rate) and args.rate > 0):
        raise UsageError(f"--rate must be a finite number of requests/s > 0, got {args.rate}")
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be a positive number of requests, got {args.limit}")
    if args.load is not None:
        if not (math.isfinite(args.load) and args.load > 0):
            raise UsageError(f"--load must be a finite multiple > 0 of round robin's capacity, got {args.load}")
        if args.rate is not None:
            raise UsageError("--load and --rate both set the arrival rate; give one")
    limits = None
    if args.capacity_slo is not None:
        try:
            limits = parse_slo(args.capacity_slo)
        except ValueError as e:
            raise UsageError(f"--capacity-slo: {e}") from None
        if args.rate is not None or args.load is not None:
            raise UsageError("--capacity-slo searches the arrival rate; drop --rate / --load")
        if not (0 < args.slo_tolerance <= 1):
            raise UsageError(f"--slo-tolerance must be in (0, 1], got {args.slo_tolerance}")
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1 worker processes, got {args.jobs}")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise UsageError(f"--max-model-len must be >= 1 tokens, got {args.max_model_len}")
    if count is not None:
        profile = get_profile(args.profile if args.profile is not None else DEFAULT_PROFILE)
        if args.max_model_len is not None:
            profile = with_max_model_len(profile, args.max_model_len)
        pool = (profile,) * count
    else:
        pool = parse_pool(args.instances)
        if args.max_model_len is not None:
            changed = {p.name: with_max_model_len(p, args.max_model_len) for p in pool}
            pool = tuple(changed[p.name] for p in pool)
        count = len(pool)
        if args.study8:
            raise UsageError("--study8 runs 2 instances of one --profile; it takes no pool in --instances")
    args.instances = count
    # A pool of one profile runs exactly as --profile with a count; a mixed one as the tuple.
    mixed = len({p.name for p in pool}) > 1
    profile = pool if mixed else pool[0]
    ref = pool_admission_profile(pool)  # the max_model_len every request must fit
    label = pool_label(pool)
    # The 8-request study runs on 2 instances whatever --instances says.
    m = 2 if args.study8 else args.instances
    if args.policies is not None:
        specs = _split_specs(args.policies)
        notes = _dqn_profile_notes(specs, label)
    else:
        from routerd.policies.registry import default_bench_policies

        # ``dqn`` only where the shipped checkpoint fits; the notes are printed once the input is valid.
        specs, notes = default_bench_policies(m, label)
        # Mixed for the policies: profile terms that differ (a copy of a profile under another
        # name is not), as the operator decides its default (phasewise_operator.spec.mixed_hardware).
        if mixed and len({terms_key(p) for p in pool}) > 1:
            # The one policy that prices each instance with its own profile: the operator's default
            # for such a pool (docs/rl.md), so the default table shows it beside the blind ones.
            specs.insert(specs.index("oracle") if "oracle" in specs else len(specs), "predicted_latency")
            notes.append("a mixed pool: predicted_latency added to the default policies (it reads each "
                         "instance's own profile; the others read the first)")
    if not specs:
        raise UsageError("--policies is empty")
    if not args.prediction.startswith("predictor:"):
        from routerd.sim.prepare import parse_prediction

        parse_prediction(args.prediction)
    elif args.study8:
        raise UsageError(f"--study8 simulates its own 8 requests, which have no prompts to predict from; "
                         f"--prediction {args.prediction} needs a workload (use true, noisy[:ACC] or none)")
    # Path("") is the current folder: an empty value is a mistake, not a request to write here.
    if not args.out.strip():
        raise UsageError("--out is empty; give a folder (default bench-out)")
    if args.plot is not None and not args.plot.strip():
        raise UsageError("--plot is empty; give a folder")
    out = Path(args.out)
    plot_dir = Path(args.plot) if args.plot is not None else None
    # Every output is checked now, before any simulation, and written all together at the end.
    outputs = _Outputs()
    outputs.folder("--out", out)
    if plot_dir is not None:
        outputs.folder("--plot", plot_dir)
    if args.study8:
        outputs.file("--out", out / "study8.json")
    elif limits is not None:
        outputs.file("--out", out / "capacity.json")
        if plot_dir is not None:
            outputs.file("--plot", plot_dir / "capacity.png")
    else:
        for name in ("bench.json", "requests.csv") + (() if args.no_plot else ("bench.png",)):
            outputs.file("--out", out / name)
        if plot_dir is not None:
            for name in ("change.png", "ttft_cdf.png", "e2e_cdf.png"):
                outputs.file("--plot", plot_dir / name)
    if args.study8:
        _print_notes(notes)
        study = eight_request_study(profile, specs, seed=args.seed, prediction=args.prediction)
        print(format_study(study))
        text = json.dumps(study.as_dict(), indent=2)
        written = outputs.write([(out / "study8.json", lambda p: p.write_text(text))])
        print("wrote " + ", ".join(written))
        return 0
    seeds = [args.seed + i for i in range(args.seeds)]
    wls = seed_workloads(args.workload, seeds, rate=args.rate, limit=args.limit, n=args.n,
                         data_dir=args.data_dir)
    pred = None
    per_seed = []  # (seed, workload, requests, prediction mode)
    offered = rejected = 0
    textless = textless_tasks = predicted = 0  # requests given to a predictor: without text, of which with a task
    exact = 0  # of those, predicted in the bucket of their true output length
    from routerd.model import bucket_of
    for seed, wl in zip(seeds, wls):
        requests, prediction = wl.requests, args.prediction
        fitting = sum(1 for r in requests if r.prompt_tokens < ref.max_model_len)
        if fitting == 0:
            raise UsageError(f"all {len(requests)} requests of {wl.name!r} are rejected: every prompt is "
                             f">= max_model_len={ref.max_model_len} of profile {ref.name!r}")
        offered += len(requests)
        rejected += len(requests) - fitting
        if prediction.startswith("predictor:"):
            # A real predictor, run once per request before simulating (mode "given").
            from routerd.model import PREDICTOR_BUCKET_EDGES
            from routerd.predictor import assign_predictions, load_predictor

            if pred is None:
                pred = load_predictor(prediction.partition(":")[2], data_dir=args.data_dir,
                                      edges=PREDICTOR_BUCKET_EDGES)
            bare = [r for r in requests if not r.prompt]
            predicted += len(requests)
            textless += len(bare)
            textless_tasks += sum(1 for r in bare if r.task)
            requests = assign_predictions(requests, pred, edges=PREDICTOR_BUCKET_EDGES)
            prediction = "given"
            exact += sum(1 for r in requests if r.predicted_bucket == bucket_of(r.output_tokens, PREDICTOR_BUCKET_EDGES))
        elif prediction == "given" and any(r.predicted_bucket is None for r in requests):
            raise UsageError(f"--prediction given: workload {wl.name!r} carries no predictions; "
                             "use --prediction predictor:SPEC (default, majority, task-prior, length-only, "
                             "length+task or a trained model folder)")
        per_seed.append((seed, wl, requests, prediction))
    if textless:
        notes.append(_textless_note(args.prediction, wls[0].name, textless, textless_tasks, predicted, pred))
    if getattr(pred, "unknown_tasks", 0):
        notes.append(f"{pred.unknown_tasks} of {predicted} requests carry a task label {pred.name} was not "
                     "trained on; it predicts them as requests without a task")
    if predicted:
        notes.append(f"{args.prediction} ({pred.name}) put {exact} of {predicted} requests "
                     f"({100 * exact / predicted:.1f}%) in the bucket of their true output length")
    if rejected > REJECTED_NOTE_FRACTION * offered:
        # vLLM refuses such prompts; a silent count in the header hides that the bench ran on part of the trace.
        long_ctx = "llama3.1-8b-h100"
        hint = ("raise --max-model-len" if ref.name == long_ctx else
                f"use a long-context profile (--profile {long_ctx}) or raise --max-model-len")
        notes.append(f"{rejected} of {offered} requests of {wls[0].name!r} ({100 * rejected / offered:.0f}%) are "
                     f"rejected: their prompts are >= max_model_len={ref.max_model_len} of profile "
                     f"{ref.name!r}, so only the rest are simulated; {hint}")
    _print_notes(notes)
    mml = f" max_model_len={ref.max_model_len} (--max-model-len)" if args.max_model_len is not None else ""
    base_progress = _progress_factory()

    def progress_for(seed: int):
        if base_progress is None or len(seeds) == 1:
            return base_progress
        return lambda spec, total: base_progress(f"{spec} (seed {seed})", total)

    if limits is not None:
        return _bench_capacity(args, profile, specs, per_seed, limits, out, plot_dir, outputs,
                               format_capacity, plot_capacity, capacity_at_slo, label, ref)

    benches, loads = [], []
    for seed, wl, requests, prediction in per_seed:
        extra = mml
        if args.load is not None:
            requests, cap, rate = load_to_rate(requests, profile, args.instances, args.load)
            loads.append((cap, rate))
            extra = f" load={args.load:g}x round_robin capacity ({cap:.2f} req/s) = {rate:.2f} req/s" + extra
        bench = run_bench(requests, profile, args.instances, specs, workload_name=wl.name,
                          prediction=prediction, seed=seed, action_interval_s=args.action_interval,
                          progress_factory=progress_for(seed))
        # Simulated with the predictions assigned up front ("given"); report which predictor made them.
        bench.prediction = args.prediction
        bench.header_extra = extra
        benches.append(bench)
    result = SeedsResult(benches)
    shown = result.mean_bench()
    if loads and len(loads) > 1:
        cap = sum(c for c, _ in loads) / len(loads)
        rate = sum(r for _, r in loads) / len(loads)
        shown.header_extra = (f" load={args.load:g}x round_robin capacity (mean {cap:.2f} req/s) = mean "
                              f"{rate:.2f} req/s") + mml
    print(format_table(shown))
    if len(benches) > 1:
        ivs = format_intervals(result)
        if ivs:
            print(ivs)
    data = result.as_dict()
    descs = [wl.description for _, wl, _, _ in per_seed]
    data["workload_description"] = descs[0] if len(descs) == 1 else descs
    data["max_model_len"] = ref.max_model_len
    if mixed:
        data["pool"] = [p.name for p in pool]
    if args.load is not None:
        data["load"] = {"load": args.load, "capacity_rps": [c for c, _ in loads], "rate_rps": [r for _, r in loads]}
    text = json.dumps(data, indent=2)
    writers = [(out / "bench.json", lambda p: p.write_text(text)),
               (out / "requests.csv", lambda p: write_requests_csv(benches, p))]
    if not args.no_plot:
        writers.append((out / "bench.png", lambda p: plot_bench(shown, p)))
    if plot_dir is not None:
        cdf: dict[str, Path] = {}
        writers += [(plot_dir / "change.png", lambda p: plot_changes(result, p)),
                    # plot_cdfs writes both CDFs in one call; the second writer only hands over its path.
                    (plot_dir / "ttft_cdf.png", lambda p: cdf.update(ttft=p)),
                    (plot_dir / "e2e_cdf.png", lambda p: plot_cdfs(benches, cdf["ttft"], p))]
    print("wrote " + ", ".join(outputs.write(writers)))
    return 0


def _bench_capacity(args, profile, specs, per_seed, limits, out, plot_dir, outputs, format_capacity,
                    plot_capacity, capacity_at_slo, label, ref) -> int:
    """``phasewise bench --capacity-slo``: capacity at SLO per policy and seed, the searches in
    ``--jobs`` parallel processes (:func:`routerd.bench.capacities_at_slo`)."""
    from routerd.bench import SloSearch, capacities_at_slo

    # Round robin's saturated throughput is every policy's first probe: computed once per seed.
    searches = [SloSearch(requests, profile, args.instances, limits, seed=seed, prediction=prediction,
                          tol=args.slo_tolerance, action_interval_s=args.action_interval)
                for seed, wl, requests, prediction in per_seed]
    per = capacities_at_slo(searches, specs, jobs=args.jobs)
    starts = [s.start_rate for s in searches]
    caps: dict[str, list] = {spec: [p[spec] for p in per] for spec in specs}
    seeds = [s for s, _, _, _ in per_seed]
    print(f"workload={per_seed[0][1].name} profile={label} instances={args.instances} "
          f"prediction={args.prediction}")
    print(format_capacity(caps, limits, seeds, args.slo_tolerance))
    data = {
        "workload": per_seed[0][1].name, "profile": label, "instances": args.instances,
        "max_model_len": ref.max_model_len, "prediction": args.prediction, "seeds": seeds,
        "limits_s": limits, "tolerance": args.slo_tolerance, "round_robin_saturated_rps": starts,
        "workload_description": [wl.description for _, wl, _, _ in per_seed],
        "results": {spec: [c.as_dict() for c in cs] for spec, cs in caps.items()},
    }
    text = json.dumps(data, indent=2)
    writers = [(out / "capacity.json", lambda p: p.write_text(text))]
    if plot_dir is not None:
        writers.append((plot_dir / "capacity.png", lambda p: plot_capacity(caps, limits, p)))
    print("wrote " + ", ".join(outputs.write(writers)))
    return 0


def _progress_factory():
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    def make(spec: str, total: int):
        bar = tqdm(total=total, desc=spec, unit="req", leave=False, file=sys.stderr)

        def update(k: int) -> None:
            bar.update(k)
            if bar.n >= total:
                bar.close()

        return update

    return make


def _train_parser(sub: argparse._SubParsersAction) -> None:
    from routerd.rl.recipes import RECIPES
    from routerd.rl.reward import REWARD_VARIANTS

    p = sub.add_parser(
        "train",
        help="train the Double-DQN router on the simulator and write a checkpoint",
        description="Train on the training part of a workload (routerd.rl.splits) and write "
        "model.safetensors + metadata.json into --output. Needs the rl extra (torch).",
    )
    p.add_argument("--variant", default="workload-guided", choices=REWARD_VARIANTS, help="reward variant")
    p.add_argument("--workload", "-w", default="public-mix", help="training workload name")
    p.add_argument("--instances", "-m", type=int, default=DEFAULT_INSTANCES)
    p.add_argument("--profile", "-p", default=DEFAULT_PROFILE)
    p.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                   help="a named preset of the settings below (routerd.rl.recipes; 'bc' made the shipped "
                        "checkpoint); flags given explicitly win")
    p.add_argument("--episodes", type=int, default=None, help="training episodes (default 30)")
    p.add_argument("--requests-per-episode", type=int, default=1000)
    p.add_argument("--rate", type=float, default=20.0, help="episode arrival rate (req/s); 0 keeps a trace's rate")
    p.add_argument("--prediction", default="true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--output", "-o", default="checkpoints/dqn", help="checkpoint folder to write")
    p.add_argument("--demo-policy", default=None,
                   help="heuristic whose routing is learned from first (DQfD pre-training; e.g. late_binding)")
    p.add_argument("--demo-episodes", type=int, default=None, help="episodes demonstrated by --demo-policy (default 6)")
    p.add_argument("--pretrain-steps", type=int, default=None,
                   help="gradient steps on the demonstrations alone (default 3000)")
    p.add_argument("--pretrain-loss", default=None, choices=["dqfd", "cross-entropy"],
                   help="dqfd (TD + large margin; default) or cross-entropy (behaviour cloning)")
    p.add_argument("--select-samples", type=int, default=None,
                   help="validation samples from the training part used to keep the best weights "
                        "(default 0: keep the last)")
    p.add_argument("--quiet", action="store_true", help="no per-episode log or progress bar")


def _train_linear_parser(sub: argparse._SubParsersAction) -> None:
    from routerd.rl.es import add_arguments

    p = sub.add_parser(
        "train-linear",
        help="learn learned_linear's weights by evolution strategies on the simulator (no torch)",
        description="Evolution strategies for learned_linear (routerd/routerd/rl/es.py): start at late_binding's "
        "weights, score whole training samples against it, keep the result only if it beats it on validation "
        "samples; writes linear.json into --output (learned_linear:checkpoint=FOLDER).",
    )
    add_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no per-generation log; print only the checkpoint's path")


def _cmd_train_linear(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from routerd.rl.es import ESArgs, train_es

    a = ESArgs(**{f.name: getattr(args, f.name) for f in fields(ESArgs)})
    try:
        path = train_es(a, log=(lambda _msg: None) if args.quiet else print)
    except ValueError as e:  # ProfileError and WorkloadError are ValueErrors too
        raise UsageError(str(e).splitlines()[0]) from None
    if args.quiet:
        print(path)
    return 0


def _check_output_folder(out: Path) -> None:
    """Refuse, before any training time is spent, an ``--output`` that cannot become a folder."""
    import os

    if out.exists() and not out.is_dir():
        raise UsageError(f"--output {out}: exists and is not a folder")
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"--output {out}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--output {out}: cannot write into {parent}")


def _cmd_train(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UsageError("phasewise train needs torch: pip install -e '.[rl]'") from None
    from routerd.profiles import get_profile
    from routerd.rl.recipes import RECIPES
    from routerd.rl.splits import GENERATORS
    from routerd.rl.train import Args, train
    from routerd.sim.prepare import parse_prediction
    from routerd.workloads.registry import load_workload

    settings: dict = {"episodes": 30, "demo_episodes": 6, "pretrain_steps": 3000, "pretrain_loss": "dqfd",
                      "select_samples": 0, "demo_policy": None, "explore_episodes": 20}
    settings.update(RECIPES[args.recipe] if args.recipe else {})
    for key in ("episodes", "demo_episodes", "pretrain_steps", "pretrain_loss", "select_samples", "demo_policy"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    settings["demo_policy"] = settings["demo_policy"] or None  # --demo-policy '' turns a recipe's off
    settings["explore_episodes"] = min(settings["explore_episodes"], settings["episodes"])
    if args.instances < 1 or settings["episodes"] < 1 or args.requests_per_episode < 1:
        raise UsageError("--instances, --episodes and --requests-per-episode must be >= 1")
    for flag, key, low in (("--demo-episodes", "demo_episodes", 1), ("--pretrain-steps", "pretrain_steps", 0),
                           ("--select-samples", "select_samples", 0)):
        if settings[key] < low:
            raise UsageError(f"{flag} must be >= {low}, got {settings[key]}")
    _check_output_folder(Path(args.output))
    if settings["demo_policy"]:
        from routerd.policies.registry import build_policy_from_spec
        from routerd.policies.base import PolicyContext

        # A bad policy spec fails here, before any training time is spent.
        build_policy_from_spec(settings["demo_policy"], PolicyContext(get_profile(args.profile), args.instances))
    if args.rate is not None and args.rate < 0:
        raise UsageError(f"--rate must be >= 0, got {args.rate}")
    get_profile(args.profile)
    parse_prediction(args.prediction)  # train takes the simulator's modes only
    # Fail on a bad workload name or missing data before any training time is spent.
    n_check = 1 if args.workload in GENERATORS else None
    load_workload(args.workload, n=n_check, limit=1, data_dir=args.data_dir)
    a = Args(variant=args.variant, workload=args.workload, instances=args.instances, profile=args.profile,
             requests_per_episode=args.requests_per_episode, rate=args.rate or None, prediction=args.prediction,
             seed=args.seed, data_dir=args.data_dir, output=args.output, **settings)
    log = (lambda _msg: None) if args.quiet else print
    try:
        path = train(a, log=log, progress=not args.quiet and sys.stderr.isatty())
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.quiet:
        print(path)  # the one line a script needs
    return 0


def _plain(text: str) -> str:
    """Docstring markup as a terminal reads it: ``code`` and :role:`~a.b.name` lose their marks
    (a ``~`` keeps the last dotted part, as Sphinx shows it), on one line."""
    import re

    text = re.sub(r":[a-z]+:`(~?)([^`]+)`", lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), text)
    return " ".join(text.replace("``", "").split())


def _cmd_policies(args: argparse.Namespace) -> int:
    from routerd.policies.registry import DEFAULT_BENCH_POLICIES, POLICIES

    for name, cls in POLICIES.items():
        # The class docstring's first paragraph, on one line (some wrap their summary).
        doc = _plain((cls.__doc__ or "").strip().split("\n\n")[0])
        tags = [t for t, on in (("oracle", cls.oracle), ("default", name in DEFAULT_BENCH_POLICIES)) if on]
        print(f"{name}{' [' + ', '.join(tags) + ']' if tags else ''}: {doc}")
        for field, info in cls.Params.model_fields.items():
            print(f"    {field} = {info.default!r}  {_plain(info.description or '')}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``phasewise``."""
    from routerd import __version__

    parser = argparse.ArgumentParser(prog="phasewise", description="Phasewise: workload-aware LLM request routing.")
    parser.add_argument("--version", action="version", version=f"phasewise {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _bench_parser(sub)
    sub.add_parser("policies", help="list the routing policies with their parameters and defaults")
    from routerd.predictor.cli import add_parser as add_predictor_parser

    add_predictor_parser(sub)
    _train_parser(sub)
    _train_linear_parser(sub)
    for module in _DATA_PLANE_COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


#: Data-plane commands: each module has ``add_parser(sub)`` and ``run(args) -> int``
#: and raises :class:`routerd.errors.ConfigError` for bad input (one line, exit 2).
_DATA_PLANE_COMMANDS = {
    "serve": "routerd.daemon.cli",
    "epp": "routerd.epp.cli",
    "sidecar": "routerd.sidecar.cli",
    "emulate": "routerd.emulator.cli",
    "profile": "routerd.profiler.cli",
}


def run_data_plane_command(command: str, argv: Sequence[str] | None = None) -> int:
    """``python -m routerd.<package> [flags]``: one data-plane command, importing only its module.

    The same as ``phasewise <command> [flags]`` without loading the other commands
    (faster start-up for the daemon, sidecar and emulator processes). Bad settings print
    one line and return 2.
    """
    from routerd.errors import ConfigError

    module = importlib.import_module(_DATA_PLANE_COMMANDS[command])
    parser = argparse.ArgumentParser(prog=f"python -m {module.__name__.rsplit('.', 1)[0]}")
    module.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args([command, *(sys.argv[1:] if argv is None else argv)])
    try:
        return module.run(args)
    except ConfigError as e:
        print(f"phasewise: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``phasewise`` console script; returns the exit code."""
    from routerd.policies.registry import PolicyError
    from routerd.predictor import PredictorError
    from routerd.profiles import ProfileError
    from routerd.sim import PredictionError, SimulationError
    from routerd.errors import ConfigError
    from routerd.workloads.errors import WorkloadError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "bench":
            return _cmd_bench(args)
        if args.command == "train":
            return _cmd_train(args)
        if args.command == "train-linear":
            return _cmd_train_linear(args)
        if args.command == "policies":
            return _cmd_policies(args)
        if args.command == "predictor":
            from routerd.predictor.cli import run as run_predictor

            return run_predictor(args)
        if args.command in _DATA_PLANE_COMMANDS:
            return importlib.import_module(_DATA_PLANE_COMMANDS[args.command]).run(args)
    except (UsageError, ConfigError, PolicyError, PredictorError, ProfileError, PredictionError, SimulationError,
            WorkloadError) as e:
        print(f"phasewise: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        # An optional extra is missing (scikit-learn, torch, transformers, gymnasium).
        print(f"phasewise: error: {args.command} needs the Python package {e.name!r}, which is not "
              f"installed; install the extras: pip install -e '.[rl,predictor]'", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader of our output went away (e.g. `| head`): not an error worth a traceback.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("phasewise: interrupted", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
