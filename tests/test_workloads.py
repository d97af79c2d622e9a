"""Tests of routerd.workloads: loaders, validation messages, rescaling, generators, registry.

Expected values are computed independently of the code under test (``datetime`` for
timestamps, hand arithmetic for small files) or are the published statistics in
``shared/data/PROVENANCE.md``. Tests that need the shared data directory skip when it
is absent, using the same resolution as the package (``resolve_data_dir``).
"""

from __future__ import annotations

import csv
import datetime as dt
import gzip
import json
import math
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routerd.model import Request
from routerd.workloads import (
    PAPER_TASKS,
    WORKLOAD_NAMES,
    Workload,
    WorkloadError,
    expected_stats,
    load_azure_csv,
    load_mooncake_jsonl,
    load_workload,
    mean_rate,
    paper_mix,
    public_mix,
    public_mix_groups,
    rescale_to_rate,
    resolve_data_dir,
)

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def _ts(text: str) -> dt.datetime:
    # datetime keeps microseconds only: drop the 7th fractional digit (100 ns).
    return dt.datetime.strptime(text[:26], "%Y-%m-%d %H:%M:%S.%f")


# --------------------------------------------------------------------------- sample


def test_bundled_sample_matches_file_read_independently():
    res = resources.files("routerd").joinpath("data", "traces", "azure2023_conv_sample.csv")
    rows = list(csv.DictReader(res.read_text(encoding="utf-8").splitlines()))
    assert len(rows) == 2000
    t0, t1 = _ts(rows[0]["TIMESTAMP"]), _ts(rows[-1]["TIMESTAMP"])
    span = (t1 - t0).total_seconds()
    assert span == pytest.approx(314.476615, abs=1e-6)

    w = load_workload("sample")
    assert isinstance(w, Workload)
    assert w.name == "sample"
    assert len(w.requests) == 2000
    assert [r.id for r in w.requests] == list(range(2000))
    assert w.requests[0].arrival_s == 0.0
    # 18:41:03.7384340 - 18:35:49.2618190, exact to the 100 ns tick
    assert w.requests[-1].arrival_s == pytest.approx(314.4766150, abs=1e-9)
    assert (w.requests[0].prompt_tokens, w.requests[0].output_tokens) == (181, 230)
    assert (w.requests[-1].prompt_tokens, w.requests[-1].output_tokens) == (456, 97)
    assert w.requests[-1].prompt_tokens == int(rows[-1]["ContextTokens"])
    assert sum(r.output_tokens for r in w.requests) == sum(int(r["GeneratedTokens"]) for r in rows)
    for r, row in zip(w.requests[::97], rows[::97]):
        assert r.arrival_s == pytest.approx((_ts(row["TIMESTAMP"]) - t0).total_seconds(), abs=1e-6)
    assert w.native_rate == pytest.approx(2000 / 314.476615)
    assert "CC-BY-4.0" in w.description and "Splitwise" in w.description


def test_sample_limit_and_rate():
    w = load_workload("sample", limit=100, rate=4.0)
    assert len(w.requests) == 100
    assert mean_rate(w.requests) == pytest.approx(4.0)
    native = load_workload("sample", limit=100)
    assert w.native_rate == native.native_rate
    assert [r.prompt_tokens for r in w.requests] == [r.prompt_tokens for r in native.requests]


def test_sample_ignores_data_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PHASEWISE_DATA_DIR", str(tmp_path / "nowhere"))
    assert len(load_workload("sample").requests) == 2000


# --------------------------------------------------------------------------- timestamps


def test_azure_timestamps_three_rows(tmp_path):
    p = write(
        tmp_path,
        "t.csv",
        HEADER
        + "2023-11-16 23:59:59.7500000,10,5\n"
        + "2023-11-17 00:00:00.2500000,20,6\n"  # crosses midnight
        + "2023-11-17 00:00:01.0000000,30,7\n",
    )
    reqs = load_azure_csv(p)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.25]
    assert [(r.id, r.prompt_tokens, r.output_tokens) for r in reqs] == [(0, 10, 5), (1, 20, 6), (2, 30, 7)]
    assert all(r.prompt is None and r.task is None for r in reqs)


def test_azure_timestamp_keeps_100ns_ticks_and_other_precisions(tmp_path):
    p = write(
        tmp_path,
        "t.csv",
        HEADER
        + "2023-11-16 18:15:46.6805900,1,1\n"
        + "2023-11-16 18:15:46.6805901,1,1\n"  # one 100 ns tick later
        + "2023-11-16 18:15:47,1,1\n"  # no fraction
        + "2023-11-16 18:15:47.5,1,1\n",
    )
    a = [r.arrival_s for r in load_azure_csv(p)]
    assert a[1] == pytest.approx(1e-7, abs=1e-12)
    assert a[2] == pytest.approx(0.31941, abs=1e-12)
    assert a[3] == pytest.approx(0.81941, abs=1e-12)


def test_azure_extra_columns_reordered_header_blank_lines(tmp_path):
    p = write(
        tmp_path,
        "t.csv",
        "GeneratedTokens,Extra,TIMESTAMP,ContextTokens\n"
        "3,x,2023-01-01 00:00:00.0,7\n\n"
        "4,y,2023-01-01 00:00:02.0,8\n",
    )
    reqs = load_azure_csv(p)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in reqs] == [(0.0, 7, 3), (2.0, 8, 4)]


def test_azure_limit(tmp_path):
    body = "".join(f"2023-01-01 00:00:{i:02d}.0,{i + 1},1\n" for i in range(10))
    p = write(tmp_path, "t.csv", HEADER + body)
    reqs = load_azure_csv(p, limit=3)
    assert [r.prompt_tokens for r in reqs] == [1, 2, 3]
    with pytest.raises(WorkloadError, match="limit"):
        load_azure_csv(p, limit=0)


@settings(max_examples=50, deadline=None)
@given(
    start=st.datetimes(min_value=dt.datetime(2000, 1, 1), max_value=dt.datetime(2100, 1, 1)),
    gaps_us=st.lists(st.integers(0, 10**11), min_size=1, max_size=5),
)
def test_azure_timestamps_match_datetime(tmp_path_factory, start, gaps_us):
    times = [start]
    for g in gaps_us:
        times.append(times[-1] + dt.timedelta(microseconds=g))
    body = "".join(f"{t.strftime('%Y-%m-%d %H:%M:%S.%f')}0,1,1\n" for t in times)
    p = write(tmp_path_factory.mktemp("h"), "h.csv", HEADER + body)
    got = [r.arrival_s for r in load_azure_csv(p)]
    want = [(t - start).total_seconds() for t in times]
    assert got == pytest.approx(want, abs=1e-6)


# --------------------------------------------------------------------------- bad input

BAD_CSV = [
    # (file text, row, field, words in the message)
    ("TIMESTAMP,ContextTokens\n2023-01-01 00:00:00.0,5\n", 1, "GeneratedTokens", "missing from the header"),
    ("TIMESTAMP\n", 1, "ContextTokens, GeneratedTokens", "missing from the header"),
    (HEADER + "2023-01-01 00:00:00.0,5,7\n2023-01-01 00:00:01.0,abc,7\n", 3, "ContextTokens", "'abc' is not an integer"),
    (HEADER + "2023-01-01 00:00:00.0,5,7.5\n", 2, "GeneratedTokens", "'7.5' is not an integer"),
    (HEADER + "2023-01-01 00:00:00.0,5,7\n2023-01-01 00:00:01.0,5,-3\n", 3, "GeneratedTokens", ">= 1, got -3"),
    (HEADER + "2023-01-01 00:00:00.0,0,7\n", 2, "ContextTokens", ">= 1, got 0"),
    (
        HEADER + "2023-01-01 00:00:05.0,5,7\n2023-01-01 00:00:06.0,5,7\n2023-01-01 00:00:04.0,5,7\n",
        4,
        "TIMESTAMP",
        "earlier than the previous row",
    ),
    (HEADER + "2023-01-01 00:00:00.0,5,7\nyesterday,5,7\n", 3, "TIMESTAMP", "'yesterday' is not a timestamp"),
    (HEADER + "2023-02-30 00:00:00.0,5,7\n", 2, "TIMESTAMP", "is not a timestamp"),
    (HEADER + "2023-01-01 00:00:00.0,5\n", 2, "GeneratedTokens", "missing (row has 2 of 3 columns)"),
]


@pytest.mark.parametrize(("text", "row", "field", "words"), BAD_CSV)
def test_azure_bad_input_names_file_row_field(tmp_path, text, row, field, words):
    p = write(tmp_path, "azure_bad.csv", text)
    with pytest.raises(WorkloadError) as ei:
        load_azure_csv(p)
    msg = str(ei.value)
    assert "azure_bad.csv" in msg
    assert f": row {row}: field {field}: " in msg
    assert words in msg
    assert "\n" not in msg


def test_azure_empty_missing_and_non_utf8(tmp_path):
    with pytest.raises(WorkloadError, match=r"empty\.csv: row 1: empty file"):
        load_azure_csv(write(tmp_path, "empty.csv", ""))
    with pytest.raises(WorkloadError, match=r"hdr\.csv: no data rows"):
        load_azure_csv(write(tmp_path, "hdr.csv", HEADER))
    with pytest.raises(WorkloadError, match=r"nope\.csv: cannot read"):
        load_azure_csv(tmp_path / "nope.csv")
    p = tmp_path / "latin.csv"
    p.write_bytes((HEADER + "2023-01-01 00:00:00.0,5,7\n2023-01-01 00:00:01.0,5,7\xe9\n").encode("latin-1"))
    with pytest.raises(WorkloadError, match=r"latin\.csv: row 3: not UTF-8"):
        load_azure_csv(p)
    p = tmp_path / "big.csv"
    p.write_text(HEADER + "2023-01-01 00:00:00.0,5,7\n2023-01-01 00:00:01.0,\"" + "9" * 200_000 + "\",7\n")
    with pytest.raises(WorkloadError, match=r"big\.csv: row 3: malformed CSV: field larger than field limit"):
        load_azure_csv(p)
    # a quoted field spanning lines: the row reported is where the record starts
    p = write(tmp_path, "quote.csv", HEADER + '2023-01-01 00:00:00.0,5,7\n2023-01-01 00:00:01.0,"5\n\n,7\n')
    with pytest.raises(WorkloadError, match=r"quote\.csv: row 3: field GeneratedTokens: missing"):
        load_azure_csv(p)


def mooncake_text(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_mooncake_plain_and_gzip(tmp_path):
    rows = [
        {"timestamp": 1000, "input_length": 100, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 1000, "input_length": 200, "output_length": 20, "hash_ids": []},
        {"timestamp": 3500, "input_length": 300, "output_length": 30},
    ]
    plain = write(tmp_path, "m.jsonl", mooncake_text(rows) + "\n")
    gz = tmp_path / "m.jsonl.gz"
    gz.write_bytes(gzip.compress(mooncake_text(rows).encode()))
    for p in (plain, gz):
        # prefix=False: these rows' hash_ids are placeholders that do not match input_length,
        # which the loader now checks (tests/test_workloads_prefix.py covers hash_ids).
        reqs = load_mooncake_jsonl(p, prefix=False)
        assert [(r.id, r.arrival_s, r.prompt_tokens, r.output_tokens) for r in reqs] == [
            (0, 0.0, 100, 10),
            (1, 0.0, 200, 20),
            (2, 2.5, 300, 30),
        ]
    assert len(load_mooncake_jsonl(gz, limit=2, prefix=False)) == 2


BAD_JSONL = [
    ('{"timestamp": 0, "input_length": 5, "output_length": 3}\n{"timestamp": 1, "input_length": 5\n', 2, None, "invalid JSON"),
    ('[1, 2, 3]\n', 1, None, "expected a JSON object"),
    ('{"timestamp": 0, "output_length": 3}\n', 1, "input_length", "missing"),
    ('{"timestamp": 0, "input_length": "5", "output_length": 3}\n', 1, "input_length", "'5' is not an integer"),
    ('{"timestamp": 0, "input_length": 5, "output_length": true}\n', 1, "output_length", "True is not an integer"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 0}\n', 1, "output_length", ">= 1, got 0"),
    ('{"timestamp": 0, "input_length": -5, "output_length": 1}\n', 1, "input_length", ">= 1, got -5"),
    ('{"timestamp": "x", "input_length": 5, "output_length": 1}\n', 1, "timestamp", "not a finite number"),
    (
        '{"timestamp": 9, "input_length": 5, "output_length": 1}\n\n{"timestamp": 8, "input_length": 5, "output_length": 1}\n',
        3,
        "timestamp",
        "earlier than the previous line",
    ),
]


@pytest.mark.parametrize(("text", "row", "field", "words"), BAD_JSONL)
def test_mooncake_bad_input_names_file_row_field(tmp_path, text, row, field, words):
    p = write(tmp_path, "moon_bad.jsonl", text)
    with pytest.raises(WorkloadError) as ei:
        load_mooncake_jsonl(p)
    msg = str(ei.value)
    assert msg.startswith(str(p) + f": row {row}: ")
    if field is not None:
        assert f": field {field}: " in msg
    assert words in msg
    assert "\n" not in msg


def test_mooncake_corrupt_gzip(tmp_path):
    rows = [{"timestamp": i, "input_length": 1, "output_length": 1} for i in range(5000)]
    good = gzip.compress(mooncake_text(rows).encode())
    p = tmp_path / "trunc.jsonl.gz"
    p.write_bytes(good[: len(good) // 2])
    with pytest.raises(WorkloadError, match=r"trunc\.jsonl\.gz: row \d+: corrupt or truncated gzip"):
        load_mooncake_jsonl(p)
    p = tmp_path / "notgz.jsonl.gz"
    p.write_text('{"timestamp": 0}\n')
    with pytest.raises(WorkloadError, match=r"notgz\.jsonl\.gz: row 1: cannot read"):
        load_mooncake_jsonl(p)


def test_unknown_workload_lists_valid_names():
    with pytest.raises(WorkloadError) as ei:
        load_workload("foo")
    msg = str(ei.value)
    valid = "azure-code, azure-conv, conversations, mooncake, paper-mix, public-mix, sample, shared-prefix"
    assert msg.startswith(f"unknown workload 'foo'; valid: {valid}")
    assert "\n" not in msg
    assert isinstance(ei.value, ValueError)


def test_registry_argument_errors(tmp_path):
    with pytest.raises(WorkloadError, match="n applies only to the generators"):
        load_workload("sample", n=10)
    with pytest.raises(WorkloadError, match="rate must be"):
        load_workload("sample", rate=0)
    with pytest.raises(WorkloadError, match="limit must be"):
        load_workload("sample", limit=-1)
    with pytest.raises(WorkloadError, match=r"missing\.csv: cannot read"):
        load_workload(str(tmp_path / "missing.csv"))


def test_registry_paths(tmp_path):
    p = write(tmp_path, "t.csv", HEADER + "2023-01-01 00:00:00.0,5,7\n2023-01-01 00:00:04.0,6,8\n")
    w = load_workload(str(p))
    assert [r.prompt_tokens for r in w.requests] == [5, 6]
    assert w.native_rate == pytest.approx(0.5)  # 2 requests / 4 s
    m = write(tmp_path, "t.jsonl", mooncake_text([{"timestamp": 0, "input_length": 3, "output_length": 4}]))
    w = load_workload(str(m))
    assert len(w.requests) == 1 and math.isnan(w.native_rate)


def test_data_dir_resolution_errors(monkeypatch, tmp_path):
    monkeypatch.setenv("PHASEWISE_DATA_DIR", str(tmp_path / "nowhere"))
    want = r"workload 'azure-conv' needs the shared data directory.*PHASEWISE_DATA_DIR"
    with pytest.raises(WorkloadError, match=want):
        load_workload("azure-conv")
    monkeypatch.delenv("PHASEWISE_DATA_DIR")
    monkeypatch.chdir(tmp_path)
    import routerd.workloads.registry as reg

    monkeypatch.setattr(reg, "_repo_root", lambda: tmp_path / "a" / "b")
    with pytest.raises(WorkloadError) as ei:
        load_workload("public-mix")
    msg = str(ei.value)
    assert "workload 'public-mix' needs the shared data directory" in msg
    assert "PHASEWISE_DATA_DIR" in msg and "data_dir=" in msg and "\n" not in msg
    with pytest.raises(WorkloadError, match="data_dir"):
        resolve_data_dir(tmp_path / "missing")
    (tmp_path / "d").mkdir()
    assert resolve_data_dir(tmp_path / "d") == tmp_path / "d"
    monkeypatch.setenv("PHASEWISE_DATA_DIR", str(tmp_path / "d"))
    assert resolve_data_dir() == tmp_path / "d"


# --------------------------------------------------------------------------- rescaling


def test_rescale_to_rate():
    reqs = load_workload("sample").requests
    out = rescale_to_rate(reqs, 12.5)
    assert mean_rate(out) == pytest.approx(12.5, rel=1e-12)
    assert len(out) / (out[-1].arrival_s - out[0].arrival_s) == pytest.approx(12.5)
    assert [(r.id, r.prompt_tokens, r.output_tokens) for r in out] == [
        (r.id, r.prompt_tokens, r.output_tokens) for r in reqs
    ]
    factor = (2000 / 314.476615) / 12.5
    assert out[1000].arrival_s == pytest.approx(reqs[1000].arrival_s * factor)
    assert reqs[0].arrival_s == 0.0  # the input is not modified


@pytest.mark.parametrize("rate", [0, -1.0, float("nan"), float("inf")])
def test_rescale_rejects_bad_rate(rate):
    reqs = [Request(id=i, arrival_s=float(i), prompt_tokens=1, output_tokens=1) for i in range(2)]
    with pytest.raises(WorkloadError, match="rate must be"):
        rescale_to_rate(reqs, rate)


def test_rescale_needs_a_span():
    one = [Request(id=0, arrival_s=0.0, prompt_tokens=1, output_tokens=1)]
    with pytest.raises(WorkloadError, match="at least 2"):
        rescale_to_rate(one, 1.0)


@settings(max_examples=50, deadline=None)
@given(
    gaps=st.lists(st.floats(0.0, 100.0), min_size=2, max_size=50).filter(lambda g: sum(g[1:]) > 1e-3),
    rate=st.floats(0.01, 1000.0),
)
def test_rescale_property(gaps, rate):
    t = np.cumsum(gaps)
    reqs = [Request(id=i, arrival_s=float(x), prompt_tokens=1, output_tokens=1) for i, x in enumerate(t)]
    assert mean_rate(rescale_to_rate(reqs, rate)) == pytest.approx(rate, rel=1e-9)


# --------------------------------------------------------------------------- paper_mix


def test_paper_mix_deterministic_and_rate():
    a = paper_mix(3000, 20.0, 7)
    assert a == paper_mix(3000, 20.0, 7)
    assert a != paper_mix(3000, 20.0, 8)
    assert [r.id for r in a] == list(range(3000))
    assert all(r.prompt is None for r in a)
    assert {r.task for r in a} == {t.name for t in PAPER_TASKS}
    # n / span of a Poisson process has relative s.d. 1/sqrt(n) = 1.8%; 10% is > 5 s.d.
    assert len(a) / a[-1].arrival_s == pytest.approx(20.0, rel=0.10)
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(a, a[1:]))


def _within(sample: np.ndarray, target: float, k: float = 4.0) -> bool:
    """``sample``'s mean is within ``k`` standard errors of ``target``."""
    return abs(sample.mean() - target) <= k * sample.std() / math.sqrt(sample.size)


def test_paper_mix_matches_published_aggregates():
    reqs = paper_mix(100_000, 50.0, 0)
    p = np.array([r.prompt_tokens for r in reqs])
    o = np.array([r.output_tokens for r in reqs])
    assert p.mean() == pytest.approx(89.0, rel=0.02)
    assert o.mean() == pytest.approx(176.0, rel=0.02)
    # population means of the model (expected_stats): 89.04 / 175.72
    assert _within(p, 89.04) and _within(o, 175.72)
    assert p.min() >= 1 and p.max() <= 1000 and o.min() >= 1 and o.max() <= 3096
    assert 0.285 < (o >= 250).mean() < 0.305  # lognormals cannot reach the paper's 35.54%
    tasks = np.array([r.task for r in reqs])
    for t in PAPER_TASKS:
        sel = tasks == t.name
        assert sel.mean() == pytest.approx(t.samples / 31329, abs=0.01)
        assert _within(o[sel], t.mean_decode_tokens), t.name
        assert _within(p[sel], t.mean_prompt_tokens), t.name


def test_paper_mix_expected_stats():
    s = expected_stats()
    assert s["mean_prompt_tokens"] == pytest.approx(89.04, abs=0.01)
    assert s["mean_output_tokens"] == pytest.approx(175.72, abs=0.01)
    assert s["long_share"] == pytest.approx(0.2949, abs=0.001)


def test_paper_mix_via_registry():
    w = load_workload("paper-mix", n=500, rate=5.0, seed=3)
    assert w.requests == paper_mix(500, 5.0, 3)
    assert w.native_rate == 5.0 and "SYNTHETIC" in w.description
    assert len(load_workload("paper-mix").requests) == 2000
    assert len(load_workload("paper-mix", limit=10).requests) == 10
    with pytest.raises(WorkloadError, match="n must be"):
        paper_mix(0, 1.0, 0)


# --------------------------------------------------------------------------- shared data


def test_real_traces_load_with_published_counts(data_dir):
    conv = load_workload("azure-conv", data_dir=data_dir)
    assert len(conv.requests) == 19366
    assert conv.native_rate == pytest.approx(5.530, abs=0.001)
    assert conv.requests[-1].arrival_s == pytest.approx(3501.7, abs=0.05)
    code = load_workload("azure-code", data_dir=data_dir)
    assert len(code.requests) == 8819
    assert code.native_rate == pytest.approx(2.567, abs=0.001)
    moon = load_workload("mooncake", data_dir=data_dir)
    assert len(moon.requests) == 3993
    assert moon.requests[-1].arrival_s == pytest.approx(1022.025)
    assert moon.native_rate == pytest.approx(3.907, abs=0.001)
    assert np.mean([r.prompt_tokens for r in moon.requests]) == pytest.approx(15325.5, abs=0.1)


def test_sample_is_rows_6001_to_8000_of_the_full_trace(data_dir):
    full = load_azure_csv(data_dir / "traces" / "azure2023_conv.csv")
    sample = load_workload("sample").requests
    base = full[6000].arrival_s
    for s, f in zip(sample, full[6000:8000]):
        assert (s.prompt_tokens, s.output_tokens) == (f.prompt_tokens, f.output_tokens)
        assert s.arrival_s == pytest.approx(f.arrival_s - base, abs=1e-6)


def test_public_mix_deterministic_and_real(data_dir):
    a = public_mix(2000, 20.0, 0, data_dir=data_dir)
    assert a == public_mix(2000, 20.0, 0, data_dir=data_dir)
    assert a != public_mix(2000, 20.0, 1, data_dir=data_dir)
    assert len(a) / a[-1].arrival_s == pytest.approx(20.0, rel=0.10)
    assert all(r.prompt and r.task and r.prompt_tokens <= 1000 for r in a)
    groups, skipped = public_mix_groups(data_dir)
    assert len(groups) == 13 and skipped == 0
    # only llama-2-7b-chat-hf's answers: 805 AlpacaEval instructions in 5 tasks
    assert sum(len(g.prompts) for k, g in groups.items() if k.startswith("alpaca_eval:")) == 805
    assert {r.task for r in a} == set(groups)
    # each request is a real row: its (prompt, lengths) triple exists in its group
    for r in a[:50]:
        g = groups[r.task]
        idx = [i for i, p in enumerate(g.prompts) if p == r.prompt]
        assert any(
            (g.prompt_tokens[i], g.response_tokens[i]) == (r.prompt_tokens, r.output_tokens) for i in idx
        )


def test_public_mix_options(data_dir):
    groups, skipped = public_mix_groups(data_dir, alpaca_model=None, sources=["alpaca_eval_multimodel"])
    assert skipped == 22  # empty gemma-2b-it answers are dropped, not fatal
    assert sum(len(g.prompts) for g in groups.values()) == 35419 - 22
    small = public_mix(100, 5.0, 0, data_dir=data_dir, max_prompt_tokens=20)
    assert max(r.prompt_tokens for r in small) <= 20
    with pytest.raises(WorkloadError, match="unknown prompt source"):
        public_mix(10, 1.0, 0, data_dir=data_dir, sources=["nope"])
    w = load_workload("public-mix", data_dir=data_dir, n=300, rate=3.0, seed=2)
    assert w.requests == public_mix(300, 3.0, 2, data_dir=data_dir)


def test_public_mix_bad_row_names_file_row_field(tmp_path):
    (tmp_path / "prompts").mkdir()
    good = {"source": "s", "task": "t", "prompt": "hi", "prompt_tokens": 1, "response_tokens": 3}
    bad = dict(good, response_tokens="many")
    p = tmp_path / "prompts" / "x.jsonl.gz"
    p.write_bytes(gzip.compress((json.dumps(good) + "\n" + json.dumps(bad) + "\n").encode()))
    with pytest.raises(WorkloadError, match=r"x\.jsonl\.gz: row 2: field response_tokens: 'many' is not an integer"):
        public_mix(5, 1.0, 0, data_dir=tmp_path)
    p.write_bytes(gzip.compress((json.dumps(good) + "\n").encode()))
    reqs = public_mix(5, 1.0, 0, data_dir=tmp_path)
    assert {(r.prompt, r.prompt_tokens, r.output_tokens, r.task) for r in reqs} == {("hi", 1, 3, "s:t")}


def test_workload_names():
    assert WORKLOAD_NAMES[0] == "sample"
    assert set(WORKLOAD_NAMES) == {
        "sample", "azure-conv", "azure-code", "mooncake", "public-mix", "paper-mix", "shared-prefix",
        "conversations",
    }
