"""Train the checkpoints of the RL table (issue #3, deliverable 5): variants x instance counts x seeds.

Each run is ``routerd.rl.train.train`` on the *training* part of public-mix at the paper's
rate (5 req/s per instance: 20 req/s on 4 instances, 40 on 8), 1,000 requests per
episode, profile ``llama2-7b-v100``. Model selection uses validation samples from the
training part only (``Args.select_samples``); held-out samples are never seen, so
``benchmarks/rl_eval.py`` can evaluate the checkpoints on them afterwards.

Recipes (``--recipes``, defined in ``routerd.rl.recipes.RECIPES``):

* ``paper``: the paper's Double DQN, once per reward variant (baseline, workload-aware,
  workload-guided);
* ``bc``: behaviour cloning of ``late_binding``, then RL with the workload-guided reward
  (our recipe; the shipped default checkpoint).

Output: ``OUT/<recipe>-<variant>-m<M>-s<SEED>/`` checkpoint folders and a ``.log`` beside
each. A folder that already holds ``metadata.json`` is skipped, so an interrupted run
resumes. ``--workers`` runs trainings in parallel processes (one torch thread each).

Usage:
    PYTHONPATH=routerd python benchmarks/rl_train_table.py --out ckpts [--seeds 0,1,2,3,4]
        [--instances 4,8] [--recipes paper,bc] [--variants baseline,workload-aware,workload-guided]
        [--workers 2]
    PYTHONPATH=routerd python benchmarks/rl_train_table.py --out ckpts --pick 4

Then: ``python benchmarks/rl_eval.py --checkpoint "wg=ckpts/paper-workload-guided-m4-s0,..."``
(``--table-dir ckpts`` adds every recipe and variant found, seeds comma-joined).
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from routerd.rl.reward import REWARD_VARIANTS
from routerd.rl.recipes import RECIPES, RUN_NAME, run_name

RATE_PER_INSTANCE = 5.0
"""req/s per instance of the paper's regime (arXiv 2408.13510 §6)."""

RECIPE_VARIANTS = {"paper": REWARD_VARIANTS, "bc": ("workload-guided",)}


def train_one(recipe: str, variant: str, m: int, seed: int, out: str) -> tuple[str, float, str]:
    """Train one checkpoint (in a worker process); returns (folder, seconds, last log line)."""
    from routerd.rl.train import Args, train

    folder = Path(out) / run_name(recipe, variant, m, seed)
    log_path = folder.with_suffix(".log")
    t0 = time.perf_counter()
    lines: list[str] = []
    with log_path.open("w") as f:
        def log(msg: str) -> None:
            lines.append(msg)
            f.write(msg + "\n")
            f.flush()

        train(Args(variant=variant, instances=m, rate=RATE_PER_INSTANCE * m, seed=seed, output=str(folder),
                   torch_threads=1, **RECIPES[recipe]), log=log, progress=False)
    return str(folder), time.perf_counter() - t0, lines[-1] if lines else ""


def pick(out: str, m: int, samples: int = 3) -> tuple[str, list[tuple[float, str]]]:
    """The finished run for ``m`` instances with the lowest greedy mean E2E latency (s) on
    ``samples`` validation samples of public-mix's *training* part (indices
    ``routerd.rl.train.SELECT_INDEX_BASE + i``, the trainer's own selection samples; never
    held-out data). Returns (folder, [(E2E, folder)] sorted best first).

    Raises:
        FileNotFoundError: no finished run for ``m`` in ``out``.
    """
    from routerd.policies.dqn.checkpoint import load_checkpoint
    from routerd.profiles import get_profile
    from routerd.rl.train import SELECT_INDEX_BASE, Args, greedy_e2e

    from routerd.policies.dqn.checkpoint import CheckpointError
    from routerd.profiles import ProfileError

    root = Path(out)
    if not root.is_dir():
        raise FileNotFoundError(f"{out}: not a folder")
    scores, skipped = [], []
    for d in sorted(root.iterdir()):
        mt = RUN_NAME.match(d.name)
        if mt and int(mt["m"]) == m and (d / "metadata.json").is_file():
            try:
                ck = load_checkpoint(d, num_instances=m)
                profile = get_profile(str(ck.metadata.get("profile") or Args.profile))
            except (CheckpointError, ProfileError) as e:
                skipped.append(f"skipped: {e}")
                continue
            args = Args(instances=m, rate=RATE_PER_INSTANCE * m, profile=profile.name)
            idx = [SELECT_INDEX_BASE + i for i in range(samples)]
            scores.append((greedy_e2e(ck.weights, profile, m, args, "train", idx), str(d)))
    for note in skipped:
        print(note, file=sys.stderr)
    if not scores:
        raise FileNotFoundError(f"{out}: no finished run for {m} instances")
    scores.sort()
    return scores[0][1], scores


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the checkpoints")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--instances", default="4,8")
    ap.add_argument("--recipes", default="bc,paper")
    ap.add_argument("--variants", default=",".join(REWARD_VARIANTS))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--pick", type=int, default=None, metavar="M",
                    help="train nothing; rank the finished runs for M instances on training-part validation "
                         "samples and name the best (how the shipped default was chosen)")
    a = ap.parse_args(argv)
    if a.pick is not None:
        try:
            best, scores = pick(a.out, a.pick)
        except FileNotFoundError as e:
            print(f"rl_train_table.py: error: {e}", file=sys.stderr)
            return 2
        for e2e, folder in scores:
            print(f"{e2e:8.2f} s  {folder}")
        print(f"best: {best}")
        return 0
    try:
        seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
        ms = [int(x) for x in a.instances.split(",") if x.strip()]
    except ValueError:
        print("rl_train_table.py: error: --seeds and --instances are comma lists of integers", file=sys.stderr)
        return 2
    recipes = list(dict.fromkeys(r.strip() for r in a.recipes.split(",") if r.strip()))
    variants = list(dict.fromkeys(v.strip() for v in a.variants.split(",") if v.strip()))
    seeds, ms = list(dict.fromkeys(seeds)), list(dict.fromkeys(ms))
    problems = [f"unknown recipe {r!r} (recipes: {', '.join(RECIPES)})" for r in recipes if r not in RECIPES]
    problems += [f"unknown variant {v!r} (variants: {', '.join(REWARD_VARIANTS)})"
                 for v in variants if v not in REWARD_VARIANTS]
    if not seeds or min(seeds) < 0 or max(seeds) >= 2**32:
        problems.append(f"--seeds must be integers in 0..2**32-1, got {a.seeds!r}")
    if not ms or min(ms) < 1:
        problems.append(f"--instances must be integers >= 1, got {a.instances!r}")
    if a.workers < 1:
        problems.append(f"--workers must be >= 1, got {a.workers}")
    jobs = [(r, v, m, s) for m in ms for r in recipes if r in RECIPES for v in RECIPE_VARIANTS[r] if v in variants
            for s in seeds]
    if not problems and not jobs:
        problems.append(f"no run: recipes {', '.join(recipes) or '(none)'} have no variant in "
                        f"{', '.join(variants) or '(none)'} (bc trains workload-guided only)")
    if not problems:
        from routerd.rl.train import Args, check_sample_indices

        for r, v, m, s in jobs:  # seeds whose sample indices collide fail now, not in a worker
            try:
                check_sample_indices(Args(variant=v, instances=m, seed=s, **RECIPES[r]))
            except ValueError as e:
                problems.append(f"{run_name(r, v, m, s)}: {e}")
                break
    if problems:
        print(f"rl_train_table.py: error: {problems[0]}", file=sys.stderr)
        return 2
    try:
        Path(a.out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"rl_train_table.py: error: --out {a.out}: cannot create the folder ({e.strerror})", file=sys.stderr)
        return 2
    todo = [j for j in jobs if not (Path(a.out) / run_name(*j) / "metadata.json").exists()]
    print(f"{len(jobs)} runs, {len(jobs) - len(todo)} already done, {a.workers} workers", flush=True)
    t0 = time.perf_counter()
    failed = 0
    with ProcessPoolExecutor(a.workers) as pool:
        futs = {pool.submit(train_one, *j, a.out): j for j in todo}
        for fut in as_completed(futs):
            try:
                folder, secs, last = fut.result()
                print(f"{folder}: {secs:.0f} s; {last}", flush=True)
            except Exception as e:  # one failed run must not lose the others
                failed += 1
                print(f"{run_name(*futs[fut])}: FAILED: {type(e).__name__}: {e}", flush=True)
    print(f"done in {time.perf_counter() - t0:.0f} s; {failed} of {len(todo)} runs failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
