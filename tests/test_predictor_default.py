"""The shipped n-gram predictor (``load_predictor("default")``) through the Python API.

The shipped weights are replaced from time to time, so nothing here depends on its
accuracy: the tests check invariants (probabilities are a distribution, the bucket is
their argmax, the task-source rules of :class:`~routerd.predictor.ngram_predictor.NgramPredictor`,
the mixture identity, cleaning of bad input) and that a core install serves it with
numpy alone.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from routerd.model import PREDICTOR_BUCKET_EDGES, Request
from routerd.predictor import PredictorError, assign_predictions, load_predictor
from routerd.predictor.base import softmax_rows
from routerd.predictor.ngram_predictor import HINT_MODES, NgramPredictor, shipped_dir

ROUTERD = Path(__file__).resolve().parents[1] / "routerd"
HEAVY = ("torch", "sklearn", "scipy", "transformers")


@pytest.fixture(scope="module")
def shipped() -> NgramPredictor:
    return load_predictor("default")


@pytest.fixture
def pred(shipped):
    """The shipped predictor with hint ``auto`` and a zeroed unknown-task counter (tests change both)."""
    shipped.hint = "auto"
    shipped.unknown_tasks = 0
    return shipped


def odd_batch(known_task: str) -> list[tuple]:
    """Requests a router can receive: empty, huge, binary, lone surrogate, unknown task, no text."""
    rnd = random.Random(0)
    return [
        ("", 0, None),
        ("Write a detailed, multi-part essay on the history of Rome. " * 20_000, 250_000, None),  # ~1 MB
        (rnd.randbytes(5000), 1250, None),
        ("\ud800abc", 3, None),
        ("Summarise this email in one line.", 8, "no-such-task"),
        (None, 40, None),
        (None, 0, known_task),
        ("Tell me a joke", 4, known_task),
        (b"\xff\xfe\x00bad bytes", 2**70, None),  # a token count beyond float range
    ]


def test_default_is_the_shipped_ngram_predictor(shipped):
    assert isinstance(shipped, NgramPredictor)
    assert shipped.path == shipped_dir()
    # The simulator and routerd use these edges; bench refuses a predictor with others.
    assert shipped.edges == tuple(PREDICTOR_BUCKET_EDGES)
    assert 2 <= shipped.bucket.classes <= len(shipped.edges) + 1
    assert shipped.name.startswith("ngram:") and shipped.name.endswith("[auto]")
    assert shipped.tasks, "the shipped model knows its training tasks"


@pytest.mark.parametrize("hint", HINT_MODES)
def test_probabilities_bucket_and_task_source_rules(pred, hint):
    if hint in ("predicted", "mixture") and pred.task_model is None:
        pytest.skip("this shipped model has no task classifier")
    pred.hint = hint
    known = pred.tasks[0]
    batch = odd_batch(known)
    probs, info = pred.explain(batch)
    assert probs.shape == (len(batch), pred.bucket.classes) and probs.dtype == np.float64
    assert np.isfinite(probs).all() and (probs >= 0).all()
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-12)
    assert pred.predict(batch) == probs.argmax(axis=1).tolist()
    np.testing.assert_array_equal(pred.predict_proba(batch), probs)
    assert len(info) == len(batch)
    for (_, _, task), row in zip(batch, info):
        assert set(row) == {"task", "task_source", "task_probability", "text"}
        is_known = task == known
        src = row["task_source"]
        if not row["text"]:  # no prompt text: the training prior, with the given task only
            assert src == ("given" if is_known and hint in ("true", "auto") else "none")
            continue
        if hint == "none":
            expected = "none"
        elif hint == "true":
            expected = "given" if is_known else "none"
        elif hint == "auto":
            expected = "given" if is_known else pred.auto_missing
        else:
            expected = hint
        assert src == expected
        if src == "given":
            assert row["task"] == task and row["task_probability"] is None
        elif src == "none":
            assert row["task"] is None and row["task_probability"] is None
        else:
            assert row["task"] in pred.tasks
            # The top task of the posterior: at least uniform probability, at most 1.
            assert 1.0 / len(pred.tasks) - 1e-12 <= row["task_probability"] <= 1.0


def test_predicted_hint_is_the_bucket_model_given_the_guessed_task(pred):
    if pred.task_model is None:
        pytest.skip("this shipped model has no task classifier")
    batch = odd_batch(pred.tasks[0])
    pred.hint = "predicted"
    probs, info = pred.explain(batch)
    # Requests without text get the prior, not a guessed task (test_requests_without_text_...).
    keep = [i for i, r in enumerate(info) if r["text"]]
    assert keep and len(keep) < len(batch)
    batch, probs, info = [batch[i] for i in keep], probs[keep], [info[i] for i in keep]
    guessed = pred.predict_tasks(batch)
    assert [r["task"] for r in info] == guessed
    pred.hint = "true"
    given, _ = pred.explain([(p, n, t) for (p, n, _), t in zip(batch, guessed)])
    np.testing.assert_allclose(probs, given, rtol=0, atol=1e-12)


def test_mixture_is_the_posterior_average_over_tasks(pred):
    """P(b | x) = sum_t P(t | x) P(b | x, t) (ngram_predictor module docstring), recomputed
    from the bucket model with each task given and the task classifier's softmax."""
    if pred.task_model is None:
        pytest.skip("this shipped model has no task classifier")
    batch = odd_batch(pred.tasks[0])[:6]
    pred.hint = "mixture"
    probs, info = pred.explain(batch)
    keep = [i for i, r in enumerate(info) if r["text"]]
    batch, probs, info = [batch[i] for i in keep], probs[keep], [info[i] for i in keep]
    x = pred.featurizer.transform([p for p, _, _ in batch])
    post = softmax_rows(pred.task_model.scores(x, [n for _, n, _ in batch], [None] * len(batch)))
    pred.hint = "true"
    expected = np.zeros_like(probs)
    for k, t in enumerate(pred.tasks):
        expected += post[:, k: k + 1] * pred.explain([(p, n, t) for p, n, _ in batch])[0]
    np.testing.assert_allclose(probs, expected, rtol=0, atol=1e-9)
    for i, row in enumerate(info):
        assert row["task"] == pred.tasks[int(post[i].argmax())]
        assert row["task_probability"] == pytest.approx(post[i].max(), abs=1e-12)


@pytest.mark.parametrize("hint", ["auto", "none"])
def test_bad_prompts_are_cleaned_not_refused(pred, hint):
    pred.hint = hint
    known = pred.tasks[0]
    max_chars = pred.featurizer.max_chars

    def p(prompt, tokens=5, task=None):
        return pred.explain([(prompt, tokens, task)])[0][0]

    huge = "Write a detailed, multi-part essay on the history of Rome. " * 20_000
    assert len(huge.encode()) > 1_000_000
    # Only the first max_chars characters are read.
    np.testing.assert_array_equal(p(huge), p(huge[:max_chars]))
    # No text and empty text are the same request; a lone surrogate is a non-word character.
    np.testing.assert_array_equal(p(None), p(""))
    np.testing.assert_array_equal(p("\ud800abc"), p("abc"))
    # Bytes are decoded as UTF-8 with bad bytes replaced.
    raw = random.Random(1).randbytes(5000)
    np.testing.assert_array_equal(p(raw), p(raw.decode("utf-8", errors="replace")))
    # An unknown task label is no task, and is counted.
    before = pred.unknown_tasks
    np.testing.assert_array_equal(p("Tell me a joke", 4, "no-such-task"), p("Tell me a joke", 4, None))
    assert pred.unknown_tasks == before + 1
    np.testing.assert_array_equal(p("Tell me a joke", 4, 17), p("Tell me a joke", 4, None))
    # Token counts are clamped before use, never overflow.
    assert np.isfinite(p("x", 10**400)).all()
    if hint == "auto":
        assert pred.explain([("Tell me a joke", 4, known)])[1][0]["task_source"] == "given"


def test_empty_batch(pred):
    probs, info = pred.explain([])
    assert probs.shape == (0, pred.bucket.classes) and info == []
    assert pred.predict([]) == []


@pytest.mark.parametrize("bad", [
    [("text", -1, None)],
    [("text", 1.5, None)],
    [("text", True, None)],
    [("text", 1)],
    ["text"],
    [(123, 1, None)],
])
def test_malformed_batch_is_a_predictor_error(pred, bad):
    with pytest.raises(PredictorError):
        pred.explain(bad)


@pytest.mark.parametrize("mode", ["bogus", "", "AUTO", None])
def test_unknown_hint_mode_is_refused(pred, mode):
    with pytest.raises(PredictorError, match="hint mode"):
        pred.hint = mode
    assert pred.hint == "auto"


def test_assign_predictions_on_a_trace_without_text(pred):
    """Traces carry no prompt text (``prompt=None``): the predictor still assigns every request a
    bucket, the one it gives from length (and task) alone."""
    from routerd.workloads.registry import load_workload

    requests = load_workload("sample", limit=150).requests
    assert all(r.prompt is None for r in requests)
    out = assign_predictions(requests, pred, edges=PREDICTOR_BUCKET_EDGES, batch_size=64)
    assert [q.id for q in out] == [r.id for r in requests]
    expected = pred.predict([(None, r.prompt_tokens, r.task) for r in requests])
    assert [q.predicted_bucket for q in out] == expected
    assert all(0 <= b < pred.bucket.classes for b in expected)


def test_assign_predictions_with_text_matches_predict(pred):
    items = [(t, max(n, 1), task) for t, n, task in odd_batch(pred.tasks[0]) if not isinstance(t, bytes)]
    rs = [Request(id=i, arrival_s=0.1 * i, prompt_tokens=n, output_tokens=10, prompt=t, task=task)
          for i, (t, n, task) in enumerate(items)]
    assert any(r.prompt for r in rs) and any(r.prompt is None for r in rs)
    out = assign_predictions(rs, pred, batch_size=4)
    assert [q.predicted_bucket for q in out] == pred.predict([(r.prompt, r.prompt_tokens, r.task) for r in rs])


# ----------------------------------------------------------------------------- core install

#: Installed before routerd is imported: any import of a heavy package fails as if it were
#: not installed, and any attempt is recorded.
BLOCKER = f"""
import sys
HEAVY = {HEAVY!r}
tried = []
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in HEAVY:
            tried.append(name)
            raise ImportError(f'blocked for the core-install test: {{name}}')
        return None
sys.meta_path.insert(0, Block())
for m in list(sys.modules):
    if m.split('.')[0] in HEAVY:
        del sys.modules[m]
"""


def _run_blocked(body: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROUTERD), env.get("PYTHONPATH", "")])
    code = BLOCKER + body + f"""
loaded = [m for m in sys.modules if m.split('.')[0] in HEAVY]
assert not loaded, f'heavy modules loaded: {{loaded}}'
print('tried imports:', sorted(set(tried)))
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_blocker_blocks():
    """The blocker itself works (otherwise the tests below could not fail)."""
    out = _run_blocked("import sklearn\n")
    assert out.returncode != 0 and "blocked for the core-install test: sklearn" in out.stderr


def test_importing_the_predictor_package_needs_no_heavy_package():
    out = _run_blocked("import routerd.predictor\nimport routerd.predictor.cli\n")
    assert out.returncode == 0, out.stderr
    assert "tried imports: []" in out.stdout


def test_core_install_serves_the_shipped_model():
    out = _run_blocked("""
import routerd
from routerd.predictor import load_predictor
p = load_predictor('default')
probs, info = p.explain([('Write a poem about the sea', 7, None), (None, 300, None), ('', 0, 'no-such-task')])
assert probs.shape[0] == 3 and abs(probs.sum() - 3) < 1e-9, probs
assert len(p.predict([('hi', 1, None)])) == 1
import routerd.cli
rc = routerd.cli.main(['predictor', 'predict', '--prompt', 'hi'])
assert rc == 0, rc
""")
    assert out.returncode == 0, out.stderr
    line = [x for x in out.stdout.splitlines() if x.startswith("{")]
    assert len(line) == 1 and '"predictor": "ngram:' in line[0]


def test_requests_without_text_get_the_training_prior(pred):
    """The prior of predictor.json: class counts of the training rows, per task or overall."""
    prior = pred.meta["prior"]
    known = pred.tasks[0]
    batch = [(None, 3000, None), ("", 10, None), ("   \n", 10, known), (None, 5, "no-such-task"),
             ("a real prompt about code", 3000, None)]
    for hint in ("auto", "true", "predicted", "mixture", "none"):
        pred.hint = hint
        probs, info = pred.explain(batch)
        total = np.asarray(prior["all"], dtype=float)
        np.testing.assert_allclose(probs[0], total / total.sum(), atol=1e-12)
        np.testing.assert_allclose(probs[1], total / total.sum(), atol=1e-12)
        np.testing.assert_allclose(probs[3], total / total.sum(), atol=1e-12)
        if hint in ("auto", "true"):
            own = np.asarray(prior["tasks"][known], dtype=float)
            np.testing.assert_allclose(probs[2], own / own.sum(), atol=1e-12)
            assert info[2]["task"] == known and info[2]["task_source"] == "given"
        assert [r["text"] for r in info] == [False, False, False, False, True]
        assert all(r["task_probability"] is None for r in info[:4])
    # The shipped prior's majority is bucket 0 (GPTeacher's short answers dominate).
    assert pred.predict([(None, 3000, None)]) == [int(np.argmax(prior["all"]))] == [0]
