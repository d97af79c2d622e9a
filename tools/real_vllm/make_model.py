"""Make the tiny random-weight Llama the real-engine tests serve: tokenizer, chat template, weights, a LoRA adapter.

Run with the vLLM venv's Python (it has torch, transformers, tokenizers and peft; see
``tools/vllm/build.sh``)::

    python tools/vllm/make_model.py OUT_DIR [--seed 0]

Writes ``OUT_DIR/model`` (a Hugging Face model folder vLLM loads with ``--model``: ``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` with a ``chat_template``,
``chat_template.jinja``) and ``OUT_DIR/lora-a1``, ``OUT_DIR/lora-a2`` (random ``peft`` LoRA adapters
of rank 8 on ``q_proj``/``v_proj``, vLLM's ``--lora-modules a1=...``). Deterministic: the same seed
gives byte-identical tokenizer files and identical weights (no download, no clock, no randomness
outside ``--seed``). Generated text is gibberish; token counts, timing, batching, caching and wire
formats are vLLM's own (``shared/docs/real-vllm.md``).

The tokenizer is a byte-level BPE trained on a corpus generated from the seed (word shapes of
English: 2-9 letters), 2,048 ids, with special tokens ``<s>`` (BOS, id 0), ``</s>`` (EOS, id 1),
``<unk>``, ``<pad>``. Its post-processor adds ``<s>`` in front of every encoding with special tokens,
as Llama tokenizers do, so vLLM's completions API (``add_special_tokens`` true) and its chat API
(false, the template writes ``<s>``) differ the way they do for real models.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

#: The chat template (Jinja, rendered by vLLM with transformers' sandboxed environment). It uses
#: ``bos_token``, ``messages``, ``add_generation_prompt`` and a ``raise_exception`` call for an
#: unknown role, as real templates do.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

VOCAB_SIZE = 2048
SPECIALS = ["<s>", "</s>", "<unk>", "<pad>"]


def corpus(seed: int, n_words: int = 60_000) -> list[str]:
    """Lines of pseudo-words from ``seed`` (deterministic)."""
    rng = random.Random(seed)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    weights = [26 - i for i in range(26)]
    words = ["".join(rng.choices(letters, weights, k=rng.randint(2, 9))) for _ in range(4000)]
    lines, line = [], []
    for _ in range(n_words):
        line.append(rng.choice(words))
        if len(line) >= rng.randint(6, 14):
            lines.append(" ".join(line) + rng.choice([".", ",", "?", "!", ":"]))
            line = []
    lines.append("0123456789 ()[]{}<>|/\\-_+=*&^%$#@~`'\";")
    return lines


def make_tokenizer(out: Path, seed: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", model_max_length=4096, chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(str(out))
    # Some transformers versions write the template to chat_template.jinja only, others into
    # tokenizer_config.json only: write both, so every reader finds it.
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return len(fast)


def make_weights(out: Path, vocab: int, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=0, eos_token_id=1, pad_token_id=3, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(out), safe_serialization=True)


def make_lora(model_dir: Path, out: Path, seed: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM.from_pretrained(str(model_dir))
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, cfg).save_pretrained(str(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder to write model/ and lora-a1/, lora-a2/ into")
    ap.add_argument("--seed", type=int, default=0, help="seeds the tokenizer corpus, weights and adapters")
    args = ap.parse_args(argv)
    out: Path = args.out
    model = out / "model"
    model.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(model, args.seed)
    make_weights(model, vocab, args.seed)
    for i, name in enumerate(("lora-a1", "lora-a2"), start=1):
        make_lora(model, out / name, args.seed + i)
    print(f"tiny model in {model} (vocab {vocab}), adapters in {out / 'lora-a1'}, {out / 'lora-a2'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
