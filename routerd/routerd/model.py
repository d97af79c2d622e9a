"""Domain model shared by the simulator, the policies and the workloads.

A :class:`Request` is one LLM inference request as the router receives it. Its
``output_tokens`` is the *true* response length: the simulator uses it to know when
the request finishes, and only the explicitly named ``oracle`` policies may read it
(policies see :class:`routerd.policies.base.RequestFeatures` instead).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

#: Output-length bucket edges in tokens used by the paper's predictor
#: (arXiv 2408.13510 §5.1): 0-250, 250-1000, 1000-4000, >= 4000.
PREDICTOR_BUCKET_EDGES: tuple[int, ...] = (250, 1000, 4000)


class Request(BaseModel):
    """One inference request.

    Units: ``arrival_s`` in seconds from the start of the workload, token counts in
    tokens. ``predicted_bucket`` is filled by a predictor before simulation (computed
    once per request so the simulator stays fast); ``None`` means "not predicted".
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: int = Field(ge=0)
    """Index of the request in its workload (0-based, unique)."""
    arrival_s: float = Field(ge=0.0)
    """Arrival time at the router, seconds since the workload start."""
    prompt_tokens: int = Field(ge=1)
    """Prompt (prefill) length in tokens."""
    output_tokens: int = Field(ge=1)
    """True response (decode) length in tokens, including the first token."""
    prompt: str | None = None
    """Prompt text when the workload has it (for predictors)."""
    task: str | None = None
    """Task label when the workload has it (for predictors and reports)."""
    predicted_bucket: int | None = Field(default=None, ge=0)
    """Predicted output-length bucket index (see :func:`bucket_of`), or ``None``."""
    prefix: tuple[tuple[int, int], ...] | None = None
    """Prompt identity as content units ``(unit id, tokens)`` in prompt order, their tokens
    summing to ``prompt_tokens``; two prompts share text exactly as far as their unit id
    sequences agree (Mooncake ``hash_ids``: one unit per 512 tokens). ``None``: the prompt
    shares nothing with any other request (no prefix caching for it)."""
    response_id: int | None = None
    """Content id of this request's response, when a later request's ``prefix`` carries it as a
    unit (multi-turn sessions resend the answer). ``None``: a response nobody resends."""


def bucket_of(tokens: int, edges: tuple[int, ...] = PREDICTOR_BUCKET_EDGES) -> int:
    """Bucket index of a token count: the number of edges that are <= ``tokens``.

    With the default edges (250, 1000, 4000): 0-249 -> 0, 250-999 -> 1,
    1000-3999 -> 2, >= 4000 -> 3.
    """
    b = 0
    for e in edges:
        if tokens >= e:
            b += 1
        else:
            break
    return b


def bucket_upper_tokens(bucket: int, edges: tuple[int, ...] = PREDICTOR_BUCKET_EDGES) -> int:
    """Upper edge (tokens) of a bucket; the open last bucket uses twice its lower edge.

    Used by ``min_min`` (paper §A.2: completion time = prompt + upper edge of the
    predicted bucket) and by estimators that need one number per bucket.
    """
    if bucket < len(edges):
        return edges[bucket]
    return 2 * edges[-1]


def bucket_mid_tokens(bucket: int, edges: tuple[int, ...] = PREDICTOR_BUCKET_EDGES) -> float:
    """Representative length of a bucket (tokens): the midpoint of its edges.

    The first bucket spans [0, edges[0]); the open last bucket uses 1.5x its lower edge.
    """
    lo = 0 if bucket == 0 else edges[bucket - 1]
    if bucket < len(edges):
        return (lo + edges[bucket]) / 2.0
    return 1.5 * lo
