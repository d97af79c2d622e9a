"""``phasewise predictor predict`` and ``phasewise bench --prediction predictor:default`` with the
shipped n-gram predictor; bad input and damaged model folders through the CLI, the Python API
and routerd's ``--predictor``.

Nothing depends on the shipped model's accuracy (its weights are replaced from time to
time): the CLI's output is checked against the Python API and against invariants.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from routerd.predictor import PredictorError, load_predictor
from routerd.predictor.cli import HINT_CHOICES, PROB_DECIMALS, class_ranges, estimate_tokens

ROUTERD = Path(__file__).resolve().parents[1] / "routerd"
KEYS = ["bucket", "tokens", "probabilities", "task", "task_source", "task_probability", "prompt_tokens",
        "predictor"]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROUTERD), env.get("PYTHONPATH", "")])
    return env


def cli(argv, capsys):
    """``phasewise ARGV`` in this process: (exit code, stdout, stderr)."""
    from routerd.cli import main

    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def cli_proc(argv, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """``phasewise ARGV`` in a fresh interpreter (argv items may be bytes); bytes out."""
    return subprocess.run([sys.executable, "-m", "routerd.cli", *argv], input=stdin, capture_output=True,
                          env=_env(), timeout=300)


def one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith("phasewise: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def shipped():
    return load_predictor("default")


def api_rows(pred, items, hint="auto"):
    """What each output line should say, computed through the Python API."""
    pred.hint = hint
    try:
        probs, info = pred.explain(items)
    finally:
        pred.hint = "auto"
    ranges = class_ranges(pred.edges, probs.shape[1])
    return [dict(bucket=int(p.argmax()), tokens=ranges[int(p.argmax())],
                 probabilities={r: round(float(q), PROB_DECIMALS) for r, q in zip(ranges, p)},
                 task=i["task"], task_source=i["task_source"],
                 task_probability=None if i["task_probability"] is None else round(i["task_probability"],
                                                                                   PROB_DECIMALS))
            for p, i in zip(probs, info)]


def check_line(row: dict, pred) -> None:
    """Invariants of one output line of the n-gram predictor."""
    assert list(row) == KEYS
    probs = row["probabilities"]
    assert list(probs) == class_ranges(pred.edges, pred.bucket.classes)
    assert all(0.0 <= q <= 1.0 for q in probs.values())
    # Each value is rounded to PROB_DECIMALS, so the sum is 1 within half a unit per class.
    assert abs(sum(probs.values()) - 1.0) <= 0.5 * 10 ** -PROB_DECIMALS * len(probs) + 1e-12
    assert row["tokens"] == list(probs)[row["bucket"]]
    assert probs[row["tokens"]] == max(probs.values())
    assert row["task_source"] in ("given", "predicted", "mixture", "none")
    if row["task_source"] in ("given", "none"):
        assert row["task_probability"] is None
    else:
        assert row["task"] in pred.tasks and 0.0 < row["task_probability"] <= 1.0
    assert (row["task"] is None) == (row["task_source"] == "none")
    assert isinstance(row["prompt_tokens"], int) and row["prompt_tokens"] >= 0
    assert row["predictor"].startswith("ngram:")


# ----------------------------------------------------------------------------- output


def test_class_ranges_by_hand():
    assert class_ranges((250, 1000, 4000), 4) == ["0-249", "250-999", "1000-3999", ">=4000"]
    # The top buckets merged into the last class: it is open-ended.
    assert class_ranges((250, 1000, 4000), 3) == ["0-249", "250-999", ">=1000"]
    assert class_ranges((250, 1000, 4000), 2) == ["0-249", ">=250"]
    assert class_ranges((10,), 2) == ["0-9", ">=10"]


def test_predict_defaults_to_the_shipped_model_and_matches_the_api(shipped, capsys):
    prompt = "Write a haiku about autumn leaves"
    rc, out, err = cli(["predictor", "predict", "--prompt", prompt], capsys)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert len(lines) == 1
    row = json.loads(lines[0])
    check_line(row, shipped)
    assert row["prompt_tokens"] == math.ceil(len(prompt.encode()) / 4) == estimate_tokens(prompt)
    assert row["predictor"] == shipped.name
    expected = api_rows(shipped, [(prompt, row["prompt_tokens"], None)])[0]
    assert {k: row[k] for k in expected} == expected
    # Naming the model gives the same line.
    rc, out2, _ = cli(["predictor", "predict", "default", "--prompt", prompt], capsys)
    assert rc == 0 and out2 == out


@pytest.mark.parametrize("hint", HINT_CHOICES)
@pytest.mark.parametrize("task", [None, "KNOWN", "no-such-task"])
def test_hint_modes_and_task_labels(shipped, hint, task, capsys):
    if hint in ("predicted", "mixture") and shipped.task_model is None:
        pytest.skip("this shipped model has no task classifier")
    task = shipped.tasks[0] if task == "KNOWN" else task
    argv = ["predictor", "predict", "--prompt", "Explain recursion to a child", "--prompt-tokens", "9",
            "--hint", hint] + (["--task", task] if task else [])
    rc, out, err = cli(argv, capsys)
    assert rc == 0
    row = json.loads(out)
    check_line(row, shipped)
    assert row["predictor"].endswith(f"[{hint}]")
    expected = api_rows(shipped, [("Explain recursion to a child", 9, task)], hint=hint)[0]
    assert {k: row[k] for k in expected} == expected
    rule = {"none": "none", "predicted": "predicted", "mixture": "mixture",
            "true": "given" if task == shipped.tasks[0] else "none",
            "auto": "given" if task == shipped.tasks[0] else shipped.auto_missing}[hint]
    assert row["task_source"] == rule
    if task == "no-such-task":
        how = f" (hint auto: {shipped.auto_missing})" if hint == "auto" else ""
        assert err == ("phasewise: note: 1 request(s) had a task label the model does not know; "
                       f"they were predicted as requests without a task{how}; its tasks: "
                       f"{', '.join(shipped.tasks)}\n")
        assert row["task"] != "no-such-task"
    else:
        assert err == ""


def test_jsonl_input_matches_the_api_line_by_line(shipped, tmp_path, capsys):
    known = shipped.tasks[0]
    rows = [{"prompt": "Write a long story about dragons", "prompt_tokens": 7, "task": known},
            {"prompt": "hi"},
            {"prompt": None, "prompt_tokens": 300},
            {"prompt": ""},
            {"prompt": "Translate 'cat' to French", "task": "no-such-task"}]
    p = tmp_path / "in.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    rc, out, err = cli(["predictor", "predict", "--input", str(p)], capsys)
    assert rc == 0 and "1 request(s) had a task label" in err
    got = [json.loads(x) for x in out.splitlines()]
    items = [(r.get("prompt"), r.get("prompt_tokens", estimate_tokens(r.get("prompt") or "")), r.get("task"))
             for r in rows]
    assert [g["prompt_tokens"] for g in got] == [n for _, n, _ in items] == [7, 1, 300, 1, 7]
    for g, e in zip(got, api_rows(shipped, items)):
        check_line(g, shipped)
        assert {k: g[k] for k in e} == e
    assert got[0]["task_source"] == "given" and got[0]["task"] == known


# ----------------------------------------------------------------------------- bad input


def test_empty_prompt(shipped, capsys):
    rc, out, err = cli(["predictor", "predict", "--prompt", ""], capsys)
    assert rc == 0 and err == ""
    row = json.loads(out)
    check_line(row, shipped)
    assert row["prompt_tokens"] == 1  # estimate_tokens: at least 1


def test_one_megabyte_prompt(shipped, capsys):
    prompt = "Please review this code and suggest improvements. " * 21_000
    assert len(prompt.encode()) > 1_000_000
    rc, out, err = cli(["predictor", "predict", "--prompt", prompt], capsys)
    assert rc == 0 and err == ""
    row = json.loads(out)
    check_line(row, shipped)
    assert row["prompt_tokens"] == math.ceil(len(prompt) / 4)
    # Only the first max_chars characters are read.
    cut = prompt[: shipped.featurizer.max_chars]
    assert row["probabilities"] == api_rows(shipped, [(cut, row["prompt_tokens"], None)])[0]["probabilities"]


def test_one_megabyte_jsonl_on_stdin(shipped):
    line = json.dumps({"prompt": "word " * 250_000, "task": "no-such-task"}).encode()
    out = cli_proc(["predictor", "predict", "--input", "-"], stdin=line + b"\n" + line + b"\n")
    assert out.returncode == 0, out.stderr
    assert b"Traceback" not in out.stderr
    rows = [json.loads(x) for x in out.stdout.splitlines()]
    assert len(rows) == 2 and rows[0] == rows[1] and rows[0]["prompt_tokens"] == 312_500 + 0
    check_line(rows[0], shipped)


def test_binary_prompt_file(shipped, tmp_path):
    p = tmp_path / "random.bin"
    raw = random.Random(0).randbytes(64 * 1024)
    p.write_bytes(raw)
    out = cli_proc(["predictor", "predict", "--prompt-file", str(p)])
    assert out.returncode == 0, out.stderr
    assert out.stderr == b""
    row = json.loads(out.stdout)
    check_line(row, shipped)
    assert row["prompt_tokens"] == len(raw) // 4
    assert row == {**row, **api_rows(shipped, [(raw, len(raw) // 4, None)])[0]}


def test_lone_surrogates(shipped, tmp_path, capsys):
    # Python API and in-process CLI: a str holding a lone surrogate.
    rc, out, err = cli(["predictor", "predict", "--prompt", "\ud800abc", "--task", "\udcff"], capsys)
    assert rc == 0 and "1 request(s) had a task label" in err
    check_line(json.loads(out), shipped)
    # JSONL: a JSON string with an escaped lone surrogate, in prompt and task.
    p = tmp_path / "s.jsonl"
    p.write_text('{"prompt": "\\ud800abc", "task": "\\ud800"}\n{"prompt": "x\\udfff"}\n')
    rc, out, err = cli(["predictor", "predict", "--input", str(p)], capsys)
    assert rc == 0
    rows = [json.loads(x) for x in out.splitlines()]
    assert len(rows) == 2
    for r in rows:
        check_line(r, shipped)
    assert rows[0]["probabilities"] == api_rows(shipped, [("abc", rows[0]["prompt_tokens"], None)])[0]["probabilities"]
    # A fresh process: the same file, and a command-line argument that is not UTF-8
    # (Python hands it over as lone surrogates).
    out = cli_proc(["predictor", "predict", "--input", str(p)])
    assert out.returncode == 0 and b"Traceback" not in out.stderr
    assert len(out.stdout.splitlines()) == 2
    out = cli_proc([b"predictor", b"predict", b"--prompt", b"caf\xe9 \xff\xfe", b"--task", b"\xff"])
    assert out.returncode == 0, out.stderr
    check_line(json.loads(out.stdout), shipped)


def test_bad_jsonl_field_is_one_line(tmp_path, capsys):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "ok"}\n{"prompt": 5}\n')
    rc, out, err = cli(["predictor", "predict", "--input", str(p)], capsys)
    assert rc == 2 and out == ""
    line = one_error_line(err)
    assert str(p) in line and "line 2" in line and "prompt" in line


def test_unknown_hint_mode_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli(["predictor", "predict", "--prompt", "x", "--hint", "bogus"], capsys)
    assert e.value.code == 2


# ----------------------------------------------------------------------------- damaged folders


def _shared_prompts() -> bool:
    from routerd.workloads.errors import WorkloadError
    from routerd.workloads.registry import resolve_data_dir

    try:
        return (resolve_data_dir(None) / "prompts").is_dir()
    except WorkloadError:
        return False


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A model folder saved by ``phasewise predictor train --kind ngram --small``; on an install
    without scikit-learn or the prompt data, a copy of the shipped one (same format)."""
    out = tmp_path_factory.mktemp("ngram") / "small"
    try:
        import sklearn  # noqa: F401
        have_sklearn = True
    except ImportError:
        have_sklearn = False
    if have_sklearn and _shared_prompts():
        from routerd.cli import main

        assert main(["predictor", "train", "--kind", "ngram", "--small", "--out", str(out), "--quiet"]) == 0
    else:
        from routerd.predictor.ngram_predictor import shipped_dir

        shutil.copytree(shipped_dir(), out)
    assert load_predictor(str(out)).kind == "ngram"
    return out


def _weights(d: Path, edit) -> None:
    from safetensors.numpy import load_file, save_file

    w = {k: v.copy() for k, v in load_file(str(d / "weights.safetensors")).items()}
    edit(w)
    save_file(w, str(d / "weights.safetensors"))


def _meta(d: Path, edit) -> None:
    m = json.loads((d / "predictor.json").read_text())
    edit(m)
    (d / "predictor.json").write_text(json.dumps(m))


def _truncate(d: Path) -> None:
    f = d / "weights.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) // 2])


def _drop_col(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a[:, :-1])


#: (case, damage, damaged file, words the one-line error must hold)
DAMAGE = [
    ("truncated weights", _truncate, "weights.safetensors", ["cannot read"]),
    ("empty weights", lambda d: (d / "weights.safetensors").write_bytes(b""), "weights.safetensors",
     ["cannot read"]),
    ("missing weights", lambda d: (d / "weights.safetensors").unlink(), "weights.safetensors", ["cannot read"]),
    ("invalid JSON metadata", lambda d: (d / "predictor.json").write_text('{"kind": "ngram",'),
     "predictor.json", ["JSON"]),
    ("metadata not an object", lambda d: (d / "predictor.json").write_text("[1, 2]"), "predictor.json", []),
    ("metadata not UTF-8", lambda d: (d / "predictor.json").write_bytes(b"\xff\xfe{}"), "predictor.json", []),
    ("vocabulary not a list", lambda d: (d / "vocabulary.json").write_text('{"hello": 0}'), "vocabulary.json",
     ["vocabulary", "list"]),
    ("vocabulary invalid JSON", lambda d: (d / "vocabulary.json").write_text('["a", '), "vocabulary.json",
     ["vocabulary"]),
    ("vocabulary shorter than idf",
     lambda d: (d / "vocabulary.json").write_text(json.dumps(json.loads((d / "vocabulary.json").read_text())[:-1])),
     "weights.safetensors", ["idf"]),
    ("missing task.coef", lambda d: _weights(d, lambda w: w.pop("task.coef")), "weights.safetensors",
     ["task.coef"]),
    ("missing bucket.intercept", lambda d: _weights(d, lambda w: w.pop("bucket.intercept")),
     "weights.safetensors", ["bucket.intercept"]),
    ("missing idf", lambda d: _weights(d, lambda w: w.pop("idf")), "weights.safetensors", ["idf"]),
    ("bucket.coef of the wrong shape", lambda d: _weights(d, lambda w: w.update({"bucket.coef": _drop_col(
        w["bucket.coef"])})), "weights.safetensors", ["shape"]),
    ("task.intercept of the wrong shape", lambda d: _weights(d, lambda w: w.update({"task.intercept": w[
        "task.intercept"][:-1].copy()})), "weights.safetensors", ["shape"]),
    ("idf of the wrong shape", lambda d: _weights(d, lambda w: w.update({"idf": w["idf"][:-1].copy()})),
     "weights.safetensors", ["idf", "shape"]),
    ("idf of rank 2", lambda d: _weights(d, lambda w: w.update({"idf": w["idf"][None, :].copy()})),
     "weights.safetensors", ["idf"]),
    ("integer weights", lambda d: _weights(d, lambda w: w.update({"bucket.intercept": w[
        "bucket.intercept"].astype(np.int32)})), "weights.safetensors", ["bucket.intercept", "float"]),
    ("NaN in weights", lambda d: _weights(d, lambda w: w["bucket.coef"].__setitem__((0, 0), np.nan)),
     "weights.safetensors", ["bucket.coef", "NaN"]),
    ("infinity in weights", lambda d: _weights(d, lambda w: w["task.intercept"].__setitem__(0, np.inf)),
     "weights.safetensors", ["task.intercept", "infinite"]),
    ("edges not increasing", lambda d: _meta(d, lambda m: m.update(edges=[1000, 250, 4000])), "predictor.json",
     ["edges", "increasing"]),
    ("edges not a list", lambda d: _meta(d, lambda m: m.update(edges="250,1000,4000")), "predictor.json",
     ["edges"]),
    ("edges missing", lambda d: _meta(d, lambda m: m.pop("edges")), "predictor.json", ["edges"]),
    ("format unknown", lambda d: _meta(d, lambda m: m.update(format=99)), "predictor.json", ["format"]),
    ("tasks not a list", lambda d: _meta(d, lambda m: m.update(tasks="chat")), "predictor.json", ["tasks"]),
    ("max_chars zero", lambda d: _meta(d, lambda m: m.update(max_chars=0)), "predictor.json", ["max_chars"]),
    ("task_classifier not a bool", lambda d: _meta(d, lambda m: m.update(task_classifier="yes")),
     "predictor.json", ["task_classifier"]),
    ("kind wrong", lambda d: _meta(d, lambda m: m.update(kind="bogus")), "predictor.json", []),
    ("kind missing", lambda d: _meta(d, lambda m: m.pop("kind")), "predictor.json", []),
]


def _damaged(model_dir: Path, tmp_path: Path, damage) -> Path:
    d = tmp_path / "model"
    shutil.copytree(model_dir, d)
    damage(d)
    return d


@pytest.mark.parametrize("case, damage, file, words", DAMAGE, ids=[c[0] for c in DAMAGE])
def test_damaged_folder_is_one_clean_error(model_dir, tmp_path, capsys, case, damage, file, words):
    d = _damaged(model_dir, tmp_path, damage)
    # Python API
    with pytest.raises(PredictorError) as e:
        load_predictor(str(d))
    msg = str(e.value)
    assert "\n" not in msg and str(d / file) in msg, msg
    for w in words:
        assert w in msg, msg
    # CLI: exit 2, one line, nothing on stdout
    rc, out, err = cli(["predictor", "predict", str(d), "--prompt", "hi"], capsys)
    assert rc == 2 and out == ""
    line = one_error_line(err)
    assert str(d / file) in line
    for w in words:
        assert w in line


def test_damaged_folder_in_a_fresh_process(model_dir, tmp_path):
    d = _damaged(model_dir, tmp_path, _truncate)
    out = cli_proc(["predictor", "predict", str(d), "--prompt", "hi"])
    assert out.returncode == 2 and out.stdout == b""
    line = one_error_line(out.stderr.decode())
    assert str(d / "weights.safetensors") in line


def test_kind_is_named_by_the_ngram_loader(model_dir, tmp_path):
    from routerd.predictor.ngram_predictor import NgramPredictor

    d = _damaged(model_dir, tmp_path, lambda d: _meta(d, lambda m: m.update(kind="bogus")))
    with pytest.raises(PredictorError, match=r"predictor\.json: field 'kind' is 'bogus', expected 'ngram'"):
        NgramPredictor.load(d)


def test_model_producing_nan_is_refused_by_the_cli(model_dir, tmp_path, capsys):
    """An all-zero idf would make every row 0/0 (NaN, invalid JSON): the load refuses it and
    the CLI says which file is damaged."""
    d = _damaged(model_dir, tmp_path, lambda d: _weights(d, lambda w: w["idf"].__setitem__(slice(None), 0.0)))
    rc, out, err = cli(["predictor", "predict", str(d), "--prompt", "hello there, how are you"], capsys)
    assert rc == 2 and out == ""
    line = one_error_line(err)
    assert str(d / "weights.safetensors") in line and "idf" in line


def test_hint_needing_a_task_classifier_on_a_model_without_one(model_dir, tmp_path, capsys):
    def no_task_head(d: Path) -> None:
        _meta(d, lambda m: m.update(task_classifier=False, auto_missing="none"))
        _weights(d, lambda w: [w.pop("task.coef"), w.pop("task.intercept")])

    d = _damaged(model_dir, tmp_path, no_task_head)
    rc, out, err = cli(["predictor", "predict", str(d), "--prompt", "hi"], capsys)
    assert rc == 0 and json.loads(out)["task_source"] == "none"
    for hint in ("predicted", "mixture"):
        rc, out, err = cli(["predictor", "predict", str(d), "--prompt", "hi", "--hint", hint], capsys)
        assert rc == 2 and out == ""
        assert "task classifier" in one_error_line(err)


# Messages that name the field (found by a reviewer, fixed in ngram.py / ngram_predictor.py / assign.py).


def test_names_field_kind_wrong_names_the_kind_field(model_dir, tmp_path):
    d = _damaged(model_dir, tmp_path, lambda d: _meta(d, lambda m: m.update(kind="bogus")))
    with pytest.raises(PredictorError, match="'kind'"):
        load_predictor(str(d))



def test_names_field_wrong_shape_names_the_tensor(model_dir, tmp_path):
    d = _damaged(model_dir, tmp_path, lambda d: _weights(d, lambda w: w.update(
        {"bucket.coef": _drop_col(w["bucket.coef"])})))
    with pytest.raises(PredictorError, match="bucket.coef"):
        load_predictor(str(d))



def test_names_field_auto_missing_names_the_file(model_dir, tmp_path):
    d = _damaged(model_dir, tmp_path, lambda d: _meta(d, lambda m: m.update(auto_missing="bogus")))
    with pytest.raises(PredictorError, match=r"predictor\.json"):
        load_predictor(str(d))



def test_names_field_zero_idf_is_refused_at_load(model_dir, tmp_path):
    d = _damaged(model_dir, tmp_path, lambda d: _weights(d, lambda w: w["idf"].__setitem__(slice(None), 0.0)))
    with pytest.raises(PredictorError, match="idf"):
        load_predictor(str(d))


# ----------------------------------------------------------------------------- routerd --predictor


def test_routerd_predictor_damaged_folder_is_a_config_error(model_dir, tmp_path):
    from routerd.daemon.app import load_length_predictor
    from routerd.errors import ConfigError

    assert load_length_predictor("default").kind == "ngram"
    for i, (case, damage, file, words) in enumerate(DAMAGE):
        d = tmp_path / f"m{i}"
        shutil.copytree(model_dir, d)
        damage(d)
        with pytest.raises(ConfigError) as e:
            load_length_predictor(str(d))
        msg = str(e.value)
        assert msg.startswith("predictor: ") and "\n" not in msg and str(d / file) in msg, (case, msg)


def test_routerd_serve_refuses_a_damaged_predictor(model_dir, tmp_path):
    d = _damaged(model_dir, tmp_path, lambda d: _weights(d, lambda w: w.pop("bucket.coef")))
    out = cli_proc(["serve", "--predictor", str(d), "--port", "0", "--no-grpc"])
    assert out.returncode == 2
    line = one_error_line(out.stderr.decode())
    assert str(d / "weights.safetensors") in line and "bucket.coef" in line


# ----------------------------------------------------------------------------- bench


def _bench(argv, tmp_path, capsys):
    return cli(["bench", "--policies", "round_robin", "--no-plot", "--out", str(tmp_path / "out"), *argv], capsys)


def test_bench_help_lists_the_default_predictor(capsys):
    with pytest.raises(SystemExit):
        cli(["bench", "--help"], capsys)
    assert "predictor:default" in " ".join(capsys.readouterr().out.split())


def test_bench_on_a_trace_without_text_notes_it_once(tmp_path, capsys):
    rc, out, err = _bench(["--prediction", "predictor:default", "--limit", "80", "--seeds", "2"], tmp_path, capsys)
    assert rc == 0, err
    notes = [x for x in err.splitlines() if "no prompt text" in x]
    assert notes == ["phasewise: note: workload 'sample' has no prompt text; predictor:default gives them its "
                     "training prior (the class frequencies of its training rows, of their task when it knows "
                     "it; overall most likely bucket 0), not a prediction from the prompt"]
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert data["prediction"] == "predictor:default"


def test_bench_note_is_about_text_only_for_predictors_that_read_it(tmp_path, capsys):
    from routerd.cli import _textless_note

    assert _textless_note("predictor:default", "mooncake", 10, 0, 10) == (
        "workload 'mooncake' has no prompt text; predictor:default predicts from prompt length alone "
        "(the requests have no task label either)")
    assert _textless_note("predictor:x", "w", 4, 4, 10) == (
        "4 of 10 requests of workload 'w' have no prompt text; predictor:x predicts those from prompt length "
        "and task label alone")
    assert "when present" in _textless_note("predictor:x", "w", 4, 2, 4)
    assert "never reads prompt text" in _textless_note("predictor:majority", "w", 4, 0, 4)


def test_bench_with_a_damaged_predictor_is_one_line(model_dir, tmp_path, capsys):
    d = _damaged(model_dir, tmp_path, _truncate)
    rc, out, err = _bench(["--prediction", f"predictor:{d}", "--limit", "20"], tmp_path, capsys)
    assert rc == 2
    assert str(d / "weights.safetensors") in one_error_line(err)
    assert not (tmp_path / "out" / "bench.json").exists()


def test_bench_study8_refuses_a_predictor(tmp_path, capsys):
    rc, out, err = _bench(["--study8", "--prediction", "predictor:default"], tmp_path, capsys)
    assert rc == 2 and "--study8" in one_error_line(err)


def test_bench_on_public_mix_has_text(tmp_path, capsys):
    if not _shared_prompts():
        pytest.skip("no shared/data/prompts")
    rc, out, err = _bench(["-w", "public-mix", "-n", "60", "--prediction", "predictor:default"], tmp_path, capsys)
    assert rc == 0, err
    assert "no prompt text" not in err
    assert "prediction=predictor:default" in out


# ----------------------------------------------------------------------------- other predictor kinds


class _FakeTransformer:
    """Stands in for HFPredictor (no torch here): hint modes without mixture, predict_proba only."""

    HINT_MODES = ("auto", "true", "predicted", "none")
    name = "transformer[auto]"
    edges = (250, 1000, 4000)

    def __init__(self, probs, task_model=None):
        self.hint = "auto"
        self.task_model = task_model
        self.probs = np.asarray(probs, dtype=np.float64)

    def predict_proba(self, batch):
        return self.probs[: len(batch)]


def test_hint_rules_for_transformers_and_baselines():
    from routerd.predictor.base import MajorityPredictor
    from routerd.predictor.cli import _set_hint

    t = _FakeTransformer([[1, 0, 0, 0]])
    for hint in ("mixture", "predicted"):  # mixture: n-gram only; predicted: needs a task model
        with pytest.raises(PredictorError, match=f"--hint {hint}"):
            _set_hint(t, hint)
    assert _set_hint(t, "none") is None and t.hint == "none"
    t = _FakeTransformer([[1, 0, 0, 0]], task_model=object())
    assert _set_hint(t, "predicted") is None and t.hint == "predicted"
    m = MajorityPredictor().fit([1])
    assert _set_hint(m, "auto") is None
    assert "--hint none is ignored" in _set_hint(m, "none")


def test_rows_of_a_predictor_with_probabilities_only():
    from routerd.predictor.cli import _rows

    t = _FakeTransformer([[0.1, 0.6, 0.3], [0.7, 0.2, 0.1]])  # 3 classes: the top two buckets merged
    rows = _rows(t, [("a", 3, "chat"), (None, 9, None)])
    assert rows == [
        {"bucket": 1, "tokens": "250-999", "probabilities": {"0-249": 0.1, "250-999": 0.6, ">=1000": 0.3},
         "task": "chat", "prompt_tokens": 3, "predictor": "transformer[auto]"},
        {"bucket": 0, "tokens": "0-249", "probabilities": {"0-249": 0.7, "250-999": 0.2, ">=1000": 0.1},
         "task": None, "prompt_tokens": 9, "predictor": "transformer[auto]"},
    ]
    # NaN, infinity, too many rows for the batch, no classes: refused with one line, never printed.
    for bad in ([[np.nan, 0.5, 0.5]], [[np.inf, 0.0, 0.0]], np.full((2, 3), 1 / 3), np.zeros((1, 0))):
        t = _FakeTransformer(bad)
        t.predict_proba = lambda batch, a=np.asarray(bad): a
        with pytest.raises(PredictorError, match="probabilities of shape"):
            _rows(t, [("a", 3, None)])


def test_jsonl_without_prompt_fields_is_refused_and_unknown_fields_noted(capsys, monkeypatch, tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "hi", "id": 7}\n{"text": "Write a long essay"}\n')
    rc, out, err = cli(["predictor", "predict", "--input", str(f)], capsys)
    assert rc == 2 and out == ""
    assert one_error_line(err) == f"phasewise: error: {f}: line 2: needs field prompt or prompt_tokens (got 'text')"
    f.write_text('{"prompt": "hi", "id": 7}\n{"prompt_tokens": 12, "id": 8, "source": "x"}\n')
    rc, out, err = cli(["predictor", "predict", "--input", str(f)], capsys)
    assert rc == 0 and len(out.splitlines()) == 2
    assert err == (f"phasewise: note: {f}: ignored field(s) 'id' (first on line 1), 'source' (first on line 2); "
                   "the fields are prompt, prompt_tokens, task\n")


def test_jsonl_that_json_cannot_hold_is_one_error_line(capsys, tmp_path):
    f = tmp_path / "in.jsonl"
    for body, words in (('{"prompt": "hi", "prompt_tokens": ' + "9" * 5000 + "}", "line 1: unreadable JSON"),
                        ('{"prompt": "hi"}\n' + "[" * 100_000 + "]" * 100_000, "line 2: unreadable JSON")):
        f.write_text(body)
        rc, out, err = cli(["predictor", "predict", "--input", str(f)], capsys)
        assert rc == 2 and out == "" and words in one_error_line(err)
    f.write_bytes(b'\xef\xbb\xbf{"prompt": "hi"}\n')  # a byte-order mark
    rc, out, err = cli(["predictor", "predict", "--input", str(f)], capsys)
    assert rc == 0 and json.loads(out)["bucket"] in (0, 1, 2)


def test_routerd_refuses_an_empty_predictor_setting():
    from routerd.daemon.app import load_length_predictor
    from routerd.errors import ConfigError

    for spec in ("", "  "):
        with pytest.raises(ConfigError, match="predictor: empty"):
            load_length_predictor(spec)
    assert load_length_predictor("none") is None and load_length_predictor("NONE") is None
