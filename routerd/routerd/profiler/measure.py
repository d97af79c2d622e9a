"""Run a :class:`MeasurementPlan` against an endpoint and reduce the streams to fit points.

Client-side timestamps are late by scheduling noise, never early, and a late token
also shortens the next gap; so gaps are never read one by one. A decode batch's
iteration time is the slope of read time against the cumulative token count over a
steady window (every request decoding); a prefill batch's extra time is the step in
the probe's read times across the batch. Both are low-quantile regressions over
tens of tokens (:func:`quantile_fit`), which follow the promptly delivered tokens.

Tokens may come in groups: one server-sent event can carry the tokens of several
engine steps (vLLM merges them when its API server falls behind), and one network read
can bring several events. A read at time ``t`` after which ``n`` tokens have arrived says
that the step making token ``n`` ended before ``t``, lately by the delivery lag only; the
read's earlier tokens were made whole steps before ``t``, so their times say nothing about
the steps. The fits therefore use one point per read, ``(n, t)`` (:func:`read_points`):
the engine's cumulative output ``n(t)`` is a staircase rising one token per step, the read
points lie on or after it, and the low-quantile line through them has the staircase's
slope, the step time, whatever the grouping, as long as the delivery lag does not drift
over the window. When every event carries one token and every read one event this is the
per-token fit it replaced.

When the endpoint serves vLLM's ``vllm:inter_token_latency_seconds`` histogram (vLLM and
the emulator do), both are timed by the engine instead: a decode batch's step is the
histogram's mean over a window in which every request decodes (:class:`EngineWindow`), a
prefill batch's extra time is the probe's histogram sum across it less its quiet steps'
pace. Those are the engine core's own timestamps: a stall of this client, which on a few
shared cores took 0.2-1.8 s at times, does not enter them, while a slowdown of the engine
does (it is what a simulation of that engine must reproduce). The read-based estimates are
then kept beside them for comparison (the decode table's ``reads_gap_ms``).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import numpy as np

from routerd.errors import ConfigError
from routerd.profiler.client import EndpointInfo, ProfilerClient, StreamRecord
from routerd.profiler.plan import MeasurementPlan

_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case "
          "point government company number group problem fact city river water light music story table "
          "garden window paper money road island engine market letter mountain").split()


#: Requests of a decode batch whose every token is time-stamped.
TRACERS = 4
#: Tokens time-stamped on the other requests of a decode batch (to place their start).
HELD_TOKENS = 4
#: Extra runs of a decode batch that showed no steady window.
DECODE_RETRIES = 1
#: Largest decode batch added to reach an endpoint's ``max_num_seqs`` (concurrent streams).
MAX_ADDED_BATCH = 256
#: Tokens kept between the engine window's ends and the batch's ramp-up and tail (steps).
WINDOW_MARGIN = 3


class ProfileRunError(ConfigError):
    """The endpoint misbehaved during profiling (stopped early, preempted everything, ...)."""


@dataclass
class DecodePoint:
    """One steady decode window: ``batch`` requests over ``context_tokens`` resident tokens."""

    batch: int
    context_tokens: float
    """Sum over the batch of prompt + generated tokens at the window's centre."""
    gap_s: float
    """Iteration time (s): the engine's mean inter-token latency over the window when the endpoint
    serves vLLM's histogram (``source`` "engine"), else the slope of read time against token count,
    pooled over the timed requests (``source`` "reads")."""
    prompt_tokens: int
    window_tokens: int
    source: str = "reads"
    reads_gap_s: float | None = None
    """The read-time slope (s), kept for comparison when ``gap_s`` is the engine's."""


@dataclass
class PrefillPoint:
    """One prefill batch beside the probe."""

    requests: int
    prefill_tokens: int
    """Sum of the batch's prompt tokens (server's count)."""
    attn_tokens2: float
    """Sum of squared prompt lengths (the attention term's regressor, tokens^2)."""
    excess_s: float
    """Extra time (s) the batch added to the probe's steps (engine inter-token latency, or the
    step in the probe's read times across it)."""
    baseline_s: float
    """The probe's step time (s) beside which the batch ran."""
    iterations: int


class PromptMaker:
    """Unique prompts of a given server-side token length.

    Every prompt starts with a random nonce so no prefix-cache block is shared (vLLM
    caches by hash chains from the first block, of 128 tokens on its CPU build: a shared
    first block would make every later one shared too). The server's tokens of a prompt of
    ``b`` UTF-8 bytes are modelled as ``offset + ratio * b / 4`` (``ratio``: server tokens per
    estimated token of 4 bytes; ``offset``: tokens that do not grow with the text, the BOS
    vLLM's tokenizer adds to a completions prompt and the nonce's extra tokens), both set by
    :meth:`calibrate` from the server's ``usage.prompt_tokens``, the only count that matters
    (the tiny test tokenizer makes about 2 tokens per 4 bytes of these words; GPT-style
    tokenizers about 1).
    """

    def __init__(self, seed: int | None = None) -> None:
        self.ratio = 1.0
        self.offset = 0.0
        self._rng = random.Random(seed)

    def make(self, tokens: int) -> str:
        """A prompt the server should count as about ``tokens`` tokens."""
        n_bytes = max(4, int(round(4 * (tokens - self.offset) / self.ratio)))
        head = uuid.uuid4().hex[:12] + " "
        parts = [head]
        size = len(head)
        # The word list cycled from a random place: a long prompt has the list's mean tokens
        # per byte whatever its start, and short prompts do not all share the first words'.
        i = self._rng.randrange(len(_WORDS))
        while size < n_bytes:
            w = _WORDS[i % len(_WORDS)] + " "
            parts.append(w)
            size += len(w)
            i += 1
        return "".join(parts)[:n_bytes]

    async def calibrate(self, client: ProfilerClient, model: str, tokens: int = 1000,
                        small: int = 64) -> int | None:
        """Fit ``ratio`` and ``offset`` from the server's counts of two prompts: one of ``tokens``
        estimated tokens (which sets the ratio alone), then one of ``small`` at that ratio (the
        two give the line). Returns the server's count of a third prompt made for ``tokens``
        once calibrated (a check, logged), or None when the server reports no ``usage``."""
        _, _, got = await client.complete(model, self.make(tokens), 1)
        if not got:
            return None
        self.ratio = got / tokens
        _, _, got_small = await client.complete(model, self.make(small), 1)
        if got_small:
            # Two points, bytes -> tokens: b_small, b_long at the ratio in force for each.
            b_long, b_small = 4.0 * tokens, 4.0 * small / self.ratio
            slope = (got - got_small) / (b_long - b_small) if b_long > b_small else 0.0
            if slope > 0:
                self.ratio = 4.0 * slope
                self.offset = max(0.0, got - slope * b_long)
        _, _, check = await client.complete(model, self.make(tokens), 1)
        return check


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    """Cancel ``tasks`` and wait for them, so a failed batch leaves nothing running."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class _Probe:
    """A long-running streamed request whose tokens are made one per engine step.

    ``times[i]`` is the read time of token ``i``; ``ends[i]`` whether token ``i`` was the
    last of its read (only those times bound a step's end; see the module docstring).
    """

    def __init__(self, client: ProfilerClient, model: str, prompt: str, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.times: list[float] = []
        self.ends: list[bool] = []
        self._ev = asyncio.Event()
        self._task = asyncio.create_task(client.stream(model, prompt, max_tokens, on_tokens=self._on))
        self._task.add_done_callback(lambda _t: self._ev.set())

    def _on(self, t: float, n: int) -> None:
        k = n - len(self.times)
        self.times.extend([t] * k)
        self.ends.extend([False] * (k - 1) + [True])
        self._ev.set()

    @property
    def alive(self) -> bool:
        return not self._task.done()

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.times)

    async def wait_count(self, n: int) -> bool:
        """Wait until ``n`` tokens arrived; False if the probe ended first."""
        while len(self.times) < n:
            if self._task.done():
                if self._task.exception() is not None:
                    raise self._task.exception()  # type: ignore[misc]
                return False
            self._ev.clear()
            await self._ev.wait()
        return True

    async def close(self) -> None:
        """Cancel the stream (the server aborts the request)."""
        self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):
            pass


class Measurer:
    """Runs the batches of ``plan`` against ``client`` and returns fit points.

    Args:
        log: called with one progress line per batch.
    """

    def __init__(self, client: ProfilerClient, info: EndpointInfo, plan: MeasurementPlan,
                 log: Callable[[str], None] = lambda _m: None) -> None:
        self.client = client
        self.info = info
        self.plan = plan
        self.log = log
        self.prompts = PromptMaker()
        self.notes: list[str] = []
        """What was skipped or shrunk, and why (written into the profile's header)."""
        self._stalls: list[tuple[float, float]] = []  # when this client was busy scraping /metrics
        self._inexact_noted = False
        self._engine_itl: bool | None = None  # whether the endpoint serves the ITL histogram

    # ------------------------------------------------------------------ decode
    def batch_sizes(self) -> list[int]:
        """The plan's decode batch sizes, fitted to the endpoint's ``max_num_seqs`` when it
        reports one (:attr:`EndpointInfo.scheduler`): larger sizes are cut to it (more would
        queue, and the batch would not decode in step), and it is added when it is larger than
        the plan's largest, up to :data:`MAX_ADDED_BATCH`, so the fit covers the batches the
        engine runs under load (the linear terms do not extrapolate well: a vLLM CPU engine's
        step at 128 requests took 1.6x the time a fit to batches of up to 64 predicted)."""
        sizes = list(self.plan.decode_batch_sizes)
        mns = self.info.scheduler.get("max_num_seqs")
        if not isinstance(mns, int) or isinstance(mns, bool):
            return sizes
        cut = sorted({min(b, mns) for b in sizes})
        notes = []
        if max(sizes) > mns:
            notes.append(f"decode batch sizes cut to the endpoint's max_num_seqs {mns}")
        top = min(mns, MAX_ADDED_BATCH)
        if top > max(cut):
            cut.append(top)
            notes.append(f"decode batch B={top} added: the endpoint's max_num_seqs is {mns}")
        self.notes += [n for n in notes if n not in self.notes]
        return cut

    def decode_batches(self) -> list[tuple[int, int]]:
        """``(B, p)`` of the plan, with ``p`` shrunk (or the batch dropped) to fit the KV cache."""
        plan, cap = self.plan, self.info.kv_capacity_tokens
        out = []
        sizes = self.batch_sizes()
        for p_plan in plan.decode_prompt_tokens:
            for b in sizes:
                p = p_plan
                need = b * (p + plan.decode_output_tokens)
                if cap is not None and need > plan.kv_fraction * cap:
                    p = int(plan.kv_fraction * cap / b) - plan.decode_output_tokens
                    if p < 8:
                        self.notes.append(f"decode batch B={b}, p={p_plan} dropped: does not fit {cap} KV tokens")
                        continue
                    self.notes.append(f"decode batch B={b}: prompt {p_plan} -> {p} tokens to fit {cap} KV tokens")
                if self.info.max_model_len is not None and p + plan.decode_output_tokens >= self.info.max_model_len:
                    self.notes.append(f"decode batch B={b}, p={p} dropped: longer than max_model_len")
                    continue
                out.append((b, p))
        return out

    async def _check_preemptions(self, before: float | None, what: str) -> bool:
        if before is None:
            return True
        after = await self.client.preemptions()
        if after is not None and after > before:
            self.notes.append(f"{what} dropped: the server preempted {after - before:.0f} request(s)")
            self.log(f"  {what}: preempted, dropped")
            return False
        return True

    async def measure_decode(self) -> list[DecodePoint]:
        """Run every decode batch; one point per batch.

        A batch with no steady window (a stall of the server or of this client, common when
        they share a few cores) is run once more before it is dropped."""
        points: list[DecodePoint] = []
        for b, p in self.decode_batches():
            what = f"decode batch B={b} p={p}"
            for attempt in range(1 + DECODE_RETRIES):
                got = await self._decode_once(b, p, what)
                if got is None:  # preempted: dropped, noted
                    break
                if got:
                    points.extend(got)
                    pt = got[0]
                    how = ("engine inter-token latency" + (f"; reads {pt.reads_gap_s * 1e3:.3f} ms"
                                                           if pt.reads_gap_s else "")
                           if pt.source == "engine" else "read times")
                    self.log(f"  {what}: iteration {pt.gap_s * 1e3:.3f} ms at {pt.context_tokens:.0f} "
                             f"context tokens ({how})" + (" (second run)" if attempt else ""))
                    break
                if attempt < DECODE_RETRIES:
                    self.log(f"  {what}: no steady window, run again")
            else:
                self.notes.append(f"{what} dropped: no steady window (every request decoding) of 12+ tokens "
                                  f"with 8+ reads per timed request in {1 + DECODE_RETRIES} runs")
                self.log(f"  {what}: no steady window, dropped")
        return points

    async def _decode_once(self, b: int, p: int, what: str) -> list[DecodePoint] | None:
        """One run of a decode batch: its point (a list of one), [] without a steady window,
        None when the server preempted (noted).

        Raises:
            ProfileRunError: a request did not get the tokens it asked for."""
        n_out = self.plan.decode_output_tokens
        before = await self.client.preemptions()
        recs, window = await self._decode_batch(b, p, n_out)
        for r in recs:
            # The server's usage is the count; the chunks' count when it sends none.
            got_n = r.completion_tokens if r.completion_tokens is not None else len(r.token_s)
            if got_n != n_out:
                raise ProfileRunError(f"--endpoint {self.client.base_url}: a request that asked for {n_out} "
                                      f"tokens got {got_n} (the server must honour max_tokens with ignore_eos, "
                                      "as vLLM does)")
        if not all(r.exact for r in recs[:TRACERS]) and not self._inexact_noted:
            self._inexact_noted = True
            self.notes.append("the server's events carried several tokens without token ids or continuous "
                              "usage: token counts per read were spread over time (decode slopes are "
                              "stream averages)")
        if not await self._check_preemptions(before, what):
            return None
        return _decode_points(recs, b, p, window)

    async def _decode_batch(self, b: int, p: int, n_out: int) -> tuple[list[StreamRecord], "EngineWindow | None"]:
        """``b`` concurrent streams; the first :data:`TRACERS` are timed throughout, the others
        for their first :data:`HELD_TOKENS` tokens (then read once the tracers are done). With
        vLLM's metrics, also the engine's inter-token latency over a window in which every
        request decodes (:meth:`_engine_window`; None when not served or too short)."""
        hold = asyncio.Event()
        model = self.info.model
        progress = _Progress(b)
        tasks = [asyncio.create_task(self.client.stream(model, self.prompts.make(p), n_out,
                                                        on_tokens=progress.callback(i),
                                                        hold=None if i < TRACERS else hold,
                                                        hold_after=HELD_TOKENS))
                 for i in range(b)]
        window = asyncio.create_task(self._engine_window(progress, n_out)) if self.info.has_metrics else None
        try:
            await asyncio.gather(*tasks[:TRACERS])
            hold.set()
            recs = list(await asyncio.gather(*tasks))
        except BaseException:
            await _cancel_all(tasks + ([window] if window else []))
            raise
        if window is None:
            return recs, None
        try:  # its last scrape may still be on its way
            return recs, await asyncio.wait_for(window, timeout=10.0)
        except asyncio.TimeoutError:
            return recs, None

    async def _engine_window(self, progress: "_Progress", n_out: int) -> "EngineWindow | None":
        """Scrape vLLM's inter-token latency histogram when every request of the batch has
        decoded :data:`WINDOW_MARGIN` tokens, and again :data:`WINDOW_MARGIN` tokens before the
        earliest-started request's last token; the difference is the engine's mean step time over
        the steps between (each step adds one sample per running request, so the mean is the mean
        step whatever the batch). None when the window would be shorter than 8 steps or the
        histogram is not served."""
        tr = range(min(TRACERS, len(progress.counts)))
        await progress.until(lambda: all(t is not None for t in progress.first_s))
        base = [progress.counts[i] for i in tr]
        await progress.until(lambda: min(progress.counts[i] - base[k] for k, i in enumerate(tr)) >= WINDOW_MARGIN)
        t_a = time.perf_counter()
        a = await self.client.inter_token_latency()
        t_a = 0.5 * (t_a + time.perf_counter())  # the scrape's middle: when the server read the histogram
        if a is None:
            return None
        # The earliest-started request ends first: it leads the tracers by the time between
        # its first token and theirs, in steps (the tracers' pace so far).
        lead_tr = max(tr, key=lambda i: progress.counts[i])
        t1, n1 = progress.first_s[lead_tr], progress.counts[lead_tr]
        step = (t_a - t1) / max(1, n1 - 1)
        lead = max(0.0, (t1 - min(progress.first_s)) / step) if step > 0 else 0.0
        n_end = n_out - WINDOW_MARGIN - math.ceil(lead)
        if n_end - n1 < 8:
            return None
        await progress.until(lambda: progress.counts[lead_tr] >= n_end)
        t_b = time.perf_counter()
        b_ = await self.client.inter_token_latency()
        t_b = 0.5 * (t_b + time.perf_counter())
        if b_ is None or b_[1] <= a[1]:
            return None
        return EngineWindow(t_a, t_b, b_[0] - a[0], b_[1] - a[1])

    # ------------------------------------------------------------------ prefill
    async def _new_probe(self) -> _Probe:
        p = self.plan.probe_prompt_tokens
        limit = self.info.max_model_len or 2048
        probe = _Probe(self.client, self.info.model, self.prompts.make(p), max(64, min(2048, limit - p - 8)))
        if not await probe.wait_count(self.plan.quiet_tokens + 2):
            raise ProfileRunError(f"--endpoint {self.client.base_url}: the probe request ended after "
                                  f"{len(probe.times)} tokens")
        return probe

    async def measure_prefill(self) -> list[PrefillPoint]:
        """Run every prefill batch beside a probe (restarted when it runs out of tokens)."""
        q = self.plan.quiet_tokens
        points: list[PrefillPoint] = []
        group: list[_Batch] = []
        probe = await self._new_probe()
        try:
            for n, L in self.plan.prefill_batches:
                what = f"prefill batch N={n} L={L}"
                got: _Batch | str | None = None
                for _attempt in range(2):
                    if probe.remaining < 4 * q + 64 or not probe.alive:
                        points += self._reduce(probe, group)
                        group = []
                        await probe.close()
                        probe = await self._new_probe()
                    got = await self._prefill_once(probe, n, L)
                    if got is not None:
                        break
                if got is None:
                    self.notes.append(f"{what} dropped: the probe ended during it twice")
                    continue
                if isinstance(got, _Batch):
                    group.append(got)
                elif isinstance(got, PrefillPoint):
                    points.append(got)
            points += self._reduce(probe, group)
        finally:
            await probe.close()
        return points

    async def _scrape_preemptions(self) -> float | None:
        t0 = time.perf_counter()
        try:
            return await self.client.preemptions()
        finally:
            self._stalls.append((t0, time.perf_counter()))

    async def _prefill_once(self, probe: _Probe, n: int, L: int) -> "_Batch | PrefillPoint | str | None":
        """Send one batch between two quiet stretches of the probe; None if the probe ended.

        With vLLM's inter-token latency histogram the batch is measured by the engine's own
        step times (:meth:`_prefill_engine`, a :class:`PrefillPoint`, or "dropped"); otherwise
        by the probe's read times (a :class:`_Batch` for :meth:`_reduce`)."""
        q = self.plan.quiet_tokens
        before = await self._scrape_preemptions()
        if self.info.has_metrics and self._engine_itl is not False:
            got = await self._prefill_engine(probe, n, L)
            if got is not None and before is not None and not isinstance(got, str):
                after_p = await self._scrape_preemptions()
                if after_p is not None and after_p > before:
                    self.notes.append(f"prefill batch N={n} L={L} dropped: the server preempted "
                                      f"{after_p - before:.0f} request(s)")
                    return "preempted"
            if got != "no histogram":
                return got
            self._engine_itl = False
        if not await probe.wait_count(len(probe.times) + q):
            return None
        prompts = [self.prompts.make(L) for _ in range(n)]
        t_send = time.perf_counter()
        res = await self._one_token_each(prompts)
        t_done = max(done for _, done, _ in res)
        times = probe.times
        if not await probe.wait_count(len(times) + q + 1):
            return None
        k_before = max(i for i in range(len(times)) if times[i] <= t_send)
        typical = step_estimate(times, probe.ends, max(0, k_before - 2 * q), k_before)
        # The batch's last prefill ends an iteration the probe ticks at too; the next tick
        # (a whole iteration later) is after the batch.
        last = max(i for i in range(len(times)) if times[i] <= t_done + 0.5 * typical)
        if last <= k_before:
            return None
        if before is not None:
            after_p = await self._scrape_preemptions()
            if after_p is not None and after_p > before:
                self.notes.append(f"prefill batch N={n} L={L} dropped: the server preempted "
                                  f"{after_p - before:.0f} request(s)")
                return "preempted"
        return _Batch(n, L, [pt if pt else L for _, _, pt in res], k_before, last)

    async def _one_token_each(self, prompts: list[str]) -> list:
        """Send every prompt at once for one output token; the client's results in prompt order.
        If one fails or the caller is cancelled, the others are cancelled before it propagates."""
        tasks = [asyncio.create_task(self.client.complete(self.info.model, pr, 1)) for pr in prompts]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            await _cancel_all(tasks)
            raise

    async def _prefill_engine(self, probe: _Probe, n: int, L: int) -> "PrefillPoint | str | None":
        """One prefill batch timed by the engine: the probe's inter-token latency histogram
        (it is the only request decoding, one sample per step) is scraped before a quiet stretch
        of :attr:`MeasurementPlan.quiet_tokens` steps, after it, and after the batch and as many
        steps again. The quiet stretch gives the probe's step ``base``; the batch added
        ``sum - count * base`` over the second interval (the batch's requests, of one output
        token, add no samples). Engine-side times: this client's stalls do not enter.

        Returns the point, "dropped" (noted: no lengthening, the pace changed), "no histogram"
        (not served: the caller uses read times), or None when the probe ended."""
        q = self.plan.quiet_tokens
        a = await self.client.inter_token_latency()
        if a is None:
            return "no histogram"
        self._engine_itl = True
        if not await probe.wait_count(len(probe.times) + q):
            return None
        b_ = await self.client.inter_token_latency()
        prompts = [self.prompts.make(L) for _ in range(n)]
        res = await self._one_token_each(prompts)
        if not await probe.wait_count(len(probe.times) + q):
            return None
        c = await self.client.inter_token_latency()
        if b_ is None or c is None or b_[1] - a[1] < 2 or c[1] <= b_[1]:
            return None
        base = (b_[0] - a[0]) / (b_[1] - a[1])
        steps = c[1] - b_[1]
        tokens = [pt if pt else L for _, _, pt in res]
        pt = PrefillPoint(n, sum(tokens), float(sum(t * t for t in tokens)), (c[0] - b_[0]) - steps * base, base,
                          int(steps))
        if pt.excess_s <= 0:
            self.notes.append(f"prefill batch N={n} L={L} dropped: it did not lengthen the probe's steps "
                              f"({pt.excess_s * 1e3:+.2f} ms; the probe's pace changed around it)")
            self.log(f"  prefill batch N={n} L={L}: {pt.excess_s * 1e3:+.2f} ms, dropped")
            return "dropped"
        self.log(f"  prefill batch N={n} L={L}: {pt.prefill_tokens} tokens, +{pt.excess_s * 1e3:.2f} ms over "
                 f"{steps:.0f} step(s) of {base * 1e3:.2f} ms (engine inter-token latency)")
        return pt

    def _reduce(self, probe: _Probe, group: list["_Batch"]) -> list[PrefillPoint]:
        """Points of the batches sent beside one probe: steps between its quiet stretches.

        Model of the probe's tick times: ``t_i = c_s + b0 * x + b1 * x**2`` (``x`` the
        centred tick index, ``s`` the quiet stretch, one intercept per stretch; ``b1``
        is the probe's own context growth). The batch between stretches ``s`` and
        ``s + 1`` delayed every later tick by ``c_{s+1} - c_s``. One fit over all the
        stretches pins the baseline far better than the few ticks around one batch; it
        is a low-quantile fit (:func:`quantile_fit`), as arrival times are only ever late.
        """
        if not group:
            return []
        times = np.asarray(probe.times)
        ends = np.asarray(probe.ends[:len(times)], dtype=bool)
        bounds = [(2, group[0].k_before)]  # ticks 0-1 carry the probe's own prefill
        bounds += [(group[j - 1].last, group[j].k_before) for j in range(1, len(group))]
        bounds.append((group[-1].last, len(times) - 1))
        # Ticks read while this client scraped /metrics (and the iteration after) are late
        # by the scrape's cost: leave them out. So are tokens that were not the last of
        # their read (made whole steps before it).
        typical = step_estimate(probe.times, probe.ends, 2, len(times) - 1)
        stalled = ~ends
        for t0, t1 in self._stalls:
            stalled |= (times >= t0) & (times <= t1 + 1.5 * typical)
        idx, stretch = [], []
        for si, (a, b) in enumerate(bounds):
            for i in range(a, b + 1):
                if not stalled[i]:
                    idx.append(i)
                    stretch.append(si)
        if len(set(stretch)) < len(bounds) or len(idx) < len(bounds) + 4:
            for bt in group:
                self.notes.append(f"prefill batch N={bt.requests} L={bt.length} dropped: too few probe reads "
                                  "around it (its tokens came in large groups)")
            return []
        i = np.asarray(idx, dtype=float)
        x = i - i.mean()
        X = np.zeros((len(idx), len(bounds) + 2))
        X[np.arange(len(idx)), stretch] = 1.0
        X[:, -2] = x
        X[:, -1] = x * x
        y = times[idx] - times[idx].mean()
        beta = quantile_fit(X, y)
        b0, b1 = beta[-2], beta[-1]
        points = []
        for j, bt in enumerate(group):
            xc = 0.5 * (bt.k_before + bt.last) - i.mean()
            pt = PrefillPoint(bt.requests, sum(bt.tokens), float(sum(t * t for t in bt.tokens)),
                              float(beta[j + 1] - beta[j]), float(b0 + 2 * b1 * xc), bt.last - bt.k_before)
            if pt.excess_s <= 0:
                # A prefill cannot shorten the probe's steps: the probe's own pace changed
                # around the batch (other load on the machine), and the step is not measured.
                self.notes.append(f"prefill batch N={bt.requests} L={bt.length} dropped: it did not lengthen the "
                                  f"probe's steps ({pt.excess_s * 1e3:+.2f} ms; the probe's pace changed around it)")
                self.log(f"  prefill batch N={bt.requests} L={bt.length}: {pt.excess_s * 1e3:+.2f} ms, dropped")
                continue
            points.append(pt)
            self.log(f"  prefill batch N={bt.requests} L={bt.length}: {pt.prefill_tokens} tokens, "
                     f"+{pt.excess_s * 1e3:.2f} ms over {pt.iterations} iteration(s) of {pt.baseline_s * 1e3:.2f} ms")
        return points


@dataclass
class EngineWindow:
    """The engine's inter-token latency histogram over part of a decode batch."""

    start_s: float
    """When the first scrape was sent (``perf_counter`` s)."""
    end_s: float
    itl_sum_s: float
    """Growth of the histogram's sum (s) between the scrapes."""
    itl_count: float
    """Growth of its count (tokens) between the scrapes."""

    @property
    def mean_s(self) -> float:
        """Mean inter-token latency (s): the mean step time over the window."""
        return self.itl_sum_s / self.itl_count


class _Progress:
    """Token counts and first-token read times of a batch's streams, as they are read."""

    def __init__(self, b: int) -> None:
        self.counts = [0] * b
        self.first_s: list[float | None] = [None] * b
        self._changed = asyncio.Event()

    def callback(self, i: int) -> Callable[[float, int], None]:
        def on_tokens(t: float, n: int) -> None:
            self.counts[i] = n
            if self.first_s[i] is None:
                self.first_s[i] = t
            self._changed.set()
        return on_tokens

    async def until(self, ready: Callable[[], bool]) -> None:
        """Return once ``ready()`` holds (checked after every read)."""
        while not ready():
            self._changed.clear()
            await self._changed.wait()


@dataclass
class _Batch:
    requests: int
    length: int
    tokens: list[int]
    k_before: int
    """Index of the probe's last tick before the batch was sent."""
    last: int
    """Index of the probe's tick that ended the batch's last iteration."""


def read_points(rec: StreamRecord, t_lo: float = -np.inf, t_hi: float = np.inf) -> tuple[np.ndarray, np.ndarray]:
    """``(n, t)`` of ``rec``'s reads with ``t_lo <= t <= t_hi``: cumulative tokens after each
    read, and its time (s). Token ``n`` (1-based) was made by a step that ended before ``t``."""
    t = np.asarray(rec.read_s, dtype=float)
    n = np.asarray(rec.read_counts, dtype=float)
    keep = (t >= t_lo) & (t <= t_hi)
    return n[keep], t[keep]


def step_estimate(times: list[float], ends: list[bool], lo: int, hi: int) -> float:
    """A rough step time (s) from tokens ``lo..hi`` of one stream (per-token read times and
    whether each was the last of its read): the median over consecutive read ends of
    ``time between them / tokens between them``. For window bounds and stall margins only;
    0.0 when there are fewer than two read ends."""
    idx = [i for i in range(max(0, lo), min(hi, len(times) - 1) + 1) if ends[i]]
    if len(idx) < 2:
        return 0.0
    t = np.asarray([times[i] for i in idx])
    k = np.asarray(idx, dtype=float)
    return float(np.median(np.diff(t) / np.diff(k)))


def _decode_points(recs: list[StreamRecord], b: int, p: int,
                   window: EngineWindow | None = None) -> list[DecodePoint]:
    """The point of one decode batch: its steady window (every request decoding), or none.

    ``recs[:TRACERS]`` were read throughout, the others for their first
    :data:`HELD_TOKENS` tokens. With an engine ``window`` the step time is the engine's mean
    inter-token latency over it (engine-side times: a stall of this client or of the HTTP layer
    does not enter, a slowdown of the engine does); otherwise, or when the window does not
    hold ``b`` samples per step, it is the slope of read time against cumulative tokens (one
    point per read, :func:`read_points`) at a low quantile, with one intercept per tracer,
    over the window in which every request decodes.

    Requests are placed on the timeline of the earliest tracer ``ref``, which makes one token
    per step: ``c_r``, ref's count when request ``r`` made its first token, puts ``r``'s count
    at ``n_ref - c_r + 1`` for the rest of the batch. ``r``'s first token came at or before
    ``t - (n - 1) * step`` for each read ``(n, t)`` of its first tokens (reads are late, never
    early), and the smallest such bound is taken. The point's context is the batch's at the
    window's middle (step times grow linearly with context, so the mean step over the window
    is the step at its middle).
    """
    tracers = recs[:TRACERS]
    if any(len(r.read_s) < 2 for r in tracers):
        return []
    ref = min(tracers, key=lambda r: r.read_s[0])
    n_ref = len(ref.token_s)
    typical = step_estimate(ref.token_s, _ends(ref), n_ref // 2, n_ref - 1)
    if window is not None and window.itl_count > 0 and window.mean_s > 0:
        typical = window.mean_s
    if typical <= 0:
        return []
    ref_n = np.asarray(ref.read_counts, dtype=float)
    ref_t = np.asarray(ref.read_s, dtype=float)

    def count_at(t: float) -> float:
        """ref's count at time ``t`` (read points interpolated; one per step before them)."""
        if t < ref_t[0]:
            return float(ref_n[0] - (ref_t[0] - t) / typical)
        return float(np.interp(t, ref_t, ref_n))

    def first_token_s(r: StreamRecord) -> float:
        n, t = read_points(r)
        early = n <= HELD_TOKENS
        if not early.any():
            early[0] = True
        return float(np.min(t[early] - (n[early] - 1) * typical))

    n_out = max(len(r.token_s) for r in recs)
    t0 = [first_token_s(r) for r in recs]
    c = [count_at(t) for t in t0]

    def context(n_mid: float) -> float:
        """The batch's resident tokens when ref has made ``n_mid`` tokens: token n (1-based) of
        a request comes from the step whose context for it is prompt + n - 1 tokens."""
        return sum((r.prompt_tokens or p) + float(np.clip(n_mid - cr, 0, n_out - 1)) for r, cr in zip(recs, c))

    reads = _read_slope(recs, tracers, t0, c, typical, n_out, ref_n, ref_t)
    if window is not None and window.itl_count > 0:
        # Each step of the window adds one sample per running request, so it held
        # itl_count / b steps when only the batch ran; the steps' own mean gives how many fit
        # in the time between the scrapes. Other traffic on the engine would add samples.
        steps = window.itl_count / b
        steps_by_time = (window.end_s - window.start_s) / window.mean_s
        if steps >= 8 and 0.75 <= steps / steps_by_time <= 1.33:
            # The middle on ref's count: its reads around the window's middle time (a stall of
            # this client there misplaces the context by the tokens it held back, not the step).
            n_mid = count_at(0.5 * (window.start_s + window.end_s))
            return [DecodePoint(b, context(n_mid), window.mean_s, p, int(round(steps)), "engine",
                                reads[0] if reads else None)]
    if reads is None:
        return []
    gap, n_mid, width = reads
    return [DecodePoint(b, context(n_mid), gap, p, width)]


def _read_slope(recs, tracers, t0, c, typical, n_out, ref_n, ref_t) -> tuple[float, float, int] | None:
    """``(step s, ref's count at the window's middle, window tokens)`` from the tracers' reads
    over the window in which every request decodes (see :func:`_decode_points`), or None."""
    t_lo = max(t0) + 1.5 * typical
    # Tracers' last reads are known. A held request that started before ref ends when ref's
    # count reaches n_out + c_r - 1 (one started after it ends after ref).
    ends = [r.read_s[-1] for r in tracers]
    ends += [float(np.interp(n_out + cr - 1, ref_n, ref_t)) for cr in c[TRACERS:] if n_out + cr - 1 < ref_n[-1]]
    t_hi = min(ends) - 1.5 * typical
    if t_hi - t_lo < 12 * typical:
        return None
    xs, ys, mids = [], [], []
    for k, r in enumerate(tracers):
        n, t = read_points(r, t_lo, t_hi)
        if len(n) < 8:
            return None
        xs.append(n)
        ys.append(t - t.mean())
        mids.append(float(n.mean()) + c[k] - 1)  # on ref's count
    # One slope, one intercept per tracer, at a low quantile of the read times.
    X = np.zeros((sum(len(x) for x in xs), len(xs) + 1))
    row = 0
    for k, x in enumerate(xs):
        X[row:row + len(x), k] = 1.0
        X[row:row + len(x), -1] = x - x.mean()
        row += len(x)
    gap = float(quantile_fit(X, np.concatenate(ys))[-1])
    if not gap > 0:
        return None
    return gap, float(np.mean(mids)), int(min(x[-1] - x[0] for x in xs))


def _ends(rec: StreamRecord) -> list[bool]:
    """Per token of ``rec``: whether it was the last of its read."""
    ends = [False] * len(rec.token_s)
    for c in rec.read_counts:
        if 0 < c <= len(ends):
            ends[c - 1] = True
    return ends


def quantile_fit(X: np.ndarray, y: np.ndarray, tau: float = 0.2, iters: int = 80) -> np.ndarray:
    """Linear quantile regression (quantile ``tau``) by iteratively reweighted least squares.

    Arrival times are the true times plus a lag that is never negative, mostly small
    and sometimes large (the client or server was descheduled); a low quantile follows
    the prompt arrivals and ignores the late ones, where least squares (a mean) or a
    median would be dragged by bursts. On loaded 2-core runs against the emulator this
    cut the error of a prefill batch's extra time from several ms to under 1 ms.
    """
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    for _ in range(iters):
        r = y - X @ beta
        w = np.where(r > 0, tau, 1.0 - tau) / np.maximum(np.abs(r), 1e-7)
        sw = np.sqrt(w)
        beta, *_ = np.linalg.lstsq(X * sw[:, None], y * sw, rcond=None)
    return beta
