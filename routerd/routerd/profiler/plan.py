"""What the profiler sends: decode-heavy and prefill-heavy batches, sized to the endpoint.

The latency model being fitted is the one of :mod:`routerd.profiles`: an iteration
with ``P`` prefill tokens (chunks ``c`` over ``kv`` cached tokens) and ``B`` decodes
over ``S`` context tokens takes
``overhead + k_pf * P + k_attn * sum c * (kv + c) + k_seq * B + k_ctx * S``.

* **Decode batches** ``(B, p)``: ``B`` concurrent requests with ``p``-token prompts and
  long outputs. Once every request decodes, the time between tokens is one
  iteration, ``overhead + k_seq * B + k_ctx * S``; ``B`` and ``p`` vary so that the
  per-sequence and per-context-token terms separate.
* **Prefill batches** ``(N, L)``: while a *probe* request decodes alone, ``N``
  requests of ``L`` prompt tokens and one output token arrive together. The probe's
  inter-token gaps are the engine's iteration times: the iterations that carry the
  prefill are longer by ``k_pf * N * L + k_attn * N * L**2`` (one chunk each; totals
  stay under ``max_batch_tokens``, the smallest token budget of vLLM's defaults, so
  nothing is split). The overhead cancels, so ``k_pf`` and ``k_attn`` come out free
  of HTTP and scheduling costs.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class MeasurementPlan(BaseModel):
    """Batches and window sizes of one profiling run (tokens are the server's tokens)."""

    model_config = ConfigDict(extra="forbid")

    decode_batch_sizes: list[int] = Field(default=[1, 8, 24, 48, 64], min_length=2)
    """Concurrent requests ``B`` of the decode batches."""
    decode_prompt_tokens: list[int] = Field(default=[32, 512], min_length=1)
    """Prompt lengths ``p`` of the decode batches (each ``B`` with each ``p``)."""
    decode_output_tokens: int = Field(default=96, ge=16)
    """Output tokens of each decode-batch request."""
    prefill_batches: list[tuple[int, int]] = Field(default_factory=lambda: _prefill_grid(2000, 4), min_length=2)
    """``(N, L)``: ``N`` concurrent requests of ``L`` prompt tokens (max_tokens=1) beside the probe."""
    max_batch_tokens: int = Field(default=2000, ge=64)
    """Cap on ``N * L`` so a prefill batch fits one iteration's token budget."""
    probe_prompt_tokens: int = Field(default=16, ge=1)
    quiet_tokens: int = Field(default=8, ge=3)
    """Probe tokens observed before and after each prefill batch (the local baseline)."""
    kv_fraction: float = Field(default=0.85, gt=0, le=1)
    """Decode batches are shrunk so ``B * (p + output)`` stays under this share of the KV cache."""

    def total_requests(self) -> int:
        """Requests the plan sends (without the calibration request and the probes)."""
        dec = sum(self.decode_batch_sizes) * len(self.decode_prompt_tokens)
        return dec + sum(n for n, _ in self.prefill_batches)


def _prefill_grid(cap: int, n_lengths: int) -> list[tuple[int, int]]:
    """(N, L) with L = cap, cap/2, cap/4, ... and N = 1, 2, 4, ... while N * L <= cap."""
    out = []
    L = cap
    for _ in range(n_lengths):
        n = 1
        while n * L <= cap:
            out.append((n, L))
            n *= 2
        L //= 2
    return out


def default_plan(max_batch_tokens: int = 2000) -> MeasurementPlan:
    """The full plan: 10 decode batches (B 1-64, p 32 and 512), 10 prefill batches."""
    return MeasurementPlan(max_batch_tokens=max_batch_tokens,
                           prefill_batches=_prefill_grid(max_batch_tokens, 4))


def quick_plan(max_batch_tokens: int = 2000) -> MeasurementPlan:
    """A shorter plan (about a third of the time): 6 decode batches, 6 prefill batches."""
    c = max_batch_tokens
    return MeasurementPlan(decode_batch_sizes=[1, 32, 64], decode_prompt_tokens=[32, 384], decode_output_tokens=64,
                           max_batch_tokens=c, quiet_tokens=6,
                           prefill_batches=[(1, c), (2, c // 2), (8, c // 8), (1, c // 2), (4, c // 8), (1, c // 4)])
