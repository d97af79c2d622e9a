"""Run a :class:`MeasurementPlan` against an endpoint and reduce the streams to fit points.

Client-side timestamps are late by scheduling noise, never early, and a late token
also shortens the next gap; so gaps are never read one by one. A decode batch's
iteration time is the slope of token arrival time against token index over a
steady window (every request decoding); a prefill batch's extra time is the step in
the probe's tick times across the batch. Both are low-quantile regressions over
tens of tokens (:func:`quantile_fit`), which follow the promptly delivered tokens.
"""

from __future__ import annotations

import asyncio
import statistics
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


class ProfileRunError(ConfigError):
    """The endpoint misbehaved during profiling (stopped early, preempted everything, ...)."""


@dataclass
class DecodePoint:
    """One steady decode window: ``batch`` requests over ``context_tokens`` resident tokens."""

    batch: int
    context_tokens: float
    """Sum over the batch of prompt + generated tokens at the window's centre."""
    gap_s: float
    """Iteration time (s): slope of arrival time vs token index, pooled over the timed requests."""
    prompt_tokens: int
    window_tokens: int


@dataclass
class PrefillPoint:
    """One prefill batch beside the probe."""

    requests: int
    prefill_tokens: int
    """Sum of the batch's prompt tokens (server's count)."""
    attn_tokens2: float
    """Sum of squared prompt lengths (the attention term's regressor, tokens^2)."""
    excess_s: float
    """Extra time (s) the batch added: the step in the probe's tick times across it."""
    baseline_s: float
    iterations: int


class PromptMaker:
    """Unique prompts of a given server-side token length.

    Every prompt starts with a random nonce so no prefix-cache block is shared (vLLM
    caches by hash chains from the first block). ``ratio`` is server tokens per
    estimated token (4 UTF-8 bytes), set by :meth:`calibrate`.
    """

    def __init__(self) -> None:
        self.ratio = 1.0

    def make(self, tokens: int) -> str:
        """A prompt the server should count as about ``tokens`` tokens."""
        n_bytes = max(4, int(round(4 * tokens / self.ratio)))
        head = uuid.uuid4().hex[:12] + " "
        parts = [head]
        size = len(head)
        i = 0
        while size < n_bytes:
            w = _WORDS[i % len(_WORDS)] + " "
            parts.append(w)
            size += len(w)
            i += 1
        return "".join(parts)[:n_bytes]

    async def calibrate(self, client: ProfilerClient, model: str, tokens: int = 1000) -> int | None:
        """Ask the server how many tokens a ``tokens``-estimated-token prompt is; returns that count."""
        _, _, got = await client.complete(model, self.make(tokens), 1)
        if got:
            self.ratio = got / tokens
        return got


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    """Cancel ``tasks`` and wait for them, so a failed batch leaves nothing running."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class _Probe:
    """A long-running streamed request whose token times are the engine's iteration ends."""

    def __init__(self, client: ProfilerClient, model: str, prompt: str, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.times: list[float] = []
        self._ev = asyncio.Event()
        self._task = asyncio.create_task(client.stream(model, prompt, max_tokens, on_token=self._on))
        self._task.add_done_callback(lambda _t: self._ev.set())

    def _on(self, t: float) -> None:
        self.times.append(t)
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

    # ------------------------------------------------------------------ decode
    def decode_batches(self) -> list[tuple[int, int]]:
        """``(B, p)`` of the plan, with ``p`` shrunk (or the batch dropped) to fit the KV cache."""
        plan, cap = self.plan, self.info.kv_capacity_tokens
        out = []
        for p_plan in plan.decode_prompt_tokens:
            for b in plan.decode_batch_sizes:
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
        """Run every decode batch; one point per batch."""
        points: list[DecodePoint] = []
        n_out = self.plan.decode_output_tokens
        for b, p in self.decode_batches():
            before = await self.client.preemptions()
            recs = await self._decode_batch(b, p, n_out)
            what = f"decode batch B={b} p={p}"
            for r in recs:
                if len(r.token_s) != n_out or (r.completion_tokens is not None and r.completion_tokens != n_out):
                    raise ProfileRunError(f"--endpoint {self.client.base_url}: a request that asked for {n_out} "
                                          f"tokens got {r.completion_tokens or len(r.token_s)} (the server must honour "
                                          "max_tokens with ignore_eos, as vLLM does)")
            if not await self._check_preemptions(before, what):
                continue
            try:
                got = _decode_points(recs, b, p)
            except _Bunched as e:
                self.notes.append(f"{what} dropped: {e.share:.0%} of its tokens arrived in bursts (the server or "
                                  "this client could not keep pace; use smaller batches or a less loaded machine)")
                self.log(f"  {what}: tokens arrived in bursts, dropped")
                continue
            if not got:
                self.notes.append(f"{what} dropped: no steady window (every request decoding) of 12+ tokens")
                self.log(f"  {what}: no steady window, dropped")
                continue
            points.extend(got)
            self.log(f"  {what}: iteration {got[0].gap_s * 1e3:.3f} ms at {got[0].context_tokens:.0f} context tokens")
        return points

    async def _decode_batch(self, b: int, p: int, n_out: int) -> list[StreamRecord]:
        """``b`` concurrent streams; the first :data:`TRACERS` are timed throughout, the others
        for their first :data:`HELD_TOKENS` tokens (then read once the tracers are done)."""
        hold = asyncio.Event()
        model = self.info.model
        tasks = [asyncio.create_task(self.client.stream(model, self.prompts.make(p), n_out,
                                                        hold=None if i < TRACERS else hold,
                                                        hold_after=HELD_TOKENS))
                 for i in range(b)]
        try:
            await asyncio.gather(*tasks[:TRACERS])
            hold.set()
            return list(await asyncio.gather(*tasks))
        except BaseException:
            await _cancel_all(tasks)
            raise

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

    async def _prefill_once(self, probe: _Probe, n: int, L: int) -> "_Batch | str | None":
        """Send one batch between two quiet stretches of the probe; None if the probe ended."""
        q = self.plan.quiet_tokens
        before = await self._scrape_preemptions()
        if not await probe.wait_count(len(probe.times) + q):
            return None
        prompts = [self.prompts.make(L) for _ in range(n)]
        t_send = time.perf_counter()
        tasks = [asyncio.create_task(self.client.complete(self.info.model, pr, 1)) for pr in prompts]
        try:
            res = await asyncio.gather(*tasks)
        except BaseException:
            await _cancel_all(tasks)
            raise
        t_done = max(done for _, done, _ in res)
        times = probe.times
        if not await probe.wait_count(len(times) + q + 1):
            return None
        k_before = max(i for i in range(len(times)) if times[i] <= t_send)
        typical = statistics.median(np.diff(times[max(0, k_before - q):k_before + 1]))
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
        bounds = [(2, group[0].k_before)]  # ticks 0-1 carry the probe's own prefill
        bounds += [(group[j - 1].last, group[j].k_before) for j in range(1, len(group))]
        bounds.append((group[-1].last, len(times) - 1))
        # Ticks read while this client scraped /metrics (and the iteration after) are late
        # by the scrape's cost: leave them out.
        typical = float(np.median(np.diff(times[2:])))
        stalled = np.zeros(len(times), dtype=bool)
        for t0, t1 in self._stalls:
            stalled |= (times >= t0) & (times <= t1 + 1.5 * typical)
        idx, stretch = [], []
        for si, (a, b) in enumerate(bounds):
            for i in range(a, b + 1):
                if not stalled[i]:
                    idx.append(i)
                    stretch.append(si)
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
            points.append(pt)
            self.log(f"  prefill batch N={bt.requests} L={bt.length}: {pt.prefill_tokens} tokens, "
                     f"+{pt.excess_s * 1e3:.2f} ms over {pt.iterations} iteration(s) of {pt.baseline_s * 1e3:.2f} ms")
        return points


@dataclass
class _Batch:
    requests: int
    length: int
    tokens: list[int]
    k_before: int
    """Index of the probe's last tick before the batch was sent."""
    last: int
    """Index of the probe's tick that ended the batch's last iteration."""


def _decode_points(recs: list[StreamRecord], b: int, p: int) -> list[DecodePoint]:
    """The point of one decode batch: its steady window (every request decoding), or none.

    ``recs[:TRACERS]`` carry every token's time, the others their first few tokens' only.
    A request's token index at a given iteration is counted in the ticks (tokens) of
    the earliest-starting tracer, which produces one token per iteration.
    """
    tracers = recs[:TRACERS]
    ref = min(tracers, key=lambda r: r.token_s[0])
    ticks = np.asarray(ref.token_s)
    typical = float(np.median(np.diff(ticks[len(ticks) // 2:])))
    # Iteration (in ref's ticks) at which each request produced its first token.
    # A late timestamp can only move a token to a later tick, so the earliest placement
    # over its first few tokens is the most trustworthy.
    starts = [min(int(np.searchsorted(ticks, t - 0.5 * typical)) - k for k, t in enumerate(r.token_s[:HELD_TOKENS]))
              for r in recs]
    t_lo = max(r.token_s[0] for r in recs) + 1.5 * typical
    t_hi = min(r.token_s[-1] for r in tracers) - 1.5 * typical
    if t_hi - t_lo < 12 * typical:
        return []
    win = np.nonzero((ticks >= t_lo) & (ticks <= t_hi))[0]
    if len(win) < 8:
        return []
    xs, ys, bunched = [], [], []
    for r in tracers:
        ts = np.asarray(r.token_s)
        idx = np.nonzero((ts >= t_lo) & (ts <= t_hi))[0]
        if len(idx) < 8:
            return []
        bunched.append(float(np.mean(np.diff(ts[idx]) < 0.2 * typical)))
        xs.append(idx.astype(float))
        ys.append(ts[idx] - ts[idx].mean())
    if statistics.median(bunched) > 0.25:
        # Tokens came in bursts, not one per iteration: the server or this client fell
        # behind, and arrival times no longer show iteration times.
        raise _Bunched(statistics.median(bunched))
    # One slope, one intercept per tracer, at a low quantile of the arrival times.
    X = np.zeros((sum(len(x) for x in xs), len(xs) + 1))
    row = 0
    for k, x in enumerate(xs):
        X[row:row + len(x), k] = 1.0
        X[row:row + len(x), -1] = x - x.mean()
        row += len(x)
    gap = float(quantile_fit(X, np.concatenate(ys))[-1])
    # Token i (0-based) comes from the iteration whose context is prompt + i tokens; the
    # slope over a window is the iteration time at its mean index (times grow linearly).
    centre = float(win.mean())
    ctx = sum((r.prompt_tokens or p) + centre - s for r, s in zip(recs, starts))
    return [DecodePoint(b, ctx, gap, p, len(win))]


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


class _Bunched(Exception):
    def __init__(self, share: float) -> None:
        super().__init__(share)
        self.share = share
