"""Workload-mixing impact estimator (arXiv 2408.13510 §4.2 and §5.2).

The paper's Eq. 1-2 are images lost from its text; this implements the published
explanation quoted in issue #2 *as written*:

* request classes LL/LH/HL/HH: heavy prompt when its prefill takes >= ``heavy_prefill_s``
  (0.5 s), heavy decode when its decode takes >= ``heavy_decode_s`` (5 s); both from the
  hardware profile (:meth:`HardwareProfile.heavy_prefill` / ``heavy_decode``);
* for instance ``m`` with resident requests ``j`` (prompt ``p_j``, decode ``d_j``) and an
  incoming request ``i``::

      T_p = grad1 * (p_i**2 + sum_j (p_j + d_j))
      r_p = 1                    if T_p <= epsilon
            1 / T_p - epsilon    otherwise
      r_d = -grad2 * sum_j (p_j + d_j + p_i + d_i)
      r_mixing = alpha * r_p + (1 - alpha) * r_d            (alpha = 0.5 in the paper)
      h = r_mixing(chosen) - max_m r_mixing(m)               (<= 0; 0 for the best instance)

Dimensional oddities, kept on purpose because this is the published form: ``p_i**2``
times ``grad1`` (s/token) has units s*token; ``1/T_p - epsilon`` subtracts a time
(epsilon, s) from a rate (1/s); ``r_p`` jumps from 1 to ``1/epsilon - epsilon`` at
``T_p = epsilon``; and ``r_d`` sums the incoming request's tokens once per resident
request (``n * (p_i + d_i)``), which is what makes it grow with the instance's count.
``d_j`` is the *predicted* output length of a resident request (the router never knows
the true one) and ``d_i`` the incoming request's prediction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from routerd.profiles import HardwareProfile


@dataclass(frozen=True, slots=True)
class MixingParams:
    """Parameters of the published estimator."""

    alpha: float = 0.5
    """Weight of the prompt-side term (paper: 0.5 in all experiments)."""
    epsilon: float = 0.1
    """Prefill-impact threshold in seconds under which no penalty applies (paper: not given)."""


def request_class(profile: HardwareProfile, prompt_tokens: int, output_tokens: float) -> str:
    """Paper §4.2 class of a request: ``LL``, ``LH``, ``HL`` or ``HH`` (prompt letter first)."""
    p = "H" if profile.heavy_prefill(prompt_tokens) else "L"
    d = "H" if profile.heavy_decode(output_tokens) else "L"
    return p + d


def r_mixing(
    profile: HardwareProfile,
    resident: Sequence[tuple[float, float]],
    prompt_tokens: float,
    output_tokens: float,
    params: MixingParams = MixingParams(),
) -> float:
    """Mixing reward of placing a request on one instance (higher is better).

    Args:
        profile: supplies ``grad1`` and ``grad2``.
        resident: ``(p_j, d_j)`` token pairs of the instance's resident requests.
        prompt_tokens: ``p_i`` of the incoming request (tokens).
        output_tokens: ``d_i``, its predicted output length (tokens).
        params: ``alpha`` and ``epsilon``.
    """
    load = 0.0
    for p_j, d_j in resident:
        load += p_j + d_j
    return r_mixing_from_load(profile, len(resident), load, prompt_tokens, output_tokens, params)


def r_mixing_from_load(
    profile: HardwareProfile,
    n: int,
    load: float,
    prompt_tokens: float,
    output_tokens: float,
    params: MixingParams = MixingParams(),
) -> float:
    """:func:`r_mixing` from aggregates: ``n`` residents whose ``p_j + d_j`` sum to ``load`` tokens."""
    t_p = profile.grad1 * (prompt_tokens * prompt_tokens + load)
    r_p = 1.0 if t_p <= params.epsilon else 1.0 / t_p - params.epsilon
    r_d = -profile.grad2 * (load + n * (prompt_tokens + output_tokens))
    return params.alpha * r_p + (1.0 - params.alpha) * r_d


def mixing_scores(
    profile: HardwareProfile,
    instances: Sequence[Sequence[tuple[float, float]]],
    prompt_tokens: float,
    output_tokens: float,
    params: MixingParams = MixingParams(),
) -> list[float]:
    """``r_mixing`` for every instance (list, one per instance)."""
    return [r_mixing(profile, res, prompt_tokens, output_tokens, params) for res in instances]


def heuristic_guidance(scores: Sequence[float], chosen: int) -> float:
    """``h = r_mixing(chosen) - max r_mixing`` (<= 0); used as RL reward shaping (paper §5.3)."""
    return scores[chosen] - max(scores)
