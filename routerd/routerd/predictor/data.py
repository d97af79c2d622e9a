"""Training data for the length predictor: prompt/response rows and a seeded, stratified split.

Rows come from ``<data_dir>/prompts/*.jsonl.gz`` through the same reader as the
``public-mix`` workload (:func:`routerd.workloads.public_mix.public_mix_groups`), so a
task label here is exactly a workload task label (``source:task``) and the AlpacaEval
rows are, by default, only the ``llama-2-7b-chat-hf`` answers (the workload's stand-in
for the paper's Llama-2-7B; AlpacaEval holds 44 models' answers to the *same* 805
prompts, whose lengths disagree, so mixing models would give one prompt many labels).

Licenses (``shared/data/PROVENANCE.md`` §2): arena_hard_answers Apache-2.0,
gpteacher_gpt4 MIT; sharegpt_v3_first_turn contested and alpaca_eval_multimodel
CC BY-NC 4.0 (experiments and evaluation only, never shipped).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from routerd.buckets import PREDICTOR_BUCKET_EDGES, bucket_of

#: Prompt files (stems of ``prompts/<stem>.jsonl.gz``) whose licenses allow shipping
#: a model trained on them (Apache-2.0, MIT).
PERMISSIVE_SOURCES: tuple[str, ...] = ("arena_hard_answers", "gpteacher_gpt4")
#: Licence of each prompt file (``shared/data/PROVENANCE.md`` §2); only the first two
#: allow shipping a model trained on them.
SOURCE_LICENSES: dict[str, str] = {
    "arena_hard_answers": "Apache-2.0",
    "gpteacher_gpt4": "MIT",
    "sharegpt_v3_first_turn": "contested (research only, never shipped)",
    "alpaca_eval_multimodel": "CC BY-NC 4.0 (non-commercial research only, never shipped)",
}
#: Prompt file of each dataset (the part of a task label before ``:``).
_DATASET_SOURCES: dict[str, str] = {
    "arena-hard": "arena_hard_answers",
    "gpteacher": "gpteacher_gpt4",
    "sharegpt": "sharegpt_v3_first_turn",
    "alpaca_eval": "alpaca_eval_multimodel",
}


def source_of(dataset: str) -> str:
    """The prompt file stem a dataset name comes from (``arena-hard-v2.0`` -> ``arena_hard_answers``),
    or the dataset itself when unknown."""
    for prefix, stem in _DATASET_SOURCES.items():
        if dataset.startswith(prefix):
            return stem
    return dataset


#: Default split fractions (train, validation, test).
SPLIT_FRACTIONS: tuple[float, float, float] = (0.8, 0.1, 0.1)
SPLITS: tuple[str, ...] = ("train", "val", "test")


@dataclass(frozen=True)
class Row:
    """One prompt/response pair. Token counts are cl100k_base tokens (see PROVENANCE)."""

    prompt: str
    prompt_tokens: int
    response_tokens: int
    task: str
    """``source:task`` label, e.g. ``gpteacher:coding``."""

    @property
    def dataset(self) -> str:
        """The source part of the task label, e.g. ``arena-hard-v2.0``."""
        return self.task.split(":", 1)[0]


def load_rows(
    data_dir: str | Path | None = None,
    *,
    sources: Sequence[str] | None = None,
    alpaca_model: str | None = "llama-2-7b-chat-hf",
) -> list[Row]:
    """All usable rows of the prompt files, grouped by task label (sorted), file order within.

    Args:
        data_dir: the shared data directory (holding ``prompts/``); ``None`` searches as
            :func:`routerd.workloads.registry.resolve_data_dir` does.
        sources: file stems to read (``None`` = all four prompt files).
        alpaca_model: AlpacaEval generator to keep, ``None`` for all 44.

    Rows with a 0-token prompt or response are dropped (as in ``public-mix``); prompts
    of any length are kept (the predictor truncates them).

    Raises:
        routerd.workloads.errors.WorkloadError: no data directory, unknown source, bad file.
    """
    from routerd.workloads.public_mix import public_mix_groups
    from routerd.workloads.registry import resolve_data_dir

    root = resolve_data_dir(data_dir, needed_by="the length predictor")
    groups, _ = public_mix_groups(root, max_prompt_tokens=10**9, alpaca_model=alpaca_model, sources=sources)
    rows: list[Row] = []
    for label, g in groups.items():
        for p, pt, rt in zip(g.prompts, g.prompt_tokens, g.response_tokens):
            rows.append(Row(p, int(pt), int(rt), label))
    return rows


def labels_of(rows: Sequence[Row], edges: Sequence[int] = PREDICTOR_BUCKET_EDGES) -> np.ndarray:
    """Bucket of each row's true response length, int64 array of shape (len(rows),)."""
    e = tuple(edges)
    return np.fromiter((bucket_of(r.response_tokens, e) for r in rows), dtype=np.int64, count=len(rows))


def split_rows(
    rows: Sequence[Row],
    *,
    seed: int = 0,
    edges: Sequence[int] = PREDICTOR_BUCKET_EDGES,
    fractions: tuple[float, float, float] = SPLIT_FRACTIONS,
) -> dict[str, np.ndarray]:
    """Seeded train/val/test split, grouped by prompt text and stratified by (task, bucket).

    Rows with the same prompt text (duplicates, or one prompt answered by several
    models as in Arena-Hard v0.1) always land in the same split, so no test prompt is
    seen in training. Each prompt group gets the stratum (task of its first row,
    most frequent bucket of its rows; ties -> smaller bucket). Within a stratum the
    groups are ordered by SHA-1 of the prompt, permuted by the seeded generator, and
    the k-th of n groups goes to the split whose cumulative fraction first exceeds
    ``(k + u) / n``, ``u`` a seeded uniform offset per stratum — so every stratum is
    split in the given proportions up to one group, and strata of one or two groups
    are not all put in train.

    Args:
        rows: the rows.
        seed: generator seed; the same rows, seed, edges and fractions give the same split.
        edges: bucket edges used for the strata.
        fractions: (train, val, test) fractions, each >= 0, summing to 1.

    Returns:
        ``{"train": idx, "val": idx, "test": idx}``, sorted int64 row-index arrays that
        partition ``range(len(rows))``.
    """
    if len(fractions) != 3 or min(fractions) < 0 or abs(sum(fractions) - 1.0) > 1e-9:
        raise ValueError(f"fractions must be three non-negative numbers summing to 1, got {fractions}")
    labels = labels_of(rows, edges)
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(r.prompt, []).append(i)
    strata: dict[tuple[str, int], list[tuple[str, list[int]]]] = {}
    for prompt, idx in groups.items():
        c = Counter(int(labels[i]) for i in idx)
        majority = min(c, key=lambda b: (-c[b], b))
        key = hashlib.sha1(prompt.encode("utf-8", errors="replace")).hexdigest()
        strata.setdefault((rows[idx[0]].task, majority), []).append((key, idx))
    rng = np.random.default_rng(seed)
    cum = np.cumsum(fractions)
    out: dict[str, list[int]] = {s: [] for s in SPLITS}
    for stratum in sorted(strata):
        members = sorted(strata[stratum], key=lambda m: m[0])
        order = rng.permutation(len(members))
        u = rng.random()
        n = len(members)
        for k, j in enumerate(order):
            pos = (k + u) / n
            s = SPLITS[min(int(np.searchsorted(cum, pos, side="right")), 2)]
            out[s].extend(members[j][1])
    return {s: np.array(sorted(v), dtype=np.int64) for s, v in out.items()}


def cap_per_task(
    rows: Sequence[Row],
    idx: np.ndarray,
    cap: int | None,
    seed: int = 0,
    *,
    labels: np.ndarray | None = None,
    min_purity: float = 0.0,
) -> np.ndarray:
    """At most ``cap`` row indices per task from ``idx`` (seeded choice), sorted.

    With ``labels`` and ``min_purity``, only tasks whose most frequent label covers at
    least ``min_purity`` of their rows in ``idx`` are capped. Used on the *training*
    split to spend the CPU budget where the labels are uncertain: GPTeacher's 11k
    training rows are 99.8% bucket 0 and teach little after the first thousand.
    """
    if cap is None:
        return idx
    rng = np.random.default_rng(seed)
    by_task: dict[str, list[int]] = {}
    for i in idx:
        by_task.setdefault(rows[int(i)].task, []).append(int(i))
    keep: list[int] = []
    for t in sorted(by_task):
        ids = by_task[t]
        pure = True
        if labels is not None and min_purity > 0:
            pure = np.bincount(labels[ids]).max() >= min_purity * len(ids)
        keep.extend(ids if len(ids) <= cap or not pure else rng.choice(ids, size=cap, replace=False).tolist())
    return np.array(sorted(keep), dtype=np.int64)


def describe(rows: Sequence[Row], split: dict[str, np.ndarray], edges: Sequence[int]) -> dict:
    """Counts per split and bucket, and per task and split (for metadata and reports)."""
    labels = labels_of(rows, edges)
    n_b = len(edges) + 1
    out: dict = {"buckets": {}, "tasks": {}}
    for s, idx in split.items():
        out["buckets"][s] = np.bincount(labels[idx], minlength=n_b).tolist()
        for i in idx:
            out["tasks"].setdefault(rows[int(i)].task, {x: 0 for x in split})[s] += 1
    out["tasks"] = dict(sorted(out["tasks"].items()))
    return out
