"""Request traces: loaders for the Azure 2023 CSV and Mooncake JSON-lines formats.

Both loaders return :class:`routerd.model.Request` lists with ``id`` = 0-based position,
``arrival_s`` = seconds since the first request of the file (so the first request
arrives at 0.0), and the token counts of the file; Mooncake lines with ``hash_ids`` also
give ``Request.prefix`` (512-token content units, :func:`mooncake_units`), Azure rows have
no prefix identity (``prefix = None``). They validate every row and raise
:class:`~routerd.workloads.errors.WorkloadError` (one line naming file, row and field)
on bad input instead of letting ``csv``/``json``/``gzip``/Unicode errors escape.

Token counts must be >= 1. The shipped traces (``shared/data/traces``) were checked:
neither Azure 2023 file nor the Mooncake synthetic trace has a zero or negative token
count, so such a row is treated as corrupt input and rejected rather than skipped.
"""

from __future__ import annotations

import csv
import datetime as _dt
import gzip
import io
import json
import math
import re
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from routerd.model import Request

from .errors import WorkloadError, row_error

#: Column names of the Azure LLM inference trace 2023 CSV.
AZURE_COLUMNS: tuple[str, str, str] = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
#: Field names of a Mooncake trace line (``hash_ids``, the prefix identity, is
#: :data:`MOONCAKE_HASH_FIELD`).
MOONCAKE_FIELDS: tuple[str, str, str] = ("timestamp", "input_length", "output_length")
#: The Mooncake field holding a request's prefix-block ids.
MOONCAKE_HASH_FIELD = "hash_ids"
#: Tokens per Mooncake ``hash_ids`` entry (Mooncake FAST'25 trace README: one id per
#: 512-token block; ``shared/docs/prefix-routing.md`` §4).
MOONCAKE_BLOCK_TOKENS = 512
# Unit ids are packed as signed 64-bit integers by routerd.prefix.chain.
_MAX_UNIT_ID = 2**63 - 1

# Azure timestamps carry 7 fractional digits (100 ns ticks); datetime.fromisoformat only
# keeps microseconds on Python < 3.11 and floats lose the tick, so parse to integer ns.
_TS_RE = re.compile(
    r"\s*(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?\s*\Z"
)
_INT_RE = re.compile(r"\s*[+-]?\d+\s*\Z")
_NS_PER_DAY = 86_400 * 10**9


def _check_limit(limit: int | None) -> None:
    if limit is None:
        return
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise WorkloadError(f"limit must be a positive integer or None, got {limit!r}")


def _parse_timestamp_ns(text: str) -> int:
    """Nanoseconds since 0001-01-01 of ``YYYY-MM-DD HH:MM:SS[.f{1,9}]``; ValueError if bad."""
    m = _TS_RE.match(text)
    if m is None:
        raise ValueError
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    frac = m.group(7) or ""
    if hour > 23 or minute > 59 or second > 59:
        raise ValueError
    days = _dt.date(year, month, day).toordinal()  # ValueError on e.g. Feb 30
    return (
        days * _NS_PER_DAY
        + ((hour * 60 + minute) * 60 + second) * 10**9
        + int(frac.ljust(9, "0") or "0")
    )


def _parse_count(path: object, row: int, field: str, text: str) -> int:
    if _INT_RE.match(text) is None or not text.isascii() or len(text) > 18:
        # ASCII digits only (int() would take other scripts' digits) and at most 18 of
        # them (no real token count is longer; int() refuses > 4,300 digits anyway).
        raise row_error(path, row, field, f"{text[:40]!r} is not an integer token count")
    value = int(text)
    if value < 1:
        raise row_error(path, row, field, f"token count must be >= 1, got {value}")
    return value


def _read_text(path: Path) -> str:
    """Whole file as text (UTF-8, optional BOM); decoding errors name the line."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise WorkloadError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise row_error(path, line, None, f"not UTF-8 text (byte {data[e.start]:#04x})") from None


def load_azure_csv(path: str | Path, *, limit: int | None = None) -> list[Request]:
    """Load an Azure LLM inference trace 2023 CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Source format: github.com/Azure/AzurePublicDataset ``AzureLLMInferenceTrace_*.csv``
    (Patel et al., Splitwise, ISCA 2024; CC-BY-4.0). ``TIMESTAMP`` is wall-clock time
    ``YYYY-MM-DD HH:MM:SS.fffffff`` (any 0-9 fractional digits accepted, no timezone);
    ``ContextTokens`` becomes ``prompt_tokens`` and ``GeneratedTokens`` ``output_tokens``.
    Extra columns are ignored; blank lines are skipped.

    Args:
        path: the CSV file.
        limit: keep only the first ``limit`` requests (``None`` = all).

    Returns:
        Requests with ``id`` 0.., ``arrival_s`` = seconds since the first row's timestamp,
        token counts in tokens; no prompt text or task.

    Raises:
        WorkloadError: unreadable file, not UTF-8, malformed CSV, a missing column, a
            non-integer or < 1 token count, a bad timestamp, a timestamp earlier than the
            previous row's (the trace must be sorted), no data rows, or a bad ``limit``.
            The message names the file, the row (line number, header = row 1) and the field.
    """
    path = Path(path)
    _check_limit(limit)
    reader = csv.reader(io.StringIO(_read_text(path), newline=""))
    requests: list[Request] = []
    last_line = 0
    try:
        header = next(reader, None)
        if header is None:
            raise row_error(path, 1, None, "empty file; expected header " + ",".join(AZURE_COLUMNS))
        names = [h.strip() for h in header]
        missing = [c for c in AZURE_COLUMNS if c not in names]
        if missing:
            raise row_error(
                path, 1, ", ".join(missing),
                f"missing from the header (found: {', '.join(names) or 'nothing'})",
            )
        cols = [names.index(c) for c in AZURE_COLUMNS]
        first_ns = prev_ns = None
        # Report the line a record starts on: a quoted field may span several lines.
        last_line = reader.line_num
        for rec in reader:
            row, last_line = last_line + 1, reader.line_num
            if not any(cell.strip() for cell in rec):
                continue
            for c, i in zip(AZURE_COLUMNS, cols):
                if i >= len(rec):
                    raise row_error(path, row, c, f"missing (row has {len(rec)} of {len(names)} columns)")
            ts_text = rec[cols[0]]
            try:
                ns = _parse_timestamp_ns(ts_text)
            except ValueError:
                raise row_error(
                    path, row, AZURE_COLUMNS[0],
                    f"{ts_text!r} is not a timestamp like '2023-11-16 18:15:46.6805900'",
                ) from None
            prompt = _parse_count(path, row, AZURE_COLUMNS[1], rec[cols[1]])
            output = _parse_count(path, row, AZURE_COLUMNS[2], rec[cols[2]])
            if first_ns is None:
                first_ns = prev_ns = ns
            elif ns < prev_ns:
                raise row_error(
                    path, row, AZURE_COLUMNS[0],
                    f"{ts_text.strip()!r} is earlier than the previous row; the trace must be sorted by time",
                )
            prev_ns = ns
            requests.append(
                Request(
                    id=len(requests),
                    arrival_s=(ns - first_ns) / 1e9,
                    prompt_tokens=prompt,
                    output_tokens=output,
                )
            )
            if limit is not None and len(requests) >= limit:
                break
    except csv.Error as e:
        raise row_error(path, last_line + 1, None, f"malformed CSV: {e}") from None
    if not requests:
        raise WorkloadError(f"{path}: no data rows after the header")
    return requests


def _jsonl_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw line) pairs of a plain or ``.gz`` file; I/O errors -> WorkloadError."""
    lineno = 0
    try:
        opener = gzip.open if path.suffix.lower() == ".gz" else open
        with opener(path, "rb") as f:
            for lineno, line in enumerate(f, start=1):
                yield lineno, line
    except OSError as e:  # FileNotFoundError, gzip.BadGzipFile, ...
        if isinstance(e, gzip.BadGzipFile) or lineno:
            raise row_error(path, lineno + 1, None, f"cannot read: {e}") from None
        raise WorkloadError(f"{path}: cannot read: {e.strerror or e}") from None
    except (EOFError, zlib.error) as e:  # truncated or corrupt gzip stream
        raise row_error(path, lineno + 1, None, f"corrupt or truncated gzip data ({e})") from None


def _json_int(path: object, row: int, obj: dict, field: str) -> int:
    if field not in obj:
        raise row_error(path, row, field, "missing")
    v = obj[field]
    # bool is an int subclass in Python, and pandas may write 12.0 for an integer column.
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise row_error(path, row, field, f"{v!r} is not an integer")
    return v


def mooncake_units(hash_ids: Sequence[int], input_length: int) -> tuple[tuple[int, int], ...]:
    """Content units of a Mooncake request: one unit of 512 tokens per ``hash_ids`` entry.

    ``[(id_0, 512), ..., (id_{k-2}, 512), (id_{k-1}, input_length - 512 (k-1))]``: the
    last id covers the rest of the prompt, which may be a partial 512-token block
    (``shared/docs/prefix-routing.md`` §4). The caller has checked
    ``512 (k-1) < input_length <= 512 k`` (:func:`load_mooncake_jsonl` does).
    """
    b = MOONCAKE_BLOCK_TOKENS
    k = len(hash_ids)
    return tuple((h, b) for h in hash_ids[:-1]) + ((hash_ids[-1], input_length - b * (k - 1)),)


def _json_hash_ids(path: object, row: int, obj: dict, input_length: int) -> tuple[tuple[int, int], ...]:
    field = MOONCAKE_HASH_FIELD
    if field not in obj:
        raise row_error(path, row, field, "missing")
    ids = obj[field]
    if not isinstance(ids, list):
        raise row_error(path, row, field, f"expected a list of integer ids, got {type(ids).__name__}")
    for i, v in enumerate(ids):
        # Unlike the lengths, an id of 12.0 is rejected too: ids are identities, not counts,
        # and a float id means the file was not written by Mooncake's tooling.
        if isinstance(v, bool) or not isinstance(v, int):
            raise row_error(path, row, field, f"entry {i}: {v!r} is not an integer")
        if not 0 <= v <= _MAX_UNIT_ID:
            raise row_error(path, row, field, f"entry {i}: {v} is not an id in [0, 2**63)")
    b, k = MOONCAKE_BLOCK_TOKENS, len(ids)
    if not b * (k - 1) < input_length <= b * k:
        cover = "no tokens" if k == 0 else f"{b * (k - 1) + 1}..{b * k} tokens"
        raise row_error(
            path, row, field,
            f"{k} ids of {b} tokens cover {cover}, but {MOONCAKE_FIELDS[1]} is {input_length}",
        )
    return mooncake_units(ids, input_length)


def load_mooncake_jsonl(
    path: str | Path, *, limit: int | None = None, prefix: bool | None = None
) -> list[Request]:
    """Load a Mooncake-format trace: JSON lines with ``timestamp``, ``input_length``, ``output_length``
    and (for prefix identity) ``hash_ids``.

    Source format: github.com/kvcache-ai/Mooncake ``FAST25-release/traces/*.jsonl``
    (Qin et al., FAST 2025; Apache-2.0). ``timestamp`` is the arrival in milliseconds
    (int or float), ``input_length``/``output_length`` are token counts, ``hash_ids`` the
    prompt's 512-token blocks as remapped hash ids (equal ids = equal prefix blocks).
    Files ending in ``.gz`` are read as gzip, others as plain text. Blank lines are skipped.

    Prefix identity: ``hash_ids = [id_0, ..., id_{k-1}]`` becomes ``Request.prefix =
    ((id_0, 512), ..., (id_{k-1}, input_length - 512 (k-1)))`` (:func:`mooncake_units`);
    each line must satisfy ``512 (k-1) < input_length <= 512 k`` (the last id may cover a
    partial block) and every id must be an integer in ``[0, 2**63)``. The shared
    synthetic trace satisfies this on all 3,993 lines (checked). ``response_id`` stays
    ``None``: the trace does not say which ids are earlier responses.

    Args:
        path: the ``.jsonl`` or ``.jsonl.gz`` file.
        limit: keep only the first ``limit`` requests (``None`` = all; later lines are not
            read or checked).
        prefix: ``True``: every line must carry valid ``hash_ids``; ``False``: ``hash_ids``
            are ignored and ``prefix`` is ``None`` (no sharing); ``None`` (default): the
            first data line decides: a trace with ``hash_ids`` on its first line must have
            them on every line, a trace without them on the first line must have none
            (prefix ``None`` throughout: traces without prefix identity keep working).

    Returns:
        Requests with ``id`` 0.., ``arrival_s`` = seconds since the first line's timestamp,
        ``prompt_tokens`` = ``input_length``, ``output_tokens`` = ``output_length``,
        ``prefix`` as above.

    Raises:
        WorkloadError: unreadable file, corrupt gzip, a line that is not UTF-8 JSON object,
            a missing / non-integer / < 1 length, a non-numeric timestamp, a timestamp
            earlier than the previous line's, missing ``hash_ids`` (where required), a
            ``hash_ids`` that is not a list, holds a non-integer (bool and float included)
            or negative id, or whose length disagrees with ``input_length``, ``hash_ids`` on
            a later line of a trace whose first line has none (``prefix=None``), no data
            lines, or a bad ``limit`` / ``prefix``. The message names the file, the row (line
            number) and the field. Nothing is returned on error.
    """
    path = Path(path)
    _check_limit(limit)
    if prefix is not None and not isinstance(prefix, bool):
        raise WorkloadError(f"prefix must be True, False or None, got {prefix!r}")
    auto = prefix is None
    requests: list[Request] = []
    first = prev = None
    first_row = 0
    for row, raw in _jsonl_lines(path):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except UnicodeDecodeError:
            raise row_error(path, row, None, "not UTF-8 text") from None
        except json.JSONDecodeError as e:
            raise row_error(path, row, None, f"invalid JSON: {e.msg} at column {e.colno}") from None
        except ValueError as e:  # e.g. an integer of more than 4,300 digits
            raise row_error(path, row, None, f"invalid JSON: {str(e)[:80]}") from None
        if not isinstance(obj, dict):
            raise row_error(path, row, None, f"expected a JSON object, got {type(obj).__name__}")
        if MOONCAKE_FIELDS[0] not in obj:
            raise row_error(path, row, MOONCAKE_FIELDS[0], "missing")
        ts = obj[MOONCAKE_FIELDS[0]]
        if (isinstance(ts, bool) or not isinstance(ts, (int, float))
                or (isinstance(ts, int) and abs(ts) > 10**15) or not math.isfinite(ts)):
            raise row_error(path, row, MOONCAKE_FIELDS[0], f"{ts!r} is not a finite number of milliseconds")
        prompt = _json_int(path, row, obj, MOONCAKE_FIELDS[1])
        output = _json_int(path, row, obj, MOONCAKE_FIELDS[2])
        for field, v in ((MOONCAKE_FIELDS[1], prompt), (MOONCAKE_FIELDS[2], output)):
            if v < 1:
                raise row_error(path, row, field, f"token count must be >= 1, got {v}")
        if first is None:
            first = prev = ts
            first_row = row
            if prefix is None:
                prefix = MOONCAKE_HASH_FIELD in obj
        elif ts < prev:
            raise row_error(
                path, row, MOONCAKE_FIELDS[0],
                f"{ts!r} is earlier than the previous line ({prev!r}); the trace must be sorted by time",
            )
        prev = ts
        units = None
        if prefix:
            units = _json_hash_ids(path, row, obj, prompt)
        elif auto and MOONCAKE_HASH_FIELD in obj:
            # A trace with ids on some lines only is damaged; sharing computed from part of
            # it would be silently wrong, so say so instead of dropping the ids.
            raise row_error(
                path, row, MOONCAKE_HASH_FIELD,
                f"present, but the first data line (row {first_row}) has none; a trace carries "
                f"{MOONCAKE_HASH_FIELD} on every line or on none",
            )
        requests.append(
            Request(
                id=len(requests),
                arrival_s=(ts - first) / 1000.0,
                prompt_tokens=prompt,
                output_tokens=output,
                prefix=units,
            )
        )
        if limit is not None and len(requests) >= limit:
            break
    if not requests:
        raise WorkloadError(f"{path}: no data lines")
    return requests


def _check_rate(rate: float) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise WorkloadError(f"rate must be a finite number of requests/s > 0, got {rate!r}")
    return float(rate)


def mean_rate(requests: Sequence[Request]) -> float:
    """Mean arrival rate in req/s: ``len(requests) / (last arrival - first arrival)``.

    This is the definition :func:`rescale_to_rate` targets (it matches the rates quoted
    in ``shared/data/PROVENANCE.md``, e.g. 19,366 / 3,501.7 s = 5.53 req/s for Azure conv).

    Raises:
        WorkloadError: fewer than 2 requests, or all arrivals at the same instant.
    """
    if len(requests) < 2:
        raise WorkloadError(f"mean rate needs at least 2 requests, got {len(requests)}")
    span = requests[-1].arrival_s - requests[0].arrival_s
    if span <= 0:
        raise WorkloadError(f"mean rate is undefined: all {len(requests)} requests arrive at the same time")
    return len(requests) / span


def rescale_to_rate(requests: Sequence[Request], rate: float) -> list[Request]:
    """Stretch or compress time so the mean arrival rate (:func:`mean_rate`) becomes ``rate``.

    Every ``arrival_s`` is multiplied by ``mean_rate(requests) / rate``, so the shape of
    the arrival process (bursts, gaps, inter-arrival CV) is kept and only its time scale
    changes. ``id``, token counts, prompt and task are unchanged.

    Args:
        requests: requests sorted by ``arrival_s`` (as the loaders return them).
        rate: target mean rate in requests per second.

    Raises:
        WorkloadError: ``rate`` is not a finite number > 0, or the input's rate is
            undefined (fewer than 2 requests or zero time span).
    """
    rate = _check_rate(rate)
    factor = mean_rate(requests) / rate
    return [r.model_copy(update={"arrival_s": r.arrival_s * factor}) for r in requests]


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` arrival times (s) of a Poisson process of ``rate`` req/s started at time 0.

    Gaps are i.i.d. exponential with mean ``1 / rate`` drawn from ``rng`` (one
    ``rng.exponential`` call of size ``n``), so the first arrival is one gap after 0 and
    ``n / arrivals[-1]`` is an unbiased-in-the-limit estimate of ``rate``.

    Raises:
        WorkloadError: ``n`` < 1 or ``rate`` not a finite number > 0.
    """
    rate = _check_rate(rate)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise WorkloadError(f"n must be a positive integer, got {n!r}")
    return np.cumsum(rng.exponential(1.0 / rate, size=int(n)))
