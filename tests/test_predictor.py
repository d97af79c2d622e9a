"""Length predictor without torch: edges, split, baselines, metrics, assignment, CLI errors."""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pytest

from conftest import toy_profile
from routerd.model import Request
from routerd.predictor import (
    LengthOnlyPredictor,
    MajorityPredictor,
    PredictorError,
    TaskPriorPredictor,
    assign_predictions,
    load_predictor,
    parse_edges,
)
from routerd.predictor.base import clean_prompt, merge_sparse_buckets
from routerd.predictor.data import Row, cap_per_task, labels_of, split_rows
from routerd.predictor.evaluate import metrics
from routerd.profiles import get_profile


# ----------------------------------------------------------------------------- edges


def test_edges_parse_list_and_profile(tmp_path):
    assert parse_edges("250,1000,4000") == (250, 1000, 4000)
    assert parse_edges(" 10, 20 ") == (10, 20)
    # The V100 profile carries the paper's ~500 decode tokens/s per instance: 0.5 s, 2 s, 8 s
    # -> the paper's 250 / 1000 / 4000 (arXiv 2408.13510 §5.1).
    assert parse_edges("profile:llama2-7b-v100") == (250, 1000, 4000)
    assert parse_edges("profile:llama2-7b-v100") == get_profile("llama2-7b-v100").derived_bucket_edges()
    assert toy_profile(decode_throughput_tokens_per_s=250.0).derived_bucket_edges() == (125, 500, 2000)
    # Derived from the latency model: (0.02 - 0.01) / (0.001 + 1024 * 0) = 10 requests per
    # 0.02 s iteration = 500 tok/s; capped at max_num_seqs = 8 it is 400 tok/s.
    flat = dict(decode_per_seq_s=0.001, decode_per_ctx_token_s=0.0, decode_token_time_s=0.02, overhead_s=0.01)
    assert toy_profile(**flat, max_num_seqs=128, max_num_batched_tokens=128).derived_bucket_edges() == (250, 1000, 4000)
    assert toy_profile(**flat, max_num_seqs=8).derived_bucket_edges() == (200, 800, 3200)
    # An iteration time at or under the overhead leaves one request per iteration: 1 / 0.02 s.
    assert toy_profile(decode_token_time_s=0.01).decode_throughput() == pytest.approx(100.0)
    # The A100 profile's iteration time is Vidur's B = 32 at 1K context: about 32 / 0.02 s.
    assert 1590 < get_profile("llama2-7b-a100").decode_throughput() < 1605


@pytest.mark.parametrize("bad", ["", "3,2", "5,5", "0,10", "a,b", "profile:no-such-profile"])
def test_edges_bad(bad):
    with pytest.raises(PredictorError):
        parse_edges(bad)


def test_merge_sparse_buckets():
    assert merge_sparse_buckets([14000, 6000, 280, 14], 100) == 3
    assert merge_sparse_buckets([14000, 6000, 280, 14], 10) == 4
    assert merge_sparse_buckets([14000, 6000, 80, 30], 100) == 3  # 80 + 30 = 110 >= 100
    assert merge_sparse_buckets([14000, 6000, 80, 14], 100) == 2  # 80 + 14 = 94 < 100 -> merge again
    assert merge_sparse_buckets([14000, 6000, 60, 14], 100) == 2
    assert merge_sparse_buckets([1, 1, 1, 1], 100) == 2  # never fewer than two classes


# ----------------------------------------------------------------------------- split


def _rows(n_per=60) -> list[Row]:
    """3 tasks x 3 buckets, n_per rows each, every 5th prompt repeated twice (same prompt, same task)."""
    rows = []
    lengths = {0: 100, 1: 500, 2: 2000}
    for task in ("a:x", "b:y", "c:z"):
        for b, rt in lengths.items():
            for k in range(n_per):
                rows.append(Row(f"{task} bucket{b} prompt {k}", 10 + k, rt, task))
                if k % 5 == 0:
                    rows.append(Row(f"{task} bucket{b} prompt {k}", 10 + k, rt, task))
    return rows


def test_split_partitions_groups_stratifies_and_is_deterministic():
    rows = _rows()
    sp = split_rows(rows, seed=7)
    allidx = np.concatenate([sp["train"], sp["val"], sp["test"]])
    assert sorted(allidx.tolist()) == list(range(len(rows)))
    # The same prompt never lands in two splits.
    prompts = {s: {rows[i].prompt for i in sp[s]} for s in sp}
    assert not (prompts["train"] & prompts["val"]) and not (prompts["train"] & prompts["test"])
    assert not (prompts["val"] & prompts["test"])
    # Every (task, bucket) stratum has 60 prompt groups: 48 / 6 / 6 up to one group.
    labels = labels_of(rows)
    for task in ("a:x", "b:y", "c:z"):
        for b in range(3):
            for s, want in (("train", 48), ("val", 6), ("test", 6)):
                got = len({rows[i].prompt for i in sp[s] if rows[i].task == task and labels[i] == b})
                assert abs(got - want) <= 1, (task, b, s, got)
    again = split_rows(rows, seed=7)
    assert all(np.array_equal(sp[s], again[s]) for s in sp)
    other = split_rows(rows, seed=8)
    assert not np.array_equal(sp["test"], other["test"])


def test_split_does_not_depend_on_row_order_within_strata():
    rows = _rows(20)
    sp = split_rows(rows, seed=1)
    rev = rows[::-1]
    sp2 = split_rows(rev, seed=1)
    test1 = {rows[i].prompt for i in sp["test"]}
    test2 = {rev[i].prompt for i in sp2["test"]}
    assert test1 == test2


def test_cap_per_task_only_caps_pure_tasks():
    rows = [Row(f"p{i}", 5, 10, "pure:t") for i in range(50)] + \
           [Row(f"q{i}", 5, 10 if i % 2 else 600, "mixed:t") for i in range(50)]
    labels = labels_of(rows)
    idx = np.arange(len(rows))
    kept = cap_per_task(rows, idx, 10, labels=labels, min_purity=0.98)
    assert sum(rows[i].task == "pure:t" for i in kept) == 10
    assert sum(rows[i].task == "mixed:t" for i in kept) == 50
    assert np.array_equal(kept, cap_per_task(rows, idx, 10, labels=labels, min_purity=0.98))
    assert len(cap_per_task(rows, idx, 10)) == 20


# ----------------------------------------------------------------------------- baselines


def test_majority_and_task_prior_by_hand():
    m = MajorityPredictor().fit([0, 0, 1])
    assert m.predict([("x", 3, None), (None, 1, "t")]) == [0, 0]
    assert MajorityPredictor().fit([1, 0]).bucket == 0  # tie -> smaller bucket
    tp = TaskPriorPredictor().fit(["a", "a", "a", "b", None], [1, 1, 0, 2, 1])
    assert tp.by_task == {"a": 1, "b": 2}
    assert tp.default == 1  # labels 1,1,0,2,1 -> 1
    assert tp.predict([("", 1, "a"), ("", 1, "b"), ("", 1, "nope"), (None, 1, None)]) == [1, 2, 1, 1]


def test_length_only_learns_a_threshold_and_uses_the_task():
    pytest.importorskip("sklearn")  # the length-only baseline is scikit-learn's
    # Without task: prompts <= 100 tokens -> bucket 0, longer -> bucket 1.
    tokens = list(range(1, 201))
    labels = [0 if n <= 100 else 1 for n in tokens]
    lo = LengthOnlyPredictor(use_task=False).fit(tokens, [None] * 200, labels)
    assert lo.predict([(None, 10, None), (None, 90, None), (None, 150, None), (None, 5000, None)]) == [0, 0, 1, 1]
    # With task: task "a" follows the threshold, task "b" is always bucket 2.
    tasks = ["a"] * 200 + ["b"] * 200
    lt = LengthOnlyPredictor(use_task=True).fit(tokens * 2, tasks, labels + [2] * 200)
    assert lt.predict([(None, 10, "a"), (None, 150, "a"), (None, 10, "b"), (None, 150, "b")]) == [0, 1, 2, 2]
    # An unknown task is a missing value, not an error.
    assert lt.predict([(None, 10, "zzz")])[0] in (0, 1, 2)
    # One class only: a constant predictor.
    assert LengthOnlyPredictor().fit([1, 2], ["a", "a"], [3, 3]).predict([(None, 9, "a")]) == [3]


@pytest.mark.parametrize("kind", ["majority", "task-prior", "length-only"])
def test_baselines_survive_bad_prompts(kind):
    if kind == "majority":
        predictor = MajorityPredictor().fit([0, 1, 1])
    elif kind == "task-prior":
        predictor = TaskPriorPredictor().fit(["a", "b"], [0, 1])
    else:
        pytest.importorskip("sklearn")  # the length-only baseline is scikit-learn's
        predictor = LengthOnlyPredictor().fit([1, 50, 100, 200], ["a", "a", "b", "b"], [0, 0, 1, 1])
    batch = [("", 0, None), (b"\xff\xfe\x80 not utf-8", 5, "a"), ("x" * 1_000_000, 250_000, "unknown-task"),
             (None, 1, None), ("\ud800 lone surrogate", 3, 42)]
    out = predictor.predict(batch)
    assert len(out) == 5 and all(isinstance(b, int) and 0 <= b <= 3 for b in out)
    assert predictor.predict([]) == []


@pytest.mark.parametrize("bad", [[("x", -1, None)], [("x", "12", None)], [("x", 1.5, None)], [("x", 3)], ["x"]])
def test_bad_batch_is_a_clear_error(bad):
    with pytest.raises(PredictorError):
        MajorityPredictor().fit([0]).predict(bad)


def test_clean_prompt():
    assert clean_prompt(None) == ""
    assert clean_prompt(b"caf\xc3\xa9 \xff") == "caf\u00e9 \ufffd"
    assert clean_prompt("\ud800x") == "?x"
    assert len(clean_prompt("y" * 1_000_000, max_chars=512)) == 512
    with pytest.raises(PredictorError):
        clean_prompt(123)


# ----------------------------------------------------------------------------- metrics


def test_metrics_by_hand():
    m = metrics(np.array([0, 0, 1, 2]), np.array([0, 1, 1, 1]), 4)
    assert m["n"] == 4 and m["accuracy"] == 0.5
    assert m["confusion"] == [[1, 1, 0, 0], [0, 1, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]]
    # F1: bucket 0 = 2*1/(2+1), bucket 1 = 2*1/(1+3), bucket 2 = 0; bucket 3 absent.
    assert m["macro_f1"] == pytest.approx((2 / 3 + 0.5 + 0.0) / 3)
    assert metrics(np.array([], dtype=int), np.array([], dtype=int), 4)["accuracy"] == 0.0


# ----------------------------------------------------------------------------- assignment


def _requests():
    return [Request(id=i, arrival_s=float(i), prompt_tokens=10 + i, output_tokens=100 + 400 * i,
                    prompt=f"p{i}", task="a" if i % 2 else "b") for i in range(5)]


def test_assign_predictions_once_per_request_and_given_mode():
    from routerd.sim.prepare import prepare_requests

    tp = TaskPriorPredictor().fit(["a", "b"], [2, 0])
    calls = []
    orig = tp.predict

    def counting(batch):
        calls.append(len(batch))
        return orig(batch)

    tp.predict = counting
    reqs = assign_predictions(_requests(), tp, batch_size=2)
    assert calls == [2, 2, 1]
    assert [q.predicted_bucket for q in reqs] == [0, 2, 0, 2, 0]
    assert [q.id for q in reqs] == [0, 1, 2, 3, 4] and reqs[1].output_tokens == 500
    prep = prepare_requests(reqs, get_profile("llama2-7b-a100"), prediction="given")
    assert [r.bucket for r in prep.requests] == [0, 2, 0, 2, 0]


def test_assign_refuses_other_edges_and_bad_buckets():
    tp = TaskPriorPredictor().fit(["a"], [1])
    with pytest.raises(PredictorError, match="edges"):
        assign_predictions(_requests(), tp, edges=(100, 200))

    class Bad:
        name, edges = "bad", (250, 1000, 4000)

        def predict(self, batch):
            return [7] * len(batch)

    with pytest.raises(PredictorError, match="bucket 7"):
        assign_predictions(_requests(), Bad())


@pytest.mark.parametrize("spec", ["", "   ", "no-such-predictor", "/no/such/folder"])
def test_load_predictor_bad_spec(spec):
    with pytest.raises(PredictorError) as e:
        load_predictor(spec)
    assert "\n" not in str(e.value)


def test_load_predictor_folder_without_metadata(tmp_path):
    with pytest.raises(PredictorError, match="predictor.json"):
        load_predictor(str(tmp_path))


def test_load_baseline_from_shared_data(shared_data):
    pytest.importorskip("sklearn")  # the length-only baseline is scikit-learn's
    lt = load_predictor("length+task", data_dir=shared_data)
    out = lt.predict([("Write a haiku", 5, "gpteacher:roleplay"), ("", 40, None)])
    assert out[0] == 0 and len(out) == 2
    with pytest.raises(PredictorError, match="not a directory"):
        load_predictor("task-prior", data_dir="/no/such/dir")


@pytest.fixture
def shared_data():
    from routerd.workloads.errors import WorkloadError
    from routerd.workloads.registry import resolve_data_dir

    try:
        d = resolve_data_dir(None)
    except WorkloadError:
        pytest.skip("no shared data directory")
    if not (d / "prompts").is_dir():
        pytest.skip("no shared/data/prompts")
    return str(d)


# ----------------------------------------------------------------------------- CLI


def _run(argv):
    from routerd.predictor.cli import add_parser, run

    parser = argparse.ArgumentParser(prog="phasewise")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(argv))


@pytest.mark.parametrize("argv, words", [
    (["predictor", "predict", "no-such-model", "--prompt", "hi"], ["no-such-model"]),
    (["predictor", "predict", "task-prior", "--prompt-file", "/no/such/file"], ["/no/such/file"]),
    (["predictor", "predict", "task-prior", "--prompt", "x", "--prompt-tokens", "-3"], ["prompt-tokens"]),
    (["predictor", "eval", "/no/such/model"], ["no such model"]),
    (["predictor", "eval", "baselines", "--edges", "9,3"], ["strictly increasing"]),
    (["predictor", "train", "--out", "x", "--edges", "3,2"], ["strictly increasing"]),
    (["predictor", "train", "--out", "x", "--edges", "profile:nope"], ["nope"]),
    (["predictor", "train", "--out", "x", "--hint-dropout", "2"], ["hint-dropout"]),
])
def test_cli_errors_one_line_exit_2(argv, words, capsys):
    assert _run(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("phasewise: error: ")
    for w in words:
        assert w in err


def test_cli_bad_jsonl_one_line(tmp_path, capsys):
    p = tmp_path / "in.jsonl"
    p.write_bytes(b'{"prompt": "ok", "prompt_tokens": 3}\n{not json\n')
    assert _run(["predictor", "predict", "majority", "--input", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 2" in err


def test_cli_predict_baseline(shared_data, tmp_path, capsys):
    import json

    pytest.importorskip("sklearn")  # the length-only baseline is scikit-learn's

    p = tmp_path / "in.jsonl"
    p.write_bytes(b'{"prompt": "Write a long essay", "prompt_tokens": 5, "task": "gpteacher:coding"}\n'
                  b'{"prompt": "\xff\xfe bad bytes", "task": "what-task"}\n{"prompt": ""}\n')
    assert _run(["predictor", "predict", "length+task", "--input", str(p), "--data-dir", shared_data]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["bucket"] for x in lines][0] == 0 and len(lines) == 3
    assert lines[1]["prompt_tokens"] >= 1


def test_predictor_package_does_not_import_torch():
    import subprocess

    code = ("import sys, routerd.predictor, routerd.predictor.cli, routerd.predictor.hf, "
            "routerd.predictor.evaluate, routerd.predictor.train; "
            "print(any(m in sys.modules for m in ('torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
