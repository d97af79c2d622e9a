"""Workloads with prefix identity: Mooncake ``hash_ids``, the shared-prefix generator, and the
independent infinite-cache reference (``tests/prefix_reference.py``).

Expected values are hand-computed from small inputs, structural invariants of the generator,
or the published figures of ``shared/docs/prefix-routing.md`` §4 (Mooncake synthetic trace:
65.15% of 16-token blocks, 65.12% of prompt tokens, 64.0% of 512-token ids reused).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routerd.model import Request
from routerd.workloads import (
    SHARED_PREFIX_PRESETS,
    SharedPrefixParams,
    WorkloadError,
    load_mooncake_jsonl,
    load_workload,
    mooncake_units,
    shared_prefix,
)

sys.path.insert(0, str(Path(__file__).parent))
from prefix_reference import infinite_cache_reuse, unit_reuse  # noqa: E402


def jsonl(tmp_path: Path, rows, name: str = "m.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return p


def row(length: int, ids, ts: int = 0, out: int = 3) -> dict:
    return {"timestamp": ts, "input_length": length, "output_length": out, "hash_ids": ids}


# --------------------------------------------------------------------------- Mooncake hash_ids


def test_mooncake_units_by_hand(tmp_path):
    p = jsonl(tmp_path, [
        row(1024, [7, 8]),            # two full ids
        row(1030, [7, 8, 9], ts=5),   # partial last id: 1030 - 1024 = 6 tokens
        row(1, [3], ts=6),            # one token
        row(513, [1, 2], ts=7),       # 512 + 1
        row(512, [0], ts=8),          # exactly one full id; id 0 is valid
    ])
    reqs = load_mooncake_jsonl(p)
    assert [r.prefix for r in reqs] == [
        ((7, 512), (8, 512)),
        ((7, 512), (8, 512), (9, 6)),
        ((3, 1),),
        ((1, 512), (2, 1)),
        ((0, 512),),
    ]
    assert all(r.response_id is None for r in reqs)
    assert all(sum(t for _, t in r.prefix) == r.prompt_tokens for r in reqs)
    assert mooncake_units([4, 5, 6], 1100) == ((4, 512), (5, 512), (6, 76))


def test_mooncake_without_hash_ids_and_ignore_mode(tmp_path):
    plain = jsonl(tmp_path, [{"timestamp": 0, "input_length": 9, "output_length": 2}] * 2, "plain.jsonl")
    assert [r.prefix for r in load_mooncake_jsonl(plain)] == [None, None]
    with pytest.raises(WorkloadError, match=r"plain\.jsonl: row 1: field hash_ids: missing"):
        load_mooncake_jsonl(plain, prefix=True)
    # prefix=False never looks at hash_ids, even invalid ones
    bad = jsonl(tmp_path, [row(100, [-1, "x"])], "bad.jsonl")
    assert load_mooncake_jsonl(bad, prefix=False)[0].prefix is None
    with pytest.raises(WorkloadError, match="prefix must be"):
        load_mooncake_jsonl(bad, prefix="yes")


def test_azure_has_no_prefix_identity():
    reqs = load_workload("sample", limit=20).requests
    assert all(r.prefix is None and r.response_id is None for r in reqs)


GOOD = json.dumps(row(600, [1, 2]))
BAD_HASH_IDS = [
    # (line 2 text, words in the message)
    ('{"timestamp": 1, "input_length": 600, "output_length": 3}', "missing"),
    (json.dumps(row(600, None, ts=1)), "expected a list of integer ids, got NoneType"),
    (json.dumps(row(600, "1,2", ts=1)), "expected a list of integer ids, got str"),
    (json.dumps(row(600, {"0": 1}, ts=1)), "expected a list of integer ids, got dict"),
    (json.dumps(row(600, [1, "2"], ts=1)), "entry 1: '2' is not an integer"),
    (json.dumps(row(600, [True, 2], ts=1)), "entry 0: True is not an integer"),
    (json.dumps(row(600, [1, 2.0], ts=1)), "entry 1: 2.0 is not an integer"),
    (json.dumps(row(600, [1.5, 2], ts=1)), "entry 0: 1.5 is not an integer"),
    (json.dumps(row(600, [1, -2], ts=1)), "entry 1: -2 is not an id in [0, 2**63)"),
    (json.dumps(row(600, [2**63, 1], ts=1)), f"entry 0: {2**63} is not an id in [0, 2**63)"),
    (json.dumps(row(600, [], ts=1)), "0 ids of 512 tokens cover no tokens, but input_length is 600"),
    (json.dumps(row(1025, [1, 2], ts=1)), "2 ids of 512 tokens cover 513..1024 tokens, but input_length is 1025"),
    (json.dumps(row(512, [1, 2], ts=1)), "2 ids of 512 tokens cover 513..1024 tokens, but input_length is 512"),
]


@pytest.mark.parametrize(("line2", "words"), BAD_HASH_IDS)
def test_bad_hash_ids_name_file_line_field(tmp_path, line2, words):
    # a blank line first, so the reported row is the line number (3), not the request index
    p = tmp_path / "moon.jsonl"
    p.write_text(GOOD + "\n\n" + line2 + "\n" + GOOD + "\n", encoding="utf-8")
    for prefix in (None, True):
        with pytest.raises(WorkloadError) as ei:
            load_mooncake_jsonl(p, prefix=prefix)
        msg = str(ei.value)
        assert msg == f"{p}: row 3: field hash_ids: {words}"
        assert "\n" not in msg


def test_hash_ids_on_some_lines_only(tmp_path):
    p = jsonl(tmp_path, [{"timestamp": 0, "input_length": 9, "output_length": 2}, row(9, [1], ts=1)])
    with pytest.raises(WorkloadError) as ei:
        load_mooncake_jsonl(p)
    assert str(ei.value) == (
        f"{p}: row 2: field hash_ids: present, but the first data line (row 1) has none; "
        "a trace carries hash_ids on every line or on none"
    )


def test_registry_mooncake_requires_hash_ids(tmp_path):
    (tmp_path / "traces").mkdir()
    p = tmp_path / "traces" / "mooncake_fast25_synthetic.jsonl.gz"
    rows = [row(600, [1, 2]), {"timestamp": 5, "input_length": 9, "output_length": 2}]
    p.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    with pytest.raises(WorkloadError, match=r"mooncake_fast25_synthetic\.jsonl\.gz: row 2: field hash_ids: missing"):
        load_workload("mooncake", data_dir=tmp_path)
    # a path keeps the auto rule: ids on the first line, so required on every line
    with pytest.raises(WorkloadError, match=r"row 2: field hash_ids: missing"):
        load_workload(str(p))


def test_real_mooncake_trace_prefixes(data_dir):
    reqs = load_workload("mooncake", data_dir=data_dir).requests
    assert len(reqs) == 3993
    assert all(r.prefix is not None and sum(t for _, t in r.prefix) == r.prompt_tokens for r in reqs)
    # every line satisfies 512 (k-1) < input_length <= 512 k: the loader would have raised
    assert all(0 < r.prefix[-1][1] <= 512 and all(t == 512 for _, t in r.prefix[:-1]) for r in reqs)
    n_ids = sum(len(r.prefix) for r in reqs)
    assert n_ids / len(reqs) == pytest.approx(30.5, abs=0.05)  # PROVENANCE.md: 30.5 hash blocks per request


# --------------------------------------------------------------------------- reference


def req(i: int, units, out: int = 1, response_id: int | None = None) -> Request:
    return Request(id=i, arrival_s=float(i), prompt_tokens=sum(t for _, t in units), output_tokens=out,
                   prefix=tuple(units), response_id=response_id)


def test_reference_by_hand():
    reqs = [
        req(0, [(1, 40)]),            # 2 full blocks, nothing cached
        req(1, [(1, 40), (2, 10)]),   # blocks 0, 1 are unit 1's; block 2 ends in unit 2: 2 hits
        req(2, [(1, 32)]),            # both blocks cached, cap (32 - 1) // 16 = 1
        req(3, [(1, 20)]),            # partial unit 1: block 0 is unit 1's block 0, cap 1
        req(4, [(3, 40)]),            # other text
        Request(id=5, arrival_s=5.0, prompt_tokens=40, output_tokens=1),  # no prefix: shares nothing
    ]
    r = infinite_cache_reuse(reqs)
    assert r.hit_blocks == (0, 2, 1, 1, 0, 0)
    assert r.blocks == (2, 3, 2, 1, 2, 2)
    assert r.total_hit_blocks == 4 and r.total_blocks == 12
    assert r.block_hit_rate == pytest.approx(4 / 12)
    assert r.token_hit_rate == pytest.approx(4 * 16 / (40 + 50 + 32 + 20 + 40 + 40))
    # whole units: requests 1, 2 and 3 reuse unit 1 (3 of 6 units)
    assert unit_reuse(reqs) == (3, 6)


def test_reference_with_responses_by_hand():
    # KV after request 0: 20 + 13 - 1 = 32 tokens = 2 blocks; block 1 (tokens 16-31) ends in answer 9.
    reqs = [req(0, [(1, 20)], out=13, response_id=9), req(1, [(1, 20), (9, 13), (5, 10)])]
    assert infinite_cache_reuse(reqs, responses=True).hit_blocks == (0, 2)
    assert infinite_cache_reuse(reqs).hit_blocks == (0, 1)


def test_reference_on_the_mooncake_trace(data_dir):
    reqs = load_workload("mooncake", data_dir=data_dir).requests
    r = infinite_cache_reuse(reqs)
    assert len(r.hit_blocks) == 3993
    assert r.total_blocks == sum(q.prompt_tokens // 16 for q in reqs)
    assert all(h <= (q.prompt_tokens - 1) // 16 for h, q in zip(r.hit_blocks, reqs))
    # prefix-routing.md §4: 65.15% of blocks, 65.12% of prompt tokens, 64.0% of 512-token ids
    assert round(100 * r.block_hit_rate, 2) == 65.15
    assert round(100 * r.token_hit_rate, 2) == 65.12
    reused, ids = unit_reuse(reqs)
    assert round(100 * reused / ids, 1) == 64.0


# --------------------------------------------------------------------------- shared-prefix generator


def test_generator_by_hand():
    p = SharedPrefixParams(groups=2, users_per_group=1, system_prompt_tokens=100, question_tokens=10,
                           output_tokens=20, turns_per_session=2, shuffle_users=False)
    reqs = shared_prefix(p, 5, 1.0, 0)
    assert [(r.prefix, r.response_id, r.prompt_tokens, r.output_tokens) for r in reqs] == [
        (((0, 100), (2, 10)), 3, 110, 20),
        (((1, 100), (4, 10)), 5, 110, 20),
        (((0, 100), (2, 10), (3, 20), (6, 10)), 7, 140, 20),
        (((1, 100), (4, 10), (5, 20), (8, 10)), 9, 140, 20),
        (((0, 100), (10, 10)), 11, 110, 20),  # session of 2 turns over: a new one, same system prompt
    ]
    repeat = p.model_copy(update={"multi_turn": False})
    reqs = shared_prefix(repeat, 4, 1.0, 0)
    assert [(r.prefix, r.response_id) for r in reqs] == [
        (((0, 100), (2, 10)), None), (((1, 100), (3, 10)), None),
        (((0, 100), (2, 10)), None), (((1, 100), (3, 10)), None),
    ]
    no_sys = shared_prefix(p.model_copy(update={"system_prompt_tokens": 0}), 1, 1.0, 0)
    assert no_sys[0].prefix == ((2, 10),) and no_sys[0].prompt_tokens == 10


def check_structure(p: SharedPrefixParams, reqs: list[Request]) -> None:
    """Invariants every shared-prefix workload must satisfy (see the module docstring)."""
    tokens_of: dict[int, int] = {}
    group_of: dict[int, int] = {}
    for r in reqs:
        assert r.prefix and sum(t for _, t in r.prefix) == r.prompt_tokens
        assert r.prompt_tokens <= p.max_prompt_tokens()
        units = list(r.prefix) + ([(r.response_id, r.output_tokens)] if r.response_id is not None else [])
        for uid, t in units:
            assert uid >= 0 and t >= 1
            assert tokens_of.setdefault(uid, t) == t  # one content, one length
        if p.system_prompt_tokens:
            sys_id, rest = r.prefix[0][0], units[1:]
            assert sys_id < p.groups and r.prefix[0][1] == p.system_prompt_tokens
        else:
            sys_id, rest = None, units
        for uid, _ in rest:
            assert uid >= p.groups  # never a system prompt id
            # a question or answer belongs to one group: groups share only their system prompt
            assert group_of.setdefault(uid, sys_id) == sys_id
    if p.multi_turn:
        by_prefix = {r.prefix: r for r in reqs}
        assert len(by_prefix) == len(reqs)  # every turn asks a new question
        children: set[int] = set()
        seen: set[int] = set()
        first = 1 if p.system_prompt_tokens else 0
        for r in reqs:
            earlier, seen = seen, seen | {u for u, _ in r.prefix}
            assert len(r.prefix) - first <= 2 * p.turns_per_session - 1
            if len(r.prefix) - first == 1:
                continue  # a session's first turn
            parent = by_prefix[r.prefix[:-2]]  # turn t-1 ...
            assert parent.id < r.id and parent.id not in children
            children.add(parent.id)
            assert r.prefix[-2] == (parent.response_id, parent.output_tokens)  # ... + its answer
            assert r.prefix[-1][0] not in earlier  # + a new question
    else:
        assert all(r.response_id is None for r in reqs)
        assert len({r.prefix for r in reqs}) == min(len(reqs), p.num_users)


@settings(max_examples=40, deadline=None)
@given(
    groups=st.integers(1, 4), users=st.integers(1, 4), s=st.integers(0, 50), q=st.integers(1, 30),
    o=st.integers(1, 30), multi=st.booleans(), turns=st.integers(1, 4), jitter=st.sampled_from([0.0, 0.5]),
    shuffle=st.booleans(), n=st.integers(1, 60), seed=st.integers(0, 3),
)
def test_generator_structure_property(groups, users, s, q, o, multi, turns, jitter, shuffle, n, seed):
    p = SharedPrefixParams(groups=groups, users_per_group=users, system_prompt_tokens=s, question_tokens=q,
                           output_tokens=o, multi_turn=multi, turns_per_session=turns, jitter=jitter,
                           shuffle_users=shuffle)
    check_structure(p, shared_prefix(p, n, 3.0, seed))


def test_presets_structure_and_turn_order():
    p, n = SHARED_PREFIX_PRESETS["default"]
    reqs = shared_prefix(p, n, 20.0, 0)
    check_structure(p, reqs)
    assert max(r.prompt_tokens + r.output_tokens for r in reqs) <= 4096  # fits even a 4K context
    big, n_big = SHARED_PREFIX_PRESETS["llmd-capacity"]
    assert (big.groups, big.users_per_group, big.system_prompt_tokens, big.question_tokens,
            big.output_tokens, big.multi_turn, n_big) == (150, 5, 6000, 1200, 1000, False, 3000)
    reqs = shared_prefix(big, n_big, 20.0, 0)
    check_structure(big, reqs)
    # every round sends the 750 prompts in the same order (inference-perf cycles its shuffled list)
    assert all(reqs[i].prefix == reqs[i + 750].prefix for i in range(n_big - 750))
    assert len({r.prefix for r in reqs[:750]}) == 750
    # Independent count: round 1 hits the system prompt (375 blocks) for all but each group's first
    # user; later rounds hit the whole prompt up to vLLM's cap (7200 - 1) // 16 = 449 blocks.
    r = infinite_cache_reuse(reqs)
    assert r.total_hit_blocks == 150 * 4 * 375 + 2250 * 449
    assert r.total_blocks == 3000 * 450


def test_generator_seed_and_rate():
    p = SharedPrefixParams(jitter=0.2)
    a = shared_prefix(p, 2000, 20.0, 0)
    assert a == shared_prefix(p, 2000, 20.0, 0)
    b = shared_prefix(p, 2000, 20.0, 1)
    assert [r.prefix for r in a] != [r.prefix for r in b]
    assert [r.arrival_s for r in a] != [r.arrival_s for r in b]
    assert len(a) / a[-1].arrival_s == pytest.approx(20.0, rel=0.10)
    assert all(a[i].arrival_s < a[i + 1].arrival_s for i in range(len(a) - 1))
    # the rate only rescales time: x2 is exact (a power of two), x3 to rounding
    for factor, rel in ((2.0, 0.0), (3.0, 1e-12)):
        c = shared_prefix(p, 2000, 20.0 * factor, 0)
        assert [r.model_copy(update={"arrival_s": 0.0}) for r in c] == [
            r.model_copy(update={"arrival_s": 0.0}) for r in a
        ]
        assert [r.arrival_s for r in c] == pytest.approx([r.arrival_s / factor for r in a], rel=rel, abs=0)
    lens = [u[1] for r in a for u in r.prefix[1:]]
    assert min(lens) >= 160 and max(lens) <= 240 and len(set(lens)) > 50  # jitter 0.2 of 200


def test_generator_argument_errors():
    p = SharedPrefixParams()
    for n, rate, words in ((0, 1.0, "n must be"), (True, 1.0, "n must be"), (5, 0.0, "rate must be"),
                           (5, float("inf"), "rate must be")):
        with pytest.raises(WorkloadError, match=words):
            shared_prefix(p, n, rate, 0)
    with pytest.raises(WorkloadError, match="params must be SharedPrefixParams"):
        shared_prefix({"groups": 2}, 5, 1.0, 0)


def test_registry_shared_prefix():
    w = load_workload("shared-prefix", n=50, rate=5.0, seed=3)
    assert w.requests == shared_prefix(SHARED_PREFIX_PRESETS["default"][0], 50, 5.0, 3)
    assert w.native_rate == 5.0 and "shared-prefix" in w.description
    w = load_workload("shared-prefix:llmd-capacity", limit=10)
    assert len(w.requests) == 10 and w.requests[0].prompt_tokens == 7200
    assert len(load_workload("shared-prefix:llmd-capacity").requests) == 3000
    w = load_workload("shared-prefix:llmd-capacity,multi_turn=true,turns_per_session=2", n=20)
    assert max(len(r.prefix) for r in w.requests) <= 4
    w = load_workload("shared-prefix:groups=2, users_per_group=1,jitter=0.1", n=6)
    assert {r.prefix[0][0] for r in w.requests} == {0, 1}


def test_registry_shared_prefix_comma_after_the_name_is_the_colon_form():
    # "shared-prefix,groups=4" was "unknown workload" (and, with n, "n applies only to the generators").
    w = load_workload("shared-prefix,groups=4", n=40, rate=5.0, seed=2)
    base = SHARED_PREFIX_PRESETS["default"][0]
    assert w.requests == shared_prefix(base.model_copy(update={"groups": 4}), 40, 5.0, 2)
    assert w.requests == load_workload("shared-prefix:default,groups=4", n=40, rate=5.0, seed=2).requests
    assert {r.prefix[0][0] for r in w.requests} == set(range(4))
    assert load_workload("shared-prefix,llmd-capacity", limit=5).requests == \
        load_workload("shared-prefix:llmd-capacity", limit=5).requests
    with pytest.raises(WorkloadError, match="shared-prefix option 'colour' is not a parameter"):
        load_workload("shared-prefix,colour=red")


def test_unknown_workload_with_n_says_unknown_and_shows_the_shared_prefix_syntax():
    for kw in ({}, {"n": 10}):
        with pytest.raises(WorkloadError) as ei:
            load_workload("shared-prefixx,groups=4", **kw)
        msg = str(ei.value)
        assert msg.startswith("unknown workload 'shared-prefixx,groups=4'; valid: ") and "\n" not in msg
        assert "shared-prefix:PRESET[,field=value...] or shared-prefix:field=value" in msg
    with pytest.raises(WorkloadError, match="n applies only to the generators .*shared-prefix"):
        load_workload("sample", n=10)


def test_bench_n_help_names_shared_prefix(capsys, monkeypatch):
    from routerd.cli import main

    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps at hyphens otherwise
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "requests of a generated workload (public-mix, paper-mix, shared-prefix[:SPEC], conversations[:SPEC])" in out


@pytest.mark.parametrize(("name", "words"), [
    ("shared-prefix:nope", "unknown shared-prefix preset 'nope'; valid: default, llmd-capacity"),
    ("shared-prefix:default,colour=red", "shared-prefix option 'colour' is not a parameter; valid: groups,"),
    ("shared-prefix:groups=x", "shared-prefix option groups='x': Input should be a valid integer"),
    ("shared-prefix:groups=0", "shared-prefix option groups='0': Input should be greater than or equal to 1"),
    ("shared-prefix:jitter=1", "shared-prefix option jitter='1': Input should be less than 1"),
    ("shared-prefix:default,groups", "shared-prefix option 'groups' is not field=value"),
])
def test_registry_shared_prefix_bad_spec(name, words):
    with pytest.raises(WorkloadError) as ei:
        load_workload(name)
    assert str(ei.value).startswith(words)
    assert "\n" not in str(ei.value)
