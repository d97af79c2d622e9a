"""A parametric shared-prefix workload in the shape of llm-d's capacity benchmark.

The benchmark (``llm-d/llm-d-kv-cache:benchmarking/73-capacity/README.md``, run with
kubernetes-sigs/inference-perf's ``shared_prefix`` data generator,
``inference_perf/datagen/shared_prefix_datagen.py``; facts in
``shared/docs/prefix-routing.md`` §3) has ``G`` groups of ``U`` users. Every group has its
own ``S``-token system prompt; every user a ``Q``-token question; answers are ``O`` tokens
(``ignore_eos``). Requests arrive as a Poisson process; request ``i`` belongs to user
``order[i mod G U]`` (one shuffled order of all users, kept for the whole run), so every
user speaks once per *round* of ``G U`` requests, in the same order each round. The
benchmark's own shape is 150 x 5, ``S = 6,000``, ``Q = 1,200``, ``O = 1,000``, single turn
(``enable_multi_turn_chat: false``): each round resends every user's same prompt
(system prompt + that user's question), so after the first round a cache that held
everything would hit ``S + Q - 1`` of each ``S + Q`` tokens.

Two modes (:attr:`SharedPrefixParams.multi_turn`):

- **repeat** (the benchmark's): user ``(g, u)``'s prompt is always
  ``[(sys_g, S), (q_gu, Q_gu)]``; answers are never resent (``response_id = None``).
- **multi-turn**: sessions carry their history. Turn ``t`` of a session prompts with
  ``[(sys_g, S), (q_1, Q_1), (a_1, O_1), ..., (q_t, Q_t)]`` and its ``response_id`` is
  ``a_t``'s id, so turn ``t + 1``'s prefix is turn ``t``'s prefix + ``(a_t, O_t)`` + a new
  question. After ``turns_per_session`` turns the user starts a new session (same group
  system prompt, empty history), so prompts stay bounded by
  :meth:`SharedPrefixParams.max_prompt_tokens`.

Timing (why Poisson turns, not think times): the simulator decides when an answer is done,
so a generator cannot make the next turn wait for it without coupling the workload to the
simulation. Arrivals are therefore a Poisson process of *turns* at ``rate`` req/s with each
user's turn order preserved (the benchmark's own scheme), and arrival times are
``cumsum(standard exponentials) / rate``: changing the rate only rescales time, the
requests, their order and their content stay the same (the bench sets loads relative to
capacity by rescaling). The gap between a user's consecutive turns is the sum of ``G U``
exponential gaps (Gamma, mean ``G U / rate`` s; 12.8 s for the default preset at 20 req/s):
choose ``G U`` so that this exceeds the expected end-to-end latency, or the next turn may
arrive before its history's answer has been generated (in the simulator that is a cache
miss on the answer, nothing worse).

Unit ids: ``sys_g = g`` (``0 .. G-1``), then questions and answers get consecutive ids
from ``G`` upward in the order they are created (repeat mode: ``q_gu = G + g U + u``);
every id is unique per content, ``>= 0`` and a function of the parameters, ``n`` and the
seed only.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from routerd.model import Request

from .errors import WorkloadError
from .spec import parse_generator_spec


class SharedPrefixParams(BaseModel):
    """Shape of a shared-prefix workload (all token counts in tokens)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    groups: int = Field(32, ge=1)
    """G: number of groups (applications); each has its own system prompt, shared by its users only."""
    users_per_group: int = Field(8, ge=1)
    """U: users per group (inference-perf's ``num_prompts_per_group``)."""
    system_prompt_tokens: int = Field(2000, ge=0)
    """S: tokens of each group's system prompt (0: no system prompt, groups share nothing)."""
    question_tokens: int = Field(200, ge=1)
    """Q: mean tokens of a question (exactly Q when ``jitter`` is 0)."""
    output_tokens: int = Field(200, ge=1)
    """O: mean tokens of an answer (the request's ``output_tokens``; exactly O when ``jitter`` is 0)."""
    multi_turn: bool = True
    """True: sessions carry their history (new question each turn); False: the benchmark's repeat
    mode, each user resends the same system prompt + question every round."""
    turns_per_session: int = Field(5, ge=1)
    """Multi-turn only: turns of a session before the user starts a new one (bounds prompt length)."""
    jitter: float = Field(0.0, ge=0.0, lt=1.0)
    """Relative half-width of question and answer lengths: each is round(L * Uniform(1 - j, 1 + j)),
    at least 1 token (inference-perf also varies only questions and outputs; system prompts stay S)."""
    shuffle_users: bool = True
    """Shuffle the order in which users speak within a round once per seed (inference-perf shuffles
    its prompts once); False: user 0 of group 0, user 1 of group 0, ..."""

    @property
    def num_users(self) -> int:
        """G x U."""
        return self.groups * self.users_per_group

    def _upper(self, mean: int) -> int:
        return max(1, round(mean * (1.0 + self.jitter)))

    def max_prompt_tokens(self) -> int:
        """Longest prompt this shape can produce (tokens), for checking against ``max_model_len``.

        Repeat mode ``S + Q``; multi-turn ``S + T Q + (T - 1) O`` with ``T = turns_per_session``
        (upper ends of the jittered lengths).
        """
        q, o = self._upper(self.question_tokens), self._upper(self.output_tokens)
        if not self.multi_turn:
            return self.system_prompt_tokens + q
        t = self.turns_per_session
        return self.system_prompt_tokens + t * q + (t - 1) * o


#: Named shapes and the request count each uses when none is given.
#:
#: - ``default``: multi-turn, 32 groups x 8 users, 2,000-token system prompts, 200-token
#:   questions and answers, sessions of 5 turns; prompts <= 3,800 tokens, so prompt + output
#:   fits even a 4,096-token ``max_model_len``; 2,000 requests (about 8 turns per user).
#: - ``llmd-capacity``: the benchmark's own shape (150 x 5, S 6,000, Q 1,200, O 1,000, repeat
#:   mode = single turn, ``enable_multi_turn_chat: false``); 3,000 requests = 4 rounds of the
#:   750 prompts (the benchmark's ladder sends 17,084 requests, about 22.8 rounds; pass ``n``
#:   for more). Prompts are 7,200 tokens + 1,000 output: it needs ``max_model_len`` > 8,200.
SHARED_PREFIX_PRESETS: dict[str, tuple[SharedPrefixParams, int]] = {
    "default": (SharedPrefixParams(), 2000),
    "llmd-capacity": (
        SharedPrefixParams(
            groups=150, users_per_group=5, system_prompt_tokens=6000, question_tokens=1200,
            output_tokens=1000, multi_turn=False,
        ),
        3000,
    ),
}
DEFAULT_PRESET = "default"


def parse_shared_prefix_spec(spec: str) -> tuple[str, SharedPrefixParams, int]:
    """Parse ``PRESET``, ``PRESET,field=value,...`` or ``field=value,...`` (empty = default preset).

    Values are validated by :class:`SharedPrefixParams` (``groups=8``, ``jitter=0.1``,
    ``multi_turn=false``).

    Returns:
        ``(preset name, parameters, the preset's default request count)``.

    Raises:
        WorkloadError: unknown preset, a field that does not exist, a malformed item or an
            invalid value (one line, naming the item).
    """
    return parse_generator_spec("shared-prefix", spec, SHARED_PREFIX_PRESETS, DEFAULT_PRESET, SharedPrefixParams)


def _lengths(mean: int, jitter: float, size: int, rng: np.random.Generator) -> np.ndarray:
    if jitter == 0.0:
        return np.full(size, mean, dtype=np.int64)
    return np.maximum(1, np.rint(mean * rng.uniform(1.0 - jitter, 1.0 + jitter, size))).astype(np.int64)


def shared_prefix(params: SharedPrefixParams, n: int, rate: float, seed: int) -> list[Request]:
    """``n`` requests of the shared-prefix workload ``params`` at ``rate`` req/s (module docstring).

    Randomness: one ``numpy.random.default_rng(seed)``; draws in order: ``n`` standard
    exponential gaps, the user order (one permutation of ``G U``, when ``shuffle_users``),
    then question lengths and answer lengths (uniform draws only when ``jitter > 0``: per
    request in multi-turn mode, per user in repeat mode). Same arguments -> identical list;
    ``rate`` only scales ``arrival_s`` (``arrival_s = cumsum(gaps) / rate``).

    Args:
        params: the shape.
        n: number of requests (>= 1).
        rate: mean arrival rate, requests per second (> 0).
        seed: seed of the generator.

    Returns:
        Requests with ``id`` 0..n-1 in arrival order, ``arrival_s`` in seconds (the first one
        gap after 0), ``prompt_tokens`` = the sum of ``prefix``'s tokens, ``output_tokens`` = the
        answer's length, ``prefix`` the content units and (multi-turn) ``response_id`` the
        answer's unit id; ``task`` and ``prompt`` are ``None``.

    Raises:
        WorkloadError: ``n`` < 1, ``rate`` not a finite number > 0, or ``params`` not a
            :class:`SharedPrefixParams`.
    """
    if not isinstance(params, SharedPrefixParams):
        raise WorkloadError(f"params must be SharedPrefixParams, got {type(params).__name__}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise WorkloadError(f"n must be a positive integer, got {n!r}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise WorkloadError(f"rate must be a finite number of requests/s > 0, got {rate!r}")
    n = int(n)
    p = params
    users = p.num_users
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.standard_exponential(n)) / float(rate)
    order = rng.permutation(users) if p.shuffle_users else np.arange(users)
    size = n if p.multi_turn else users
    qlen = _lengths(p.question_tokens, p.jitter, size, rng)
    olen = _lengths(p.output_tokens, p.jitter, size, rng)
    s = p.system_prompt_tokens
    U = p.users_per_group

    out: list[Request] = []
    if not p.multi_turn:
        for i in range(n):
            user = int(order[i % users])
            units = ((user // U, s),) if s else ()
            units += ((p.groups + user, int(qlen[user])),)
            out.append(Request(
                id=i, arrival_s=float(arrivals[i]), prompt_tokens=s + int(qlen[user]),
                output_tokens=int(olen[user]), prefix=units,
            ))
        return out

    next_id = p.groups
    history: list[list[tuple[int, int]]] = [[] for _ in range(users)]
    turn = [0] * users
    for i in range(n):
        user = int(order[i % users])
        if turn[user] == p.turns_per_session:
            history[user], turn[user] = [], 0
        q = (next_id, int(qlen[i]))
        a = (next_id + 1, int(olen[i]))
        next_id += 2
        units = ([(user // U, s)] if s else []) + history[user] + [q]
        history[user] += [q, a]
        turn[user] += 1
        out.append(Request(
            id=i, arrival_s=float(arrivals[i]), prompt_tokens=sum(t for _, t in units),
            output_tokens=a[1], prefix=tuple(units), response_id=a[0],
        ))
    return out


def describe(preset: str, params: SharedPrefixParams) -> str:
    """One line saying what the workload is (for ``Workload.description``)."""
    p = params
    mode = (
        f"multi-turn sessions of {p.turns_per_session} turns carrying their history"
        if p.multi_turn else "single turn, each user's prompt resent every round (the benchmark's repeat mode)"
    )
    jit = f", lengths jittered +-{p.jitter:.0%}" if p.jitter else ""
    return (
        f"SYNTHETIC shared-prefix workload, preset {preset!r} (shape of llm-d's 73-capacity benchmark): "
        f"{p.groups} groups x {p.users_per_group} users, {p.system_prompt_tokens}-token system prompts, "
        f"{p.question_tokens}-token questions, {p.output_tokens}-token answers{jit}, {mode}; "
        f"prompts <= {p.max_prompt_tokens()} tokens"
    )
