"""Domain model shared by the simulator, the policies and the workloads.

A :class:`Request` is one LLM inference request as the router receives it. Its
``output_tokens`` is the *true* response length: the simulator uses it to know when
the request finishes, and only the explicitly named ``oracle`` policies may read it
(policies see :class:`routerd.policies.base.RequestFeatures` instead).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# The bucket helpers live in a module without pydantic so that the predictor imports fast.
from routerd.buckets import PREDICTOR_BUCKET_EDGES, bucket_mid_tokens, bucket_of, bucket_upper_tokens  # noqa: F401


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


