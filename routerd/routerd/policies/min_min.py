"""``min_min``: earliest estimated completion, with bucket upper edges as job sizes.

Source: the paper's Min-Min baseline (arXiv 2408.13510 A.2, after Chen et al.
2013, "User-priority guided Min-Min scheduling"; +1.50% vs round robin). The size
of a request (tokens) is its prompt tokens plus the upper edge of its predicted
output bucket (:func:`routerd.model.bucket_upper_tokens` over ``ctx.bucket_edges``;
a request without a bucket uses ``predicted_output_tokens``). An instance's
estimated completion time for the new request is the sum of its residents' sizes
plus the new request's size; the instance with the smallest wins (lowest index on
ties). The router only ever places the queue head, so Min-Min's "shortest task
first" step reduces to this earliest-completion choice.

By default sizes are whole-request (the paper's wording); ``count_progress`` makes
them remaining sizes (prefilled prompts and generated tokens drop out).
"""

from __future__ import annotations

from routerd.model import bucket_upper_tokens
from routerd.policies.base import ClusterView, PolicyContext, PolicyParams, RequestFeatures, RoutingPolicy


class Params(PolicyParams):
    """Parameters of ``min_min``."""

    count_progress: bool = False
    """Subtract finished work from resident sizes: prefilled prompts and generated tokens."""


class MinMin(RoutingPolicy):
    """Least sum of (prompt + bucket upper edge) tokens, new request included; never holds."""

    name = "min_min"
    Params = Params
    params: Params

    def __init__(self, ctx: PolicyContext, params: PolicyParams | None = None) -> None:
        super().__init__(ctx, params)
        self._upper = tuple(bucket_upper_tokens(b, ctx.bucket_edges) for b in range(len(ctx.bucket_edges) + 1))

    def _decode_size(self, bucket: int | None, predicted: float) -> float:
        return predicted if bucket is None else self._upper[bucket]

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        progress = self.params.count_progress
        own = request.prompt_tokens + self._decode_size(request.predicted_bucket, request.predicted_output_tokens)
        best = None
        best_done = 0.0
        for inst in view.instances:
            total = own
            for r in inst.residents():
                dec = self._decode_size(r.predicted_bucket, r.predicted_output_tokens)
                if progress:
                    dec = max(0.0, dec - r.generated_tokens)
                    if r.in_prefill or r.waiting:
                        total += r.prompt_tokens + r.generated_tokens
                else:
                    total += r.prompt_tokens
                total += dec
            if best is None or total < best_done:
                best, best_done = inst.index, total
        return best
