"""routerd's own record of the requests it dispatched to one instance, with incremental aggregates.

A decision has a budget of 100 µs for every candidate instance together, so what the
policies read per instance is kept up to date at each event (dispatch, first token,
streamed tokens, finish or abort) instead of being recounted from the requests:

* :meth:`RequestBook.load_summary` (the DQN observation, ``summarize_residents``);
* :meth:`RequestBook.outstanding_tokens` (the JSQ metric);
* :meth:`RequestBook.waiting_kv_blocks` (``late_binding``'s admission test);
* :meth:`RequestBook.pending_prefill_tokens` and :meth:`RequestBook.pending_prefill_work`
  (``dynamo_kv``, ``lmetric``, ``phasewise``: the prompt tokens still to prefill).

Each equals what the scanning helper in :mod:`routerd.policies` computes from
:meth:`RequestBook.residents`, bit for bit (``tests/test_daemon_bookkeeping.py``).
"""

from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING, Any, Iterable

from routerd.policies.base import LoadSummary, ResidentRequest, load_bin, summarize_residents

if TYPE_CHECKING:
    from routerd.daemon.state import EndpointState

#: Predicted output lengths that are multiples of 1/_EXACT_SCALE token below _EXACT_LIMIT
#: tokens, plus integer token counts, add up without rounding in any order while the
#: total stays below 2**53 / _EXACT_SCALE (about 8.8e12 tokens), so running float sums of
#: them equal a recount exactly. The bucket midpoints are multiples of 0.5; a length
#: without such a form (a regression predictor's) makes the aggregates recount instead.
_EXACT_SCALE = 1024.0
_EXACT_LIMIT = 2.0**32


class Inflight:
    """One request routerd dispatched to an instance and has not seen finish.

    Token counts are in tokens; times are ``time.monotonic()`` seconds.
    """

    __slots__ = ("rid", "label", "prompt_tokens", "predicted_bucket", "predicted_output", "load_bin",
                 "exact", "generated", "first_token", "endpoint", "dispatched_at", "arrived_at", "group", "done",
                 "features", "exclude", "enqueued_at", "waiter", "error", "fallback", "blind", "model", "seq",
                 "policy", "cached_tokens", "uncached_blocks", "kv_batches", "pending")

    def __init__(self, rid: int, label: Any, prompt_tokens: int, predicted_bucket: int | None,
                 predicted_output: float, arrived_at: float) -> None:
        self.rid = rid
        self.label = label
        """Request id shown in decision records: an int for HTTP, the caller's string for gRPC."""
        self.prompt_tokens = prompt_tokens
        self.predicted_bucket = predicted_bucket
        self.predicted_output = predicted_output
        """Point estimate of the output length from the predicted bucket (tokens)."""
        self.load_bin = load_bin(predicted_output)
        p = predicted_output * _EXACT_SCALE
        self.exact = -_EXACT_LIMIT < predicted_output < _EXACT_LIMIT and p == int(p)
        """Whether float sums involving ``predicted_output`` are exact (see ``_EXACT_SCALE``)."""
        self.generated = 0
        """Output tokens counted so far."""
        self.first_token = False
        self.endpoint: EndpointState | None = None
        self.dispatched_at = 0.0
        self.arrived_at = arrived_at
        self.group: _DecodeGroup | None = None
        self.done = False
        self.blind = False
        self.cached_tokens = 0
        self.uncached_blocks = 0
        self.kv_batches = 0
        """Batches its endpoint's engine index had applied when it was dispatched."""
        self.pending: list[int] | None = None
        """Its prompt's engine-block keys noted pending on its endpoint (``EndpointState.note_pending``)."""
        """Full prompt blocks its endpoint's engine did not hold at dispatch (precise mode): once
        it is prefilled their ``BlockStored`` events are due (``EngineBlockIndex.note_dispatch``)."""
        """Prompt tokens believed cached on its endpoint when it was dispatched (the engine's KV
        events in precise mode, the policy's approximate index otherwise; < ``prompt_tokens``):
        its prefill backlog there is the rest (:meth:`RequestBook.pending_prefill_work`)."""
        """The answer arrives whole (a non-streaming request): routerd never sees its first
        token, so while the instance counts it as running it is taken to be decoding
        (vLLM's prefill is short next to the decode; see :meth:`RequestBook.residents`)."""
        self.model: str | None = None
        """The model the request names; None: any endpoint may take it."""
        self.seq = 0
        """Order in the router queue across models (set when queued; lower is older)."""
        self.policy: Any = None
        """The policy instance that placed it (its model's), told of its completion."""
        # Router-queue fields (set by the router).
        self.features: Any = None
        self.exclude: Any = frozenset()
        self.enqueued_at = arrived_at
        self.waiter: Any = None
        self.error: Any = None
        self.fallback = False

    def reset_for_retry(self) -> None:
        """Forget the failed attempt (the request was released from its endpoint) before re-dispatch."""
        self.endpoint = None
        self.done = False
        self.generated = 0
        self.first_token = False
        self.group = None


class _DecodeGroup:
    """Decoding requests sharing one predicted output length, for the smallest predicted remaining.

    ``min over members of (predicted - generated) = predicted - max generated``; the
    maximum only grows while members decode, and is rescanned lazily after the member
    holding it leaves.
    """

    __slots__ = ("predicted", "members", "max_generated", "dirty")

    def __init__(self, predicted: float) -> None:
        self.predicted = predicted
        self.members: dict[int, Inflight] = {}
        self.max_generated = 0
        self.dirty = False

    def max_gen(self) -> int:
        if self.dirty:
            self.max_generated = max((r.generated for r in self.members.values()), default=0)
            self.dirty = False
        return self.max_generated


def _min_remaining(groups: "Iterable[_DecodeGroup]", least: float | None) -> float | None:
    """The smallest predicted remaining decode (tokens) over ``groups``' members and ``least``."""
    for g in groups:
        if g.members:
            rem = g.predicted - g.max_gen()
            if least is None or rem < least:
                least = rem
    return least


def _blocks(tokens: int, block_size: int) -> int:
    """KV blocks that hold ``tokens`` tokens."""
    return -(-tokens // block_size)


def _jsq_term(r: Inflight) -> float:
    """``r``'s term of the JSQ metric (tokens), as ``outstanding_tokens`` counts it."""
    rest = r.predicted_output - r.generated
    prefill = 0 if r.first_token else r.prompt_tokens + r.generated
    return prefill + rest if rest > 0.0 else float(prefill)


class RequestBook:
    """The requests routerd has on one instance and aggregates of them, kept at each event.

    Before first token a request counts as in prefill; the owner sets ``num_running``
    (the instance's running count) before a decision, and the first
    ``num_running - decoding`` prefill requests in dispatch order count as running,
    the rest as waiting (:meth:`residents`). A ``blind`` request (non-streaming: no
    first-token event) in a running slot counts as decoding rather than in prefill, as
    the simulator would show it for most of its life.

    Args:
        block_size: tokens per KV block.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.requests: dict[int, Inflight] = {}
        self.num_running = 0
        self._prefill: dict[int, Inflight] = {}
        """Requests before their first token, in dispatch order."""
        self._prefill_blocks = 0
        """Sum over ``_prefill`` of the blocks for prompt + generated tokens."""
        self._prefill_prompt = 0
        """Sum over ``_prefill`` of the prompt tokens."""
        self._prefill_prompt_sq = 0
        """Sum over ``_prefill`` of the squared prompt tokens (tokens^2)."""
        self._bins = [0, 0, 0]
        self._sum_pred = 0.0
        """Sum of prompt + predicted output over requests with an exact prediction (tokens)."""
        self._sum_tokens = 0
        self._outstanding = 0.0
        """Sum of :func:`_jsq_term` over requests with an exact prediction (tokens)."""
        self._n_inexact = 0
        self._n_blind = 0
        """Requests in ``_prefill`` that are ``blind`` (no first-token event will come)."""
        # The blind requests of ``_prefill`` by themselves: while every one of ``_prefill`` has a
        # running slot (the usual state: the engine runs all it was sent) they all count as
        # decoding, and the aggregates follow from these without a scan (see load_summary).
        self._blind_bins = [0, 0, 0]
        self._blind_groups: dict[float, _DecodeGroup] = {}
        self._blind_u = 0
        """Sum over blind requests in ``_prefill`` of their uncached prompt tokens ``u``."""
        self._blind_uu = 0
        """Sum over them of ``u * (c + u)`` (tokens^2)."""
        self._blind_prefill = 0
        """Sum over the exact ones of prompt + generated tokens: their prefill term of the JSQ metric."""
        self._groups: dict[float, _DecodeGroup] = {}
        self._summary: LoadSummary | None = None
        self._residents: list[ResidentRequest] | None = None

    # -- events ------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Requests routerd dispatched here that have not finished."""
        return len(self.requests)

    def add(self, r: Inflight, now: float) -> None:
        """Record ``r`` (not yet at its first token) as dispatched here at ``now`` (monotonic s)."""
        r.endpoint = self  # type: ignore[assignment]
        r.dispatched_at = now
        self.requests[r.rid] = r
        self._prefill[r.rid] = r
        c = r.cached_tokens
        u = r.prompt_tokens - c
        self._prefill_prompt += u
        self._prefill_prompt_sq += u * (c + u)
        tokens = r.prompt_tokens + r.generated
        if r.blind:
            self._blind_in(r, u, c, tokens)
        self._prefill_blocks += _blocks(tokens, self.block_size)
        self._sum_tokens += tokens
        if r.exact:
            self._sum_pred += r.prompt_tokens + r.predicted_output
            self._outstanding += _jsq_term(r)
        else:
            self._n_inexact += 1
        self._summary = self._residents = None

    def on_first_token(self, r: Inflight) -> None:
        """``r`` produced its first token: it moves from prefill to decode."""
        if r.first_token or r.done:
            return
        tokens = r.prompt_tokens + r.generated
        if r.exact:
            self._outstanding -= tokens
        r.first_token = True
        del self._prefill[r.rid]
        c = r.cached_tokens
        u = r.prompt_tokens - c
        if r.blind:
            self._blind_out(r, u, c, tokens)
        self._prefill_prompt -= u
        self._prefill_prompt_sq -= u * (c + u)
        self._prefill_blocks -= _blocks(tokens, self.block_size)
        self._bins[r.load_bin] += 1
        g = self._groups.get(r.predicted_output)
        if g is None:
            g = self._groups[r.predicted_output] = _DecodeGroup(r.predicted_output)
        g.members[r.rid] = r
        r.group = g
        if r.generated > g.max_generated:
            g.max_generated = r.generated
        self._summary = self._residents = None

    def on_tokens(self, r: Inflight, n: int) -> None:
        """``n`` more output tokens of ``r`` were seen (n >= 0)."""
        if r.done:
            return
        old = r.generated
        new = r.generated = old + n
        self._sum_tokens += n
        if r.exact:
            rest = r.predicted_output - old
            if rest > 0.0:
                # The predicted remaining decode shrinks to max(0, rest - n).
                self._outstanding -= rest if rest <= n else n
        if r.first_token:
            g = r.group
            if g is not None and new > g.max_generated:
                g.max_generated = new
        else:
            # Tokens before the first-token event: a prefill's footprint grows with them.
            if r.exact:
                self._outstanding += n
            if r.blind:
                if r.exact:
                    self._blind_prefill += n
                g = self._blind_groups[r.predicted_output]
                if new > g.max_generated:
                    g.max_generated = new
            bs = self.block_size
            self._prefill_blocks += _blocks(r.prompt_tokens + new, bs) - _blocks(r.prompt_tokens + old, bs)
        self._summary = self._residents = None

    def remove(self, r: Inflight) -> bool:
        """Forget ``r`` (finished, failed or cancelled); False if it was not here."""
        if r.done or self.requests.pop(r.rid, None) is None:
            return False
        r.done = True
        self._sum_tokens -= r.prompt_tokens + r.generated
        if r.exact:
            self._sum_pred -= r.prompt_tokens + r.predicted_output
            self._outstanding -= _jsq_term(r)
        else:
            self._n_inexact -= 1
        if r.first_token:
            self._bins[r.load_bin] -= 1
            g = r.group
            if g is not None:
                del g.members[r.rid]
                if r.generated >= g.max_generated:
                    g.dirty = True
        else:
            del self._prefill[r.rid]
            c = r.cached_tokens
            u = r.prompt_tokens - c
            if r.blind:
                self._blind_out(r, u, c, r.prompt_tokens + r.generated)
            self._prefill_prompt -= u
            self._prefill_prompt_sq -= u * (c + u)
            self._prefill_blocks -= _blocks(r.prompt_tokens + r.generated, self.block_size)
        self._summary = self._residents = None
        return True

    def _blind_in(self, r: Inflight, u: int, c: int, tokens: int) -> None:
        self._n_blind += 1
        self._blind_bins[r.load_bin] += 1
        self._blind_u += u
        self._blind_uu += u * (c + u)
        if r.exact:
            self._blind_prefill += tokens
        g = self._blind_groups.get(r.predicted_output)
        if g is None:
            g = self._blind_groups[r.predicted_output] = _DecodeGroup(r.predicted_output)
        g.members[r.rid] = r
        if r.generated > g.max_generated:
            g.max_generated = r.generated

    def _blind_out(self, r: Inflight, u: int, c: int, tokens: int) -> None:
        self._n_blind -= 1
        self._blind_bins[r.load_bin] -= 1
        self._blind_u -= u
        self._blind_uu -= u * (c + u)
        if r.exact:
            self._blind_prefill -= tokens
        g = self._blind_groups[r.predicted_output]
        del g.members[r.rid]
        if not g.members:
            del self._blind_groups[r.predicted_output]
        elif r.generated >= g.max_generated:
            g.dirty = True

    def _blind_slots(self) -> int:
        """With blind requests here: 1 when every request before its first token has a running
        slot (blind ones then decode), -1 when none has (all wait), 0 otherwise (a scan decides)."""
        n = len(self._prefill)
        slots = self.num_running - (len(self.requests) - n)
        return 1 if slots >= n else (-1 if slots <= 0 else 0)

    # -- aggregates (what policies read) ------------------------------------------
    def residents(self) -> list[ResidentRequest]:
        """routerd's requests here, running first then waiting (O(requests)).

        Built once per decision (the owner clears ``_residents`` when it sets
        ``num_running``): policies such as ``min_min`` read it several times per instance.
        """
        cached = self._residents
        if cached is not None:
            return cached
        running: list[ResidentRequest] = []
        waiting: list[ResidentRequest] = []
        slots = self.num_running - (len(self.requests) - len(self._prefill))
        for r in self.requests.values():
            if r.first_token:
                running.append(ResidentRequest(r.prompt_tokens, r.generated, r.predicted_bucket,
                                               r.predicted_output, False, False))
            elif slots > 0:
                slots -= 1
                running.append(ResidentRequest(r.prompt_tokens, r.generated, r.predicted_bucket,
                                               r.predicted_output, not r.blind, False))
            else:
                waiting.append(ResidentRequest(r.prompt_tokens, r.generated, r.predicted_bucket,
                                               r.predicted_output, True, True))
        self._residents = running + waiting
        return self._residents

    def load_summary(self) -> LoadSummary:
        """``summarize_residents(self.residents())`` from the counters: O(distinct predicted lengths).

        Cached until the next event, so every reader of one decision shares one object.
        While a request with an inexact predicted length is here, the sum of prompt +
        predicted tokens is added up in the scan's order instead (O(requests), not cached).
        While a ``blind`` request has no first token, whether it counts as decoding depends on
        ``num_running`` (not cached): when every request before its first token has a running
        slot (blind ones decode: efficient-mode picker bookings, non-streaming requests under an
        engine that runs all it was sent) or none has, from the blind requests' own aggregates;
        otherwise the scan's (O(requests)).
        """
        s = self._summary
        if s is not None:
            return s
        blind = 0
        if self._n_blind:
            # Which blind requests count as decoding depends on ``num_running``: all of them or
            # none from the aggregates (not cached: ``num_running`` changes without an event),
            # a part by a scan.
            blind = self._blind_slots()
            if blind == 0:
                return summarize_residents(self.residents())
        if self._n_inexact:
            total = 0.0
            for r in self.residents():
                total += r.prompt_tokens + r.predicted_output_tokens
        else:
            total = self._sum_pred
        min_rem = _min_remaining(self._groups.values(), None)
        b = self._bins
        if blind == 1:  # every blind request decodes
            min_rem = _min_remaining(self._blind_groups.values(), min_rem)
            bb = self._blind_bins
            return LoadSummary(len(self._prefill) - self._n_blind, (b[0] + bb[0], b[1] + bb[1], b[2] + bb[2]),
                               min_rem, len(self.requests), total)
        s = LoadSummary(len(self._prefill), (b[0], b[1], b[2]), min_rem, len(self.requests), total)
        if not self._n_inexact and not self._n_blind:
            self._summary = s
        return s

    def outstanding_tokens(self) -> float | None:
        """The JSQ metric (tokens) in O(1), equal to ``join_shortest_queue.outstanding_tokens``.

        None while a request with an inexact predicted length (see ``_EXACT_SCALE``) is
        here: its float sum could then differ from a recount in the last bit. None too
        while a ``blind`` request has no first token: whether its prompt still counts
        depends on ``num_running`` (:meth:`residents`), so the helper scans.
        """
        if self._n_inexact:
            return None
        if not self._n_blind:
            return self._outstanding
        blind = self._blind_slots()
        if blind == 1:  # every blind request decodes: its prefill term leaves the metric
            return self._outstanding - self._blind_prefill
        return self._outstanding if blind == -1 else None

    def waiting_kv_blocks(self) -> int:
        """KV blocks the waiting requests need to start (blocks), equal to ``kv_headroom.waiting_kv_blocks``.

        O(1) when no prefill request or every one of them is waiting or running;
        otherwise it counts the smaller of the two parts (the admitted prefills or the
        waiting ones), never the decoding requests.
        """
        n = len(self._prefill)
        slots = self.num_running - (len(self.requests) - n)
        if slots <= 0:
            return self._prefill_blocks
        waiting = n - slots
        if waiting <= 0:
            return 0
        bs = self.block_size
        if waiting <= slots:
            return sum(_blocks(r.prompt_tokens + r.generated, bs)
                       for r in islice(reversed(self._prefill.values()), waiting))
        return self._prefill_blocks - sum(_blocks(r.prompt_tokens + r.generated, bs)
                                          for r in islice(self._prefill.values(), slots))

    def pending_prefill_work(self) -> tuple[int, int]:
        """``(tokens, attended)`` of the requests in prefill here, as
        :func:`routerd.prefix.index.pending_prefill_work` defines them: per in-prefill request of
        prompt ``p`` with ``c`` tokens believed cached at dispatch (:attr:`Inflight.cached_tokens`,
        0 without a prefix), ``u = p - c`` tokens still to compute and ``u * (c + u)`` attended. With
        every ``c`` 0 this is the helper's count from :meth:`residents` (whole prompts). O(1) while no
        ``blind`` request waits for its first token; otherwise the prefill requests are scanned (a
        blind one in a running slot counts as decoding, :meth:`residents`), never the decoding ones."""
        if not self._n_blind:
            return self._prefill_prompt, self._prefill_prompt_sq
        blind = self._blind_slots()
        if blind == 1:  # every blind request decodes
            return self._prefill_prompt - self._blind_u, self._prefill_prompt_sq - self._blind_uu
        if blind == -1:  # every one waits: all prefill work
            return self._prefill_prompt, self._prefill_prompt_sq
        slots = self.num_running - (len(self.requests) - len(self._prefill))
        tokens = attended = 0
        for r in self._prefill.values():
            if slots > 0:
                slots -= 1
                if r.blind:
                    continue
            c = r.cached_tokens
            u = r.prompt_tokens - c
            tokens += u
            attended += u * (c + u)
        return tokens, attended

    def pending_prefill_tokens(self) -> int:
        """The tokens of :meth:`pending_prefill_work` (``dynamo_kv``'s and ``lmetric``'s prefill backlog)."""
        if not self._n_blind:
            return self._prefill_prompt
        return self.pending_prefill_work()[0]
