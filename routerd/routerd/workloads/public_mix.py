"""A mixed-task workload built from REAL prompt/response pairs of public datasets.

Reads ``<data_dir>/prompts/*.jsonl.gz`` (schema and licenses: ``shared/data/PROVENANCE.md``
§2): ShareGPT first turns (ChatGPT), Arena-Hard answers (OpenAI models), AlpacaEval 2.0
outputs (44 models; by default only ``llama-2-7b-chat-hf``), GPTeacher (GPT-4). Token
counts are the files' ``cl100k_base`` counts (GPT-3.5/4 tokenizer), not Llama-2's.
The datasets are read from the shared data directory at run time and never copied into
the package (ShareGPT's license is contested and AlpacaEval's data is CC BY-NC 4.0).
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from routerd.model import Request

from .errors import WorkloadError, row_error
from .traces import poisson_arrivals

#: AlpacaEval generator kept by default: the closest public stand-in for the router
#: paper's Llama-2-7B responses (arXiv 2408.13510 served Llama-2-7B).
DEFAULT_ALPACA_MODEL = "llama-2-7b-chat-hf"
#: File stem (``prompts/<stem>.jsonl.gz``) whose rows ``alpaca_model`` filters.
ALPACA_STEM = "alpaca_eval_multimodel"
_SUFFIX = ".jsonl.gz"


@dataclass(frozen=True)
class PromptGroup:
    """All usable rows of one task group (one ``source:task`` label), in file order.

    ``prompt_tokens`` and ``response_tokens`` are int64 arrays (tokens); ``prompts`` the
    matching prompt texts.
    """

    label: str
    prompts: tuple[str, ...]
    prompt_tokens: np.ndarray
    response_tokens: np.ndarray


@dataclass(frozen=True)
class _FileRows:
    groups: dict[str, PromptGroup]
    skipped_zero_tokens: int


def _field(path: Path, row: int, obj: dict, name: str, kind: type) -> object:
    if name not in obj:
        raise row_error(path, row, name, "missing")
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, kind):
        raise row_error(path, row, name, f"{v!r} is not {'an integer' if kind is int else 'a string'}")
    return v


@cache
def _load_file(path_str: str, mtime_ns: int, size: int, model: str | None) -> _FileRows:
    """Parse one prompt file into groups; cached per process (mtime/size in the key so an
    edited file is re-read)."""
    path = Path(path_str)
    try:
        data = gzip.decompress(path.read_bytes())
    except OSError as e:  # includes gzip.BadGzipFile
        raise WorkloadError(f"{path}: cannot read: {e.strerror or e}") from None
    except (EOFError, zlib.error) as e:
        raise WorkloadError(f"{path}: corrupt or truncated gzip data ({e})") from None
    # AlpacaEval holds 44 models' answers to the same 805 prompts (~78 MB unzipped); a
    # byte search for the JSON-encoded model name skips json.loads on the 43 other models.
    needle = json.dumps(model).encode() if model is not None else None
    acc: dict[str, tuple[list[str], list[int], list[int]]] = {}
    skipped = 0
    for row, raw in enumerate(data.split(b"\n"), start=1):
        if needle is not None and needle not in raw:
            continue
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except UnicodeDecodeError:
            raise row_error(path, row, None, "not UTF-8 text") from None
        except json.JSONDecodeError as e:
            raise row_error(path, row, None, f"invalid JSON: {e.msg} at column {e.colno}") from None
        if not isinstance(obj, dict):
            raise row_error(path, row, None, f"expected a JSON object, got {type(obj).__name__}")
        if model is not None and _field(path, row, obj, "model", str) != model:
            continue
        source = _field(path, row, obj, "source", str)
        task = _field(path, row, obj, "task", str)
        prompt = _field(path, row, obj, "prompt", str)
        pt = _field(path, row, obj, "prompt_tokens", int)
        rt = _field(path, row, obj, "response_tokens", int)
        if pt < 1 or rt < 1:
            # Real data has these (22 empty gemma-2b-it answers in AlpacaEval); a request
            # needs >= 1 token each way, so drop the row and count it rather than fail.
            skipped += 1
            continue
        p, ps, rs = acc.setdefault(f"{source}:{task}", ([], [], []))
        p.append(prompt)
        ps.append(pt)
        rs.append(rt)
    groups = {
        label: PromptGroup(label, tuple(p), np.asarray(ps, dtype=np.int64), np.asarray(rs, dtype=np.int64))
        for label, (p, ps, rs) in acc.items()
    }
    return _FileRows(groups, skipped)


def _prompt_files(data_dir: Path, sources: Sequence[str] | None) -> list[Path]:
    pdir = Path(data_dir) / "prompts"
    files = sorted(pdir.glob("*" + _SUFFIX))
    if not files:
        raise WorkloadError(f"{pdir}: no *{_SUFFIX} prompt files (public-mix needs shared/data/prompts)")
    if sources is None:
        return files
    by_stem = {f.name[: -len(_SUFFIX)]: f for f in files}
    unknown = [s for s in sources if s not in by_stem]
    if unknown:
        raise WorkloadError(
            f"unknown prompt source(s) {', '.join(map(repr, unknown))}; valid: {', '.join(sorted(by_stem))}"
        )
    if not sources:
        raise WorkloadError("sources is empty; pass None for all prompt files")
    return [by_stem[s] for s in sorted(set(sources))]


def public_mix_groups(
    data_dir: str | Path,
    *,
    max_prompt_tokens: int = 1000,
    alpaca_model: str | None = DEFAULT_ALPACA_MODEL,
    sources: Sequence[str] | None = None,
) -> tuple[dict[str, PromptGroup], int]:
    """Task groups :func:`public_mix` samples from, and how many rows were dropped.

    Returns ``(groups, skipped)``: ``groups`` maps each ``source:task`` label to its rows
    with ``prompt_tokens <= max_prompt_tokens`` (groups left empty are omitted), sorted by
    label; ``skipped`` counts rows dropped for a 0-token prompt or response. Arguments
    as in :func:`public_mix`.

    Raises:
        WorkloadError: see :func:`public_mix`.
    """
    if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1:
        raise WorkloadError(f"max_prompt_tokens must be a positive integer, got {max_prompt_tokens!r}")
    merged: dict[str, list[PromptGroup]] = {}
    skipped = 0
    for f in _prompt_files(Path(data_dir), sources):
        model = alpaca_model if f.name == ALPACA_STEM + _SUFFIX else None
        try:
            st = f.stat()
        except OSError as e:
            raise WorkloadError(f"{f}: cannot read: {e.strerror or e}") from None
        rows = _load_file(str(f.resolve()), st.st_mtime_ns, st.st_size, model)
        skipped += rows.skipped_zero_tokens
        for label, g in rows.groups.items():
            merged.setdefault(label, []).append(g)
    out: dict[str, PromptGroup] = {}
    for label in sorted(merged):
        parts = merged[label]
        prompts = tuple(p for g in parts for p in g.prompts)
        pt = np.concatenate([g.prompt_tokens for g in parts])
        rt = np.concatenate([g.response_tokens for g in parts])
        keep = np.flatnonzero(pt <= max_prompt_tokens)
        if keep.size:
            out[label] = PromptGroup(label, tuple(prompts[i] for i in keep), pt[keep], rt[keep])
    if not out:
        raise WorkloadError(
            f"no prompt rows left (alpaca_model={alpaca_model!r}, max_prompt_tokens={max_prompt_tokens})"
        )
    return out, skipped


def public_mix(
    n: int,
    rate: float,
    seed: int,
    *,
    data_dir: str | Path,
    max_prompt_tokens: int = 1000,
    alpaca_model: str | None = DEFAULT_ALPACA_MODEL,
    sources: Sequence[str] | None = None,
) -> list[Request]:
    """``n`` requests with real prompt/response token lengths from a mix of public tasks.

    Task groups: one per ``source:task`` label of the prompt files, which with the
    default files and settings gives 13 groups:

    - ``sharegpt_v3_partial:chat`` (real ChatGPT user first turns, 2023),
    - ``arena-hard-v0.1:hard_prompt`` (hard Chatbot Arena prompts; GPT-3.5/GPT-4 answers),
      ``arena-hard-v2.0:{coding,creative_writing,math}`` (o3-mini answers),
    - ``alpaca_eval:{helpful_base,koala,oasst,selfinstruct,vicuna}`` (AlpacaEval 2.0
      instructions; only ``alpaca_model``'s answers, default ``llama-2-7b-chat-hf``),
    - ``gpteacher:{coding,roleplay,tool_use}`` (GPT-4 synthetic, short answers).

    Each request picks its group uniformly among the groups, then a row uniformly within
    the group (with replacement), so small groups (e.g. 80 ``vicuna`` rows) are
    oversampled on purpose: the mix is balanced across tasks, not across files. Rows with
    ``prompt_tokens > max_prompt_tokens`` are excluded (the router paper keeps prompts
    <= 1000 tokens); rows with a 0-token prompt or response are dropped (see
    :func:`public_mix_groups`). Arrivals are a Poisson process of ``rate`` req/s
    (:func:`~routerd.workloads.traces.poisson_arrivals`).

    Randomness: one ``numpy.random.default_rng(seed)``; draws in order: ``n`` group
    indices, ``n`` uniforms for the row, ``n`` exponential gaps. The same arguments and
    files give an identical list. The files are parsed once per process and cached
    (measured for ``public_mix(2000, 20, 0, ...)``: first call 1.3 s, dominated by
    unzipping the 25 MB AlpacaEval file; later calls 25 ms).

    Args:
        n: number of requests (>= 1).
        rate: mean arrival rate, requests per second (> 0).
        seed: seed of the generator.
        data_dir: the shared data directory (holding ``prompts/``).
        max_prompt_tokens: longest prompt kept, tokens (cl100k_base counts).
        alpaca_model: AlpacaEval ``model`` to keep, or ``None`` for all 44 models.
        sources: prompt file stems to use (e.g. ``("alpaca_eval_multimodel",
            "arena_hard_answers")``); ``None`` = every ``prompts/*.jsonl.gz``.

    Returns:
        Requests with ``id`` 0..n-1, ``arrival_s`` in seconds, ``prompt_tokens`` and
        ``output_tokens`` (= the row's ``response_tokens``) in tokens, ``prompt`` = the
        prompt text and ``task`` = the ``source:task`` label.

    Raises:
        WorkloadError: bad ``n``/``rate``/``max_prompt_tokens``, an unknown source, no
            prompt files, a malformed row (names file, row and field), or no rows left.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise WorkloadError(f"n must be a positive integer, got {n!r}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise WorkloadError(f"rate must be a finite number of requests/s > 0, got {rate!r}")
    groups, _ = public_mix_groups(
        data_dir, max_prompt_tokens=max_prompt_tokens, alpaca_model=alpaca_model, sources=sources
    )
    glist = list(groups.values())
    sizes = np.array([len(g.prompts) for g in glist], dtype=np.int64)
    rng = np.random.default_rng(seed)
    gi = rng.integers(0, len(glist), size=n)
    # floor(u * size) is uniform on 0..size-1; one vector draw keeps the stream layout
    # independent of which groups get picked.
    ri = np.minimum((rng.random(n) * sizes[gi]).astype(np.int64), sizes[gi] - 1)
    arrivals = poisson_arrivals(n, rate, rng)
    out: list[Request] = []
    for k in range(n):
        g = glist[gi[k]]
        j = int(ri[k])
        out.append(
            Request(
                id=k,
                arrival_s=float(arrivals[k]),
                prompt_tokens=int(g.prompt_tokens[j]),
                output_tokens=int(g.response_tokens[j]),
                prompt=g.prompts[j],
                task=g.label,
            )
        )
    return out
