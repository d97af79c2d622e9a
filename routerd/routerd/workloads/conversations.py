"""A SYNTHETIC multi-turn conversation workload: growing history, shared system prompts, bursts.

Shape modelled on production chat traces of the Mooncake (Kimi) FAST'25 family
(``shared/data/PROVENANCE.md`` §1b; the bundled ``mooncake`` trace is the synthetic one of that
release, the conversation trace's statistics are listed there): long prompts that are mostly
earlier context, prefix identity per request, and timestamps quantized so that many requests
share one. Nothing here is fitted per request to a real trace; every default's source is given
at its field of :class:`ConversationParams`.

**Sessions.** A session (one user's chat) has ``T`` turns. Turn ``k``'s prompt is::

    [system prompt] + m_1 + a_1 + m_2 + a_2 + ... + a_{k-1} + m_k

with ``m_i`` the user's messages and ``a_i`` the model's answers, so turn ``k``'s prompt is turn
``k - 1``'s prompt + its answer + the new message, as a chat client resends it. Prompt identity is
given as content units (``Request.prefix``, the representation :mod:`routerd.prefix.chain` hashes
into vLLM-style 16-token blocks, the same one ``shared-prefix`` and the Mooncake loader use): one
unit ``(id, tokens)`` per system prompt, message and answer, so turn ``k``'s units *extend* turn
``k - 1``'s units by ``(a_{k-1}, m_k)``; ``Request.response_id`` is the id of the request's own
answer ``a_k`` (the simulator caches the generated tokens under it, so the next turn can hit them
where the answer was generated). A fraction of sessions starts with one of a few shared system
prompts (popularity Zipf, exponent 1); the others share nothing with other sessions.

A session ends after ``T`` turns or earlier, when the next prompt plus its answer would exceed
``max_context_tokens`` (a chat product refuses to continue a conversation longer than the model's
context; truncating old history instead would break the prefix chain). A first message that alone
would not fit is cut to fit.

**Time.** Session starts come in bursts: bursts are a Poisson process of ``burst_rate`` bursts/s,
each starts ``Geometric`` (mean ``sessions_per_burst``, at least 1) sessions, uniformly within
``burst_window_s``. Turn ``k + 1`` arrives ``think + read_s_per_token * answer_k`` seconds after
turn ``k`` (``think`` log-normal): the generator cannot know when the simulator finishes an answer,
so the answer's time is a nominal streaming time. To start in steady state (sessions already in
progress at time 0, as in a window cut from a trace), sessions start from ``-warmup_s`` and only
turns at time >= 0 are kept; a turn whose session began before 0 carries history that no request of
the workload sent. Every arrival time is finally floored to a multiple of ``quantum_s`` (the trace's
timestamp step), which makes the many-requests-per-timestamp bursts of the real trace. With the
defaults the native rate is about 3.5 req/s and the workload starts at time 0.

Changing the rate (``load_workload(..., rate=)``, the bench's ``--load``) rescales all times,
think times and the quantum included, so the arrival process keeps its shape (bursts, CV).

**Units** are tokens and seconds. **Ids**: system prompts ``0 .. system_prompts - 1``; messages
and answers get consecutive ids from ``system_prompts`` upward in the order sessions are
generated. **Randomness**: one ``numpy.random.default_rng(seed)`` drawn in a fixed order
(system prompt lengths, then burst by burst, session by session), so the same parameters, ``n``
and seed give the identical list, and the first ``n`` requests of a larger ``n`` are the same
requests.
"""

from __future__ import annotations

import heapq
import math

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from routerd.model import Request

from .errors import WorkloadError
from .spec import parse_generator_spec


class ConversationParams(BaseModel):
    """Shape of a conversation workload (tokens, seconds). Each default names its source."""

    # Bounds keep every draw finite and every session non-empty (an infinite or extreme value
    # would overflow a draw or never produce a request).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    # --- sessions -------------------------------------------------------------------------
    turns_scale: float = Field(0.9, gt=0, le=1000.0)
    """Session length: ``T = 1 + floor(turns_scale * E ** (1 / turns_shape))``, ``E`` standard
    exponential, i.e. ``P(T >= t) = exp(-((t - 1) / turns_scale) ** turns_shape)`` (a discrete
    stretched exponential, heavier-tailed than geometric for shape < 1). The *shape* 0.88 is a least
    squares fit of the survival function to the ``n_turns`` of the 9,459 ShareGPT conversations in
    ``shared/data/prompts/sharegpt_v3_first_turn.jsonl.gz`` (the fit's scale there is 2.8: mean 3.5
    turns, P(T >= 2) 0.66, p99 16; data mean 3.37, 0.67, p99 13; preset ``long-sessions``). The
    default *scale* 0.9 (mean 1.6 turns, P(T >= 2) 0.32, p99 ~7) is chosen so that an infinite cache
    reuses ~40% of the prompt tokens, the cache ratio the Mooncake FAST'25 paper reports for its
    conversation trace (ShareGPT's scale gives ~72%: ShareGPT holds conversations users chose to
    share, longer than the traffic's)."""
    turns_shape: float = Field(0.88, ge=0.1, le=100.0)
    """Shape of the session-length law (see ``turns_scale``)."""
    max_turns: int = Field(64, ge=1)
    """Longest session (turns); ShareGPT's longest conversation in the file has 63."""

    # --- prompt content -------------------------------------------------------------------
    system_prompts: int = Field(8, ge=1, le=100_000)
    """Distinct shared system prompts; a session picks prompt ``k`` with probability proportional
    to ``1 / (k + 1)`` (Zipf, exponent 1). Assumption: the trace's ids are remapped and say nothing
    about which prefixes are system prompts; Mooncake's README example shows two requests sharing
    their first 12 ids (6,144 tokens) and then diverging."""
    system_share: float = Field(0.6, ge=0.0, le=1.0)
    """Fraction of sessions that start with a shared system prompt (the rest have none and share
    nothing with other sessions). Assumption; with ``turns_scale`` it sets the ~40% reuse."""
    system_prompt_tokens: int = Field(1500, ge=1)
    """Median system prompt length; each of the ``system_prompts`` draws its length once per seed,
    log-normal with ``system_prompt_sigma``. Assumption (system prompts of deployed assistants run
    to a few thousand tokens)."""
    system_prompt_sigma: float = Field(0.5, ge=0.0, le=10.0)
    """Log-normal sigma of system prompt lengths."""
    first_message_tokens: int = Field(5500, ge=1)
    """Median first user message (tokens). Chosen, with ``first_message_sigma``, so that the
    prompts match the Mooncake conversation trace's input lengths (PROVENANCE §1b: mean 12,035,
    median 6,909, p99 85,400; 12,000 requests of the default: 12,264 / 7,132 / 90,899). The long
    first messages stand for pasted documents and files (the trace's service is a long-context
    assistant)."""
    first_message_sigma: float = Field(1.2, ge=0.0, le=10.0)
    """Log-normal sigma of the first message (the heavy tail of documents)."""
    message_tokens: int = Field(60, ge=1)
    """Median of later user messages (tokens). ShareGPT first user messages: median 31, mean 263,
    p99 2,893 (cl100k tokens; PROVENANCE §2a): short typed follow-ups with a heavy tail."""
    message_sigma: float = Field(1.6, ge=0.0, le=10.0)
    """Log-normal sigma of later messages (ShareGPT's median 31 vs mean 263 gives sigma ~2; a little
    less here, follow-ups rarely paste documents)."""
    answer_tokens: int = Field(320, ge=1)
    """Median answer length (the request's ``output_tokens``). With ``answer_sigma`` 0.5: mean 361,
    p99 1,036 (12,000 requests), against the Mooncake conversation trace's mean 343, median 350, p99
    1,118.5 (a log-normal cannot have its mean below its median, as the capped trace does)."""
    answer_sigma: float = Field(0.5, ge=0.0, le=10.0)
    """Log-normal sigma of answer lengths."""
    max_answer_tokens: int = Field(2000, ge=1)
    """Longest answer; the Mooncake conversation trace's longest output is 2,000 tokens."""
    max_context_tokens: int = Field(131072, ge=2)
    """Cap on prompt + answer (tokens): Llama 3.1's 128K context, the shipped Llama-3.1-8B
    profiles' ``max_model_len``, so no prompt is rejected there (the trace's longest input is
    126,195). Lower it to fit a smaller ``max_model_len``."""

    # --- time -----------------------------------------------------------------------------
    burst_rate: float = Field(0.55, gt=0, le=1e6)
    """Bursts of session starts per second. With ``sessions_per_burst`` 4 and 1.6 turns per
    session the native rate is 3.46 req/s (12,000 requests), the conversation trace's 3.40."""
    sessions_per_burst: float = Field(4.0, ge=1.0, le=1e4)
    """Mean sessions started by one burst (geometric, >= 1). Assumption: a compound Poisson
    process is the simplest over-dispersed arrival process; real traces are burstier than Poisson
    (the conversation trace's inter-arrival CV is 3.03, PROVENANCE §1b; the default's is 3.07 after
    quantization)."""
    burst_window_s: float = Field(2.0, ge=0.0, le=1e6)
    """The sessions of one burst start uniformly within this many seconds."""
    think_median_s: float = Field(30.0, ge=0.0, le=1e6)
    """Median user think time between an answer and the next message (s), log-normal. Assumption:
    no public trace here records per-session timing (Mooncake's ids carry no session id)."""
    think_sigma: float = Field(1.0, ge=0.0, le=10.0)
    """Log-normal sigma of think times (a long tail: users come back minutes later)."""
    read_s_per_token: float = Field(0.02, ge=0.0, le=100.0)
    """Nominal time per answer token added to the gap before the next turn (s/token): 50 tokens/s
    streaming, the order of the shipped Llama-3.1-8B profiles' decode step."""
    quantum_s: float = Field(3.0, ge=0.0, le=1e6)
    """Arrival times are floored to multiples of this (s; 0 = not quantized). The Mooncake
    conversation trace's timestamps are quantized to ~3 s steps: 1,180 distinct values for 12,031
    requests, 90% of requests share a timestamp with the previous one (PROVENANCE §1b; the default:
    1,154 distinct values for 12,000 requests, 90.4%)."""
    warmup_s: float = Field(1800.0, ge=0.0, le=1e6)
    """Sessions start from ``-warmup_s`` so that time 0 is in steady state (s)."""

    def max_prompt_tokens(self) -> int:
        """Longest prompt the shape can produce (tokens): ``max_context_tokens - 1``."""
        return self.max_context_tokens - 1


#: Named shapes and the request count each uses when none is given.
#:
#: - ``default``: the Kimi-like shape documented field by field on :class:`ConversationParams`
#:   (long prompts, up to 128K context).
#: - ``long-sessions``: ShareGPT's session lengths (``turns_scale`` 2.8, mean 3.5 turns): longer
#:   histories, ~72% of prompt tokens reusable; ``burst_rate`` 0.25 keeps ~3.5 req/s.
#: - ``chat-8k``: the same sessions with short first messages (median 300 tokens) and an
#:   8,192-token context, for profiles with a short ``max_model_len``.
CONVERSATION_PRESETS: dict[str, tuple[ConversationParams, int]] = {
    "default": (ConversationParams(), 2000),
    "long-sessions": (ConversationParams(turns_scale=2.8, burst_rate=0.25), 2000),
    "chat-8k": (ConversationParams(first_message_tokens=300, max_context_tokens=8192), 2000),
}
DEFAULT_PRESET = "default"


def parse_conversations_spec(spec: str) -> tuple[str, ConversationParams, int]:
    """Parse ``PRESET``, ``PRESET,field=value,...`` or ``field=value,...`` (empty = ``default``).

    Returns:
        ``(preset name, parameters, the preset's default request count)``.

    Raises:
        WorkloadError: unknown preset, a field that does not exist, a malformed item or an
            invalid value (one line, naming the item).
    """
    return parse_generator_spec("conversations", spec, CONVERSATION_PRESETS, DEFAULT_PRESET, ConversationParams)


def _lognormal_int(rng: np.random.Generator, median: int, sigma: float, cap: int | None = None) -> int:
    v = max(1, int(round(median * math.exp(sigma * rng.standard_normal()))))
    return v if cap is None else min(v, cap)


def conversations(params: ConversationParams, n: int, seed: int) -> list[Request]:
    """``n`` requests of the conversation workload ``params`` at its native timing (module docstring).

    Args:
        params: the shape.
        n: number of requests (>= 1).
        seed: seed of the generator.

    Returns:
        Requests with ``id`` 0..n-1 in arrival order, ``arrival_s`` in seconds (multiples of
        ``quantum_s``, the first turn at or after time 0), ``prompt_tokens`` = the sum of
        ``prefix``'s tokens, ``output_tokens`` = the answer's length, ``prefix`` the content units,
        ``response_id`` the answer's unit id; ``task`` and ``prompt`` are ``None``.

    Raises:
        WorkloadError: ``n`` < 1 or ``params`` not a :class:`ConversationParams`.
    """
    if not isinstance(params, ConversationParams):
        raise WorkloadError(f"params must be ConversationParams, got {type(params).__name__}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise WorkloadError(f"n must be a positive integer, got {n!r}")
    n = int(n)
    p = params
    rng = np.random.default_rng(seed)
    k_sys = p.system_prompts
    sys_len = [_lognormal_int(rng, p.system_prompt_tokens, p.system_prompt_sigma,
                              p.max_context_tokens // 2) for _ in range(k_sys)]
    zipf = np.cumsum(1.0 / np.arange(1, k_sys + 1))
    zipf /= zipf[-1]
    next_id = k_sys
    # Turns at time >= 0 not yet final: (raw time, sequence number, units, answer tokens, answer id).
    pending: list[tuple[float, int, tuple[tuple[int, int], ...], int, int]] = []
    final: list[tuple[float, int, tuple[tuple[int, int], ...], int, int]] = []
    seq = 0
    t_burst = -p.warmup_s
    p_geo = 1.0 / p.sessions_per_burst
    while True:
        t_burst += rng.standard_exponential() / p.burst_rate
        # Every later session starts at or after t_burst, so turns before it are final.
        while pending and pending[0][0] < t_burst:
            final.append(heapq.heappop(pending))
        if len(final) >= n:
            break
        for _ in range(int(rng.geometric(p_geo))):
            t = t_burst + p.burst_window_s * rng.random()
            e = rng.standard_exponential()
            turns = min(p.max_turns, 1 + int(math.floor(p.turns_scale * e ** (1.0 / p.turns_shape))))
            units: list[tuple[int, int]] = []
            if rng.random() < p.system_share:
                k = int(np.searchsorted(zipf, rng.random(), side="right"))
                units.append((min(k, k_sys - 1), sys_len[min(k, k_sys - 1)]))
            used = sum(u for _, u in units)
            for turn in range(turns):
                if turn == 0:
                    msg = _lognormal_int(rng, p.first_message_tokens, p.first_message_sigma)
                else:
                    msg = _lognormal_int(rng, p.message_tokens, p.message_sigma)
                ans = _lognormal_int(rng, p.answer_tokens, p.answer_sigma, p.max_answer_tokens)
                think = p.think_median_s * math.exp(p.think_sigma * rng.standard_normal())
                if turn == 0:
                    # A session always starts: its first turn is cut to fit the context (the
                    # system prompt dropped when it leaves no room for a message and an answer).
                    if p.max_context_tokens - used < 2:
                        units.clear()
                        used = 0
                    budget = p.max_context_tokens - used
                    ans = min(ans, budget - 1)
                    msg = min(msg, budget - ans)
                room = p.max_context_tokens - used - ans
                if msg > room or ans < 1:
                    break  # the conversation no longer fits the context: the session ends
                units.append((next_id, msg))
                if t >= 0.0:
                    heapq.heappush(pending, (t, seq, tuple(units), ans, next_id + 1))
                    seq += 1
                units.append((next_id + 1, ans))
                next_id += 2
                used += msg + ans
                t += think + p.read_s_per_token * ans
    final.sort()
    q = p.quantum_s
    out: list[Request] = []
    for i, (t, _, units, ans, aid) in enumerate(final[:n]):
        arrival = math.floor(t / q) * q if q > 0 else t
        out.append(Request(id=i, arrival_s=float(arrival), prompt_tokens=sum(u for _, u in units),
                           output_tokens=ans, prefix=units, response_id=aid))
    return out


def describe(preset: str, params: ConversationParams) -> str:
    """One line saying what the workload is (for ``Workload.description``)."""
    p = params
    return (
        f"SYNTHETIC multi-turn conversations, preset {preset!r} (shape of the Mooncake/Kimi conversation "
        f"trace): sessions of 1-{p.max_turns} turns (mean ~{_mean_turns(p):.1f}) resending their history, "
        f"{p.system_share:.0%} with one of {p.system_prompts} shared system prompts, first messages median "
        f"{p.first_message_tokens} tokens, answers median {p.answer_tokens}, context <= {p.max_context_tokens}; "
        f"bursts of ~{p.sessions_per_burst:g} session starts at {p.burst_rate:g}/s, think time median "
        f"{p.think_median_s:g} s, timestamps quantized to {p.quantum_s:g} s"
    )


def _mean_turns(p: ConversationParams) -> float:
    # E[T] = sum_{t>=1} P(T >= t), truncated at max_turns.
    return sum(math.exp(-(((t - 1) / p.turns_scale) ** p.turns_shape)) for t in range(1, p.max_turns + 1))
