"""``oracle`` (ORACLE): least remaining true work, in seconds of the profile's latency model.

Not a published router: an upper-bound reference that knows every true output
length (the simulator hands it ``Oracle*`` objects). For each instance it
estimates how long the instance would need to finish everything it holds *plus*
the new request if nothing else arrived, and picks the smallest (lowest index on
ties); it never holds.

For every request ``x`` (the residents and the new one), with true output ``o_x``
and ``g_x`` tokens generated so far:

* ``f_x`` remaining prefill tokens: ``prompt + g_x`` if it still needs a prefill
  (in_prefill or waiting; preempted requests recompute), else 0; the new request
  has ``f = prompt``;
* ``c_x`` context at the start of its remaining decode: ``prompt + g_x``;
* ``n_x`` decode iterations left: ``max(0, o_x - g_x)``, less one when it still
  needs a prefill (the prefill emits a token).

Then, with the profile's terms (see :mod:`routerd.profiles`)::

    prefill_s = sum_x (prefill_per_token_s * f_x + prefill_attn_s * f_x**2)
                + overhead_s * ceil(sum_x f_x / max_num_batched_tokens)
    decode_s  = overhead_s * max_x n_x
                + decode_per_seq_s * sum_x n_x
                + decode_per_ctx_token_s * sum_x (n_x * c_x + n_x * (n_x - 1) / 2)
    work_s    = prefill_s + decode_s

i.e. prefills run back to back, then all decodes run as one batch that shrinks as
requests finish. Ignored: prefill/decode overlap under chunked prefill,
``max_num_seqs`` and the KV limit (no preemption).
"""

from __future__ import annotations

from routerd.policies.base import ClusterView, PolicyParams, RequestFeatures, RoutingPolicy


class Params(PolicyParams):
    """The oracle has no parameters."""


class Oracle(RoutingPolicy):
    """Least true drain time (s) including the new request; oracle."""

    name = "oracle"
    Params = Params
    oracle = True

    def pick(self, request: RequestFeatures, view: ClusterView) -> int | None:
        prof = self.ctx.profile
        try:
            new_out = request.output_tokens  # type: ignore[attr-defined]
        except AttributeError:
            raise TypeError("oracle is an oracle policy: it needs OracleRequestFeatures") from None
        p_i = request.prompt_tokens
        n_i = max(0, new_out - 1)
        best = None
        best_s = 0.0
        for inst in view.instances:
            f_sum = p_i
            f_cost = prof.prefill_per_token_s * p_i + prof.prefill_attn_s * p_i * p_i
            n_max = n_i
            n_sum = n_i
            ctx_sum = n_i * p_i + n_i * (n_i - 1) / 2
            for r in inst.residents():
                try:
                    n = r.output_tokens - r.generated_tokens  # type: ignore[attr-defined]
                except AttributeError:
                    raise TypeError("oracle is an oracle policy: it needs OracleResident residents") from None
                c = r.prompt_tokens + r.generated_tokens
                if r.in_prefill or r.waiting:
                    f_sum += c
                    f_cost += prof.prefill_per_token_s * c + prof.prefill_attn_s * c * c
                    n -= 1
                if n > 0:
                    n_sum += n
                    ctx_sum += n * c + n * (n - 1) / 2
                    if n > n_max:
                        n_max = n
            prefill_iters = -(-f_sum // prof.max_num_batched_tokens)
            work_s = (
                f_cost
                + prof.overhead_s * (prefill_iters + n_max)
                + prof.decode_per_seq_s * n_sum
                + prof.decode_per_ctx_token_s * ctx_sum
            )
            if best is None or work_s < best_s:
                best, best_s = inst.index, work_s
        return best
