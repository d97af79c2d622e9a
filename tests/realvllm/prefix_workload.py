"""A prefix-sharing request mix for real vLLM engines behind routerd, and what vLLM says of each request.

Shared by ``tests/realvllm/test_prefix_precise_real.py`` and ``benchmarks/prefix_real.py``:
:func:`groups` makes prefix groups (a shared prefix of several 128-token blocks, each group one
way of asking: completions or chat, streamed or not, with or without ``cache_salt``, the base
model or a LoRA adapter), :func:`send` sends one request with the official ``openai`` client and
returns what routerd's headers and vLLM's ``usage`` say: the endpoint routerd chose
(``x-phasewise-endpoint``), routerd's cached-token estimate (``x-phasewise-cached-tokens``), and
vLLM's own count of prompt tokens served from its prefix cache
(``usage.prompt_tokens_details.cached_tokens``, with ``--enable-prompt-tokens-details``).

Texts are pseudo-words of the tiny model's tokenizer (about 2-6 tokens each); a request's unique
tail keeps every first request of a group from hitting another group's blocks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

#: Engine KV block size of vLLM's CPU build (the tiny engines run at its default).
BLOCK = 128


@dataclass
class Group:
    """One shared prefix and how its requests ask (``kind``: completions or chat)."""

    name: str
    prefix: str
    kind: str
    stream: bool
    model: str
    salt: str | None = None
    sent: int = field(default=0)


@dataclass
class Result:
    """What one request found: routerd's choice and estimate, vLLM's own count."""

    group: str
    repeat: bool
    endpoint: str | None
    estimate: int | None
    cached: int | None
    prompt_tokens: int | None


def words(rng: random.Random, n: int) -> str:
    syl = ["ka", "lo", "mi", "ter", "su", "ran", "vo", "de", "pli", "gon", "be", "sta", "qu", "ix", "ne", "or"]
    return " ".join("".join(rng.choice(syl) for _ in range(rng.randint(1, 3))) for _ in range(n))


def groups(seed: int, model: str, adapters: tuple[str, ...], prefix_words: int = 120) -> list[Group]:
    """Prefix groups covering every way of asking (see the module docstring)."""
    rng = random.Random(seed)
    a1, a2 = (adapters + (model, model))[:2]
    kinds = [("comp", "completions", False, model, None), ("comp-stream", "completions", True, model, None),
             ("chat", "chat", False, model, None), ("chat-stream", "chat", True, model, None),
             ("comp-salt", "completions", False, model, f"salt-{seed}"),
             ("chat-salt-stream", "chat", True, model, f"salt-{seed}"),
             ("comp-lora", "completions", True, a1, None), ("chat-lora", "chat", False, a2, None),
             ("comp-lora-salt", "completions", False, a1, f"lsalt-{seed}")]
    return [Group(f"{name}-{seed}", f"{name} {seed} " + words(rng, prefix_words), kind, stream, m, salt)
            for name, kind, stream, m, salt in kinds]


def send(client: Any, g: Group, rng: random.Random, *, max_tokens: int = 4) -> Result:
    """One request of group ``g`` (a fresh tail of its own), through the ``openai`` client."""
    tail = f"q{g.sent} " + words(rng, 8)
    repeat = g.sent > 0
    g.sent += 1
    extra: dict[str, Any] = {"ignore_eos": True}
    if g.salt is not None:
        extra["cache_salt"] = g.salt
    kw: dict[str, Any] = {"model": g.model, "max_tokens": max_tokens, "extra_body": extra}
    if g.stream:
        kw["stream"] = True
        kw["stream_options"] = {"include_usage": True}
    if g.kind == "chat":
        msgs = [{"role": "system", "content": g.prefix}, {"role": "user", "content": tail}]
        raw = client.chat.completions.with_raw_response.create(messages=msgs, **kw)
    else:
        raw = client.completions.with_raw_response.create(prompt=g.prefix + " " + tail, **kw)
    body = raw.parse()
    usage = None
    if g.stream:
        for chunk in body:
            if getattr(chunk, "usage", None) is not None:
                usage = chunk.usage
    else:
        usage = body.usage
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    est = raw.headers.get("x-phasewise-cached-tokens")
    return Result(g.name, repeat, raw.headers.get("x-phasewise-endpoint"), int(est) if est is not None else None,
                  getattr(details, "cached_tokens", None), getattr(usage, "prompt_tokens", None))


def summary(results: list[Result], block: int = BLOCK) -> dict[str, Any]:
    """The two targets over the repeats: the share that found their prefix cached on the chosen
    engine (vLLM's ``cached_tokens`` > 0), and the share whose estimate is within one block of it."""
    reps = [r for r in results if r.repeat]
    hit = sum(1 for r in reps if r.cached)
    agree = sum(1 for r in results if r.estimate is not None and r.cached is not None
                and abs(r.estimate - r.cached) <= block)
    return {"repeats": len(reps), "repeat_hits": hit, "repeat_hit_share": hit / len(reps) if reps else 0.0,
            "requests": len(results), "estimate_within_block": agree,
            "estimate_share": agree / len(results) if results else 0.0,
            "endpoints": sorted({r.endpoint for r in results if r.endpoint})}
