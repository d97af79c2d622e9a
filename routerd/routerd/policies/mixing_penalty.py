"""``mixing_penalty``: the paper's workload-mixing estimator used greedily, plus a calibrated variant.

Source: arXiv 2408.13510 §4.2 and §5.2. The paper uses ``r_mixing`` only to shape
the RL reward; here it routes directly: the new request goes to the instance with
the best score (lowest index on ties). Never holds. Residents are described by
their predicted lengths only.

``variant="paper"``: ``argmax_m r_mixing`` from :func:`routerd.estimator.r_mixing`
with residents ``(prompt_tokens, predicted_output_tokens)``, the new request's
``(prompt_tokens, predicted_output_tokens)`` and the given ``alpha``/``epsilon``.

``variant="calibrated"``: ``argmin_m cost_m`` where ``cost_m`` (s) is the latency the
new request ``i`` would add to instance ``m``: its own expected E2E latency plus the
delay it inflicts on the residents, from the profile's latency model. Notation:
``p = p_i`` its prompt, ``n = max(1, d_i) - 1`` its decode iterations (the prefill
emits the first token), ``t_pf(x) = prefill_per_token_s*x + prefill_attn_s*x**2``
(the marginal cost of ``x`` prefill tokens in an iteration); for each resident
``j``: ``c_j = prompt_j + generated_j``, ``r_j = max(1, predicted_j - generated_j)``
its predicted remaining decode tokens, ``o_j = min(n, r_j)`` the iterations it
shares with ``i``::

    queue_s   = sum_{j waiting} t_pf(c_j) + kv_wait_s            # prefills ahead of it, KV wait
    prefill_s = overhead_s + t_pf(p)                              # its own prefill iteration
    stall_s   = n_running * t_pf(p)                               # its prefill stalls each running decode
    decode_s  = n * (overhead_s + decode_per_seq_s)               # its own decode iterations...
                + decode_per_seq_s * sum_j o_j                    # ...batched with the residents
                + decode_per_ctx_token_s * (n*p + n*(n-1)/2 + sum_j (o_j*c_j + o_j*(o_j-1)/2))
    slow_s    = sum_j o_j * (decode_per_seq_s + decode_per_ctx_token_s * (p + (o_j-1)/2))
                                                                  # it lengthens each shared iteration
    cost_m    = 2 * (alpha * (queue_s + prefill_s + stall_s) + (1 - alpha) * (decode_s + slow_s))

``alpha`` weighs the prompt side against the decode side as in the paper
(0.5 = the plain sum). ``kv_wait_s`` is 0 when the instance's KV cache can hold the
request's predicted footprint next to the residents' predicted footprints (counted
as in :func:`~routerd.policies.kv_headroom.committed_kv_blocks`); otherwise it is the
time until enough running residents finish, each freeing its predicted footprint
after ``r_j`` iterations of ``decode_time(num_running, sum of running c_j)``
(all of them, if even that is not enough). ``epsilon`` is used only by the paper
variant.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from routerd.estimator import MixingParams, r_mixing
from routerd.policies.base import (
    ClusterView,
    InstanceView,
    PolicyContext,
    PolicyParams,
    RequestFeatures,
    RoutingPolicy,
)
from routerd.policies.kv_headroom import blocks_for, predicted_footprint_tokens


class Params(PolicyParams):
    """Parameters of ``mixing_penalty``."""

    alpha: float = Field(default=0.5, ge=0.0, le=1.0)
    """Weight of the prompt-side term against the decode-side term (paper: 0.5)."""
    epsilon: float = Field(default=0.1, ge=0.0)
    """Paper variant only: prefill-impact threshold (s) under which no prompt penalty applies."""
    variant: Literal["paper", "calibrated"] = "paper"
    """``paper``: the published estimator; ``calibrated``: added latency (s) from the profile."""


class MixingPenalty(RoutingPolicy):
    """Greedy workload-mixing placement: best ``r_mixing`` or least added latency; never holds."""

    name = "mixing_penalty"
    Params = Params
    params: Params

    def __init__(self, ctx: PolicyContext, params: PolicyParams | None = None) -> None:
        super().__init__(ctx, params)
        self._mixing = MixingParams(alpha=self.params.alpha, epsilon=self.params.epsilon)

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        best = None
        best_score = 0.0
        paper = self.params.variant == "paper"
        for inst in view.instances:
            if paper:
                resident = [(r.prompt_tokens, r.predicted_output_tokens) for r in inst.residents()]
                score = r_mixing(
                    self.ctx.profile, resident, request.prompt_tokens, request.predicted_output_tokens, self._mixing
                )
            else:
                score = -self.added_latency_s(request, inst)
            if best is None or score > best_score:
                best, best_score = inst.index, score
        return best

    def added_latency_s(self, request: RequestFeatures, inst: InstanceView) -> float:
        """``cost_m`` of the calibrated variant (s); see the module docstring."""
        prof = self.ctx.profile
        a_pf, a_attn = prof.prefill_per_token_s, prof.prefill_attn_s
        per_seq, per_ctx = prof.decode_per_seq_s, prof.decode_per_ctx_token_s
        max_len = prof.max_model_len
        bs = inst.block_size
        p = request.prompt_tokens
        n = max(1.0, request.predicted_output_tokens) - 1.0
        t_pf_new = a_pf * p + a_attn * p * p

        queue_s = 0.0
        n_running = 0
        run_ctx = 0
        shared_iters = 0.0
        shared_ctx = 0.0
        slow_s = 0.0
        committed = 0
        releases: list[tuple[float, int]] = []  # running: (predicted remaining decode, footprint blocks)
        for r in inst.residents():
            c = r.prompt_tokens + r.generated_tokens
            # Inlined predicted_footprint_tokens/blocks_for: this loop runs per instance per decision.
            end = r.prompt_tokens + r.predicted_output_tokens
            if end > max_len:
                end = max_len
            if end < c:
                end = c
            blocks = -int(-end // bs)
            committed += blocks
            rem = r.predicted_output_tokens - r.generated_tokens
            if rem < 1.0:
                rem = 1.0
            if r.waiting:
                queue_s += a_pf * c + a_attn * c * c
            else:
                n_running += 1
                run_ctx += c
                releases.append((rem, blocks))
            o = n if n < rem else rem
            shared_iters += o
            shared_ctx += o * c + o * (o - 1.0) / 2.0
            slow_s += o * (per_seq + per_ctx * (p + (o - 1.0) / 2.0))

        need = blocks_for(predicted_footprint_tokens(p, request.predicted_output_tokens, max_len), bs)
        deficit = min(need, inst.kv_total_blocks) - (inst.kv_total_blocks - max(committed, inst.kv_used_blocks))
        if deficit > 0 and releases:
            queue_s += self._kv_wait_s(deficit, releases, prof.decode_time(n_running, run_ctx))
        prefill_s = prof.overhead_s + t_pf_new
        stall_s = n_running * t_pf_new
        decode_s = (
            n * (prof.overhead_s + per_seq)
            + per_seq * shared_iters
            + per_ctx * (n * p + n * (n - 1.0) / 2.0 + shared_ctx)
        )
        alpha = self.params.alpha
        return 2.0 * (alpha * (queue_s + prefill_s + stall_s) + (1.0 - alpha) * (decode_s + slow_s))

    @staticmethod
    def _kv_wait_s(deficit: int, releases: list[tuple[float, int]], iter_s: float) -> float:
        # Only a KV-short instance pays for the sort, so the common case stays O(residents).
        releases.sort()
        freed = 0
        for rem, blocks in releases:
            freed += blocks
            if freed >= deficit:
                return rem * iter_s
        return releases[-1][0] * iter_s
