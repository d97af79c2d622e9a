"""routerd.prefix.tokenize: the byte tokenizer and tokenizer.json files built here with the tokenizers library.

Ids are checked by hand (a word-level vocabulary) and against the tokenizers library's own encoding of
the same file (an independent source), including the cut that bounds the work for long texts.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from routerd.prefix.text import byte_token_array
from routerd.prefix.tokenize import (
    CHARS_PER_TOKEN_BOUND,
    HFTokenizer,
    TokenizerUnavailable,
    load_tokenizer,
)

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Answer briefly and precisely.",
    "def add(a, b):\n    return a + b  # numbers 0123456789",
    "Prefix caching reuses the KV blocks of a shared prompt prefix.",
]


def _word_level(tmp_path):
    vocab = {"[UNK]": 0, "[BOS]": 1, "hello": 2, "world": 3, "!": 4, "a": 5, "abcdefghi": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def _bpe(tmp_path, pre_tokenized: bool):
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    if pre_tokenized:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:  # one "word" per text, as SentencePiece-style tokenizers without a pre-tokenizer
        alphabet = sorted({c for s in CORPUS for c in s})
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>"], initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    path = tmp_path / f"bpe_{int(pre_tokenized)}.json"
    tok.save(str(path))
    return path


def test_a_word_level_file_gives_the_ids_worked_out_by_hand(tmp_path):
    t = load_tokenizer(str(_word_level(tmp_path)))
    out = t.encode("hello world!")
    assert out.dtype == np.uint32 and out.tolist() == [1, 2, 3, 4]  # [BOS] hello world !
    assert t.encode("hello world!", add_special_tokens=False).tolist() == [2, 3, 4]
    assert t.encode("hello there").tolist() == [1, 2, 0]
    assert t.encode("hello world!", max_tokens=2).tolist() == [1, 2]
    assert t.encode("hello", max_tokens=0).tolist() == []
    assert t.name.endswith("tokenizer.json")


def test_a_files_own_padding_and_truncation_are_not_applied(tmp_path):
    # Sentence-embedding tokenizer.json files pad and cut to a fixed length; vLLM's prompt ids
    # have neither, so routerd's must not either.
    vocab = {"[UNK]": 0, "[PAD]": 9, "hello": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.enable_padding(length=8, pad_id=9, pad_token="[PAD]")
    tok.enable_truncation(max_length=3)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    assert Tokenizer.from_file(str(path)).encode("hello world").ids == [2, 3, 9, 9, 9, 9, 9, 9]  # as saved
    t = load_tokenizer(str(path))
    assert t.encode("hello world").tolist() == [2, 3]
    assert t.encode("hello world " * 4).tolist() == [2, 3] * 4


def test_a_model_folder_holding_tokenizer_json_loads(tmp_path):
    _word_level(tmp_path)
    assert load_tokenizer(str(tmp_path)).encode("world").tolist() == [1, 3]


@pytest.mark.parametrize("pre_tokenized", [True, False])
def test_bpe_ids_equal_the_tokenizers_librarys_own_and_the_cut_keeps_them(tmp_path, pre_tokenized):
    path = _bpe(tmp_path, pre_tokenized)
    ref = Tokenizer.from_file(str(path))
    t = load_tokenizer(str(path))
    short = CORPUS[1]
    assert t.encode(short).tolist() == ref.encode(short).ids
    assert t.encode(short, add_special_tokens=False).tolist() == ref.encode(short, add_special_tokens=False).ids
    long_text = " ".join(CORPUS) * 60  # ~13K characters
    full = ref.encode(long_text).ids
    for max_tokens in (1, 100, 257, 1000):
        assert len(long_text) > max_tokens * CHARS_PER_TOKEN_BOUND or max_tokens == 1000
        assert t.encode(long_text, max_tokens=max_tokens).tolist() == full[:max_tokens], max_tokens
    assert t.encode(long_text, max_tokens=10**6).tolist() == full


def test_the_cut_grows_when_a_text_is_sparser_than_the_bound(tmp_path):
    """Text whose tokens span more than 8 characters each: the first cut gives too few ids."""
    path = _word_level(tmp_path)
    t = load_tokenizer(str(path))
    text = ("hello" + " " * 20) * 200  # 25 characters per token
    full = Tokenizer.from_file(str(path)).encode(text).ids
    assert t.encode(text, max_tokens=50).tolist() == full[:50] == [1] + [2] * 49


def test_a_token_broken_by_the_cut_is_never_kept(tmp_path):
    """10 ids wanted: the first cut (80 characters) ends inside the 8th 'abcdefghi', whose piece
    'abcdefgh' is [UNK]; it is the 10th id of the cut text, so only the margin keeps it out."""
    path = _word_level(tmp_path)
    text = "a " + "abcdefghi " * 40
    cut_ids = Tokenizer.from_file(str(path)).encode(text[: 10 * CHARS_PER_TOKEN_BOUND]).ids
    assert cut_ids == [1, 5] + [6] * 7 + [0]  # [BOS] a, 7 words, the broken one
    assert load_tokenizer(str(path)).encode(text, max_tokens=10).tolist() == [1, 5] + [6] * 8


def test_bytes_is_the_emulators_tokenizer_bounded_by_max_tokens():
    t = load_tokenizer("bytes")
    text = "naïve café — " * 50 + "\ud800 lone surrogate"
    whole = byte_token_array(text)
    assert t.encode(text).tolist() == whole.tolist()
    for m in (0, 1, 7, 100, len(whole), len(whole) + 5):
        assert t.encode(text, max_tokens=m).tolist() == whole[:m].tolist()
    assert t.encode("", add_special_tokens=False).tolist() == [0]  # an empty text is one token, as the emulator


def test_encode_refuses_what_it_cannot_tokenize(tmp_path):
    t = load_tokenizer(str(_word_level(tmp_path)))
    with pytest.raises(ValueError, match="str"):
        t.encode(b"hello")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tokens"):
        t.encode("hello", max_tokens=-1)

    class Broken:
        def encode(self, text, add_special_tokens=True):
            raise Exception("Truncation error: second sequence not provided\nmore detail")

    msg = r"^tokenizer x\.json failed to encode: Truncation error: second sequence not provided$"
    with pytest.raises(ValueError, match=msg):
        HFTokenizer(Broken(), "x.json").encode("hello")


def test_load_errors_are_one_line_and_name_the_file(tmp_path, monkeypatch):
    def refused(spec):
        with pytest.raises(TokenizerUnavailable) as e:
            load_tokenizer(spec)
        msg = str(e.value)
        assert "\n" not in msg
        return msg

    assert "no tokenizer configured" in refused("")
    missing = tmp_path / "nope" / "tokenizer.json"
    assert refused(str(missing)) == f"tokenizer file {missing} does not exist"
    assert refused(str(tmp_path)) == (f"model folder {tmp_path} has no tokenizer.json (routerd reads Hugging Face "
                                      "fast tokenizers)")
    bad_utf8 = tmp_path / "latin1.json"
    bad_utf8.write_bytes(b'{"model": "\xff"}')
    assert refused(str(bad_utf8)).startswith(f"tokenizer file {bad_utf8} cannot be read (UnicodeDecodeError")
    not_json = tmp_path / "notjson.json"
    not_json.write_text("{model: BPE")
    assert refused(str(not_json)).startswith(f"tokenizer file {not_json} is not JSON (")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"version": "1.0", "model": {"type": "NoSuchModel"}}))
    assert refused(str(wrong)).startswith(f"tokenizer file {wrong} is not a Hugging Face tokenizer.json (")

    good = _word_level(tmp_path)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if the extra were not installed
    msg = refused(str(good))
    assert msg == (f"the 'tokenizers' package is not installed, needed for {good} "
                   "(pip install 'phasewise[tokenizer]')")
    assert load_tokenizer("bytes").encode("abcd").tolist() == [0x64636261]  # needs no package
