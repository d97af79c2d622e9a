"""The emulator's real-time engines against the offline simulator and the profile's formulas.

No HTTP here: the engines run on an asyncio loop with a toy profile whose iterations
last a few milliseconds, and their token times (simulated time = the loop's clock)
are compared with independent expectations.
"""

from __future__ import annotations

import asyncio
import heapq
import time

import pytest
from conftest import toy_profile

from routerd.emulator.engine import FixedTimingEngine, SimEngine, TokenStream
from routerd.policies.base import PolicyContext
from routerd.policies.registry import build_policy
from routerd.sim import ClusterSimulator, SimInstance, SimRequest
from routerd.sim.request import DONE


class Recorder:
    """EngineObserver that keeps every token time per request."""

    def __init__(self) -> None:
        self.times: dict[int, list[float]] = {}
        self.ttft: list[float] = []
        self.gaps: list[float] = []
        self.e2e: list[float] = []

    def first_token(self, s: TokenStream, t: float) -> None:
        self.times.setdefault(s.id, []).append(t)
        self.ttft.append(t - s.arrival_s)

    def token(self, s: TokenStream, gap_s: float) -> None:
        self.times[s.id].append(self.times[s.id][-1] + gap_s)
        self.gaps.append(gap_s)

    def finished(self, s: TokenStream, t: float) -> None:
        self.e2e.append(t - s.arrival_s)


def _fast_profile(**kw):
    base = dict(overhead_s=0.004, prefill_per_token_s=5e-5, decode_per_seq_s=0.001,
                decode_per_ctx_token_s=1e-5, max_model_len=256, max_num_batched_tokens=256,
                kv_capacity_tokens=2048, max_num_seqs=8)
    base.update(kw)
    return toy_profile(**base)


def test_lone_request_token_times_follow_the_profile_formula():
    prof = _fast_profile()
    p, n = 40, 12
    rec = Recorder()

    async def main():
        eng = SimEngine(prof, rec)
        s = eng.submit(p, n)
        await s.wait_done()
        eng.close()
        return s

    s = asyncio.run(main())
    times = rec.times[s.id]
    assert len(times) == n and s.generated == n and s.done and not s.aborted
    # Independent expectation: prefill iteration, then one decode iteration per token
    # whose context is prompt + tokens so far (HardwareProfile docstring formula).
    expect = [s.arrival_s + prof.overhead_s + prof.prefill_per_token_s * p]
    for k in range(1, n):
        expect.append(expect[-1] + prof.overhead_s + prof.decode_per_seq_s + prof.decode_per_ctx_token_s * (p + k))
    assert times == pytest.approx(expect, abs=1e-9)
    assert s.finish_s == pytest.approx(s.arrival_s + prof.lone_request_time(p, n), abs=1e-9)


def _offline(prof, arrivals):
    """First-token and finish times of the offline cluster simulator (1 instance) for the same arrivals."""
    reqs = [SimRequest(i, a, p, n, None, float(n)) for i, (a, p, n) in enumerate(arrivals)]
    sim = ClusterSimulator(prof, 1, build_policy("round_robin", None, PolicyContext(prof, 1)))
    run = sim.run(reqs)
    return [(r.first_token_s, r.finish_s, r.preemptions) for r in run.requests], run.instances[0].preemptions


@pytest.mark.parametrize("kv_tokens", [2048, 160])
def test_concurrent_requests_match_the_offline_simulator(kv_tokens):
    # 160 KV tokens (10 blocks) force preemptions; 2048 none. Arrivals are staggered so
    # they land inside prefill steps and decode segments (segments get cut).
    prof = _fast_profile(kv_capacity_tokens=kv_tokens, max_model_len=96, max_num_batched_tokens=96)
    plan = [(0.0, 30, 40), (0.003, 50, 30), (0.011, 20, 45), (0.02, 60, 20), (0.021, 10, 50)]
    rec = Recorder()

    async def main():
        eng = SimEngine(prof, rec)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        streams = []
        for off, p, n in plan:
            await asyncio.sleep(max(0.0, t0 + off - loop.time()))
            streams.append(eng.submit(p, n))
        await asyncio.gather(*(s.wait_done() for s in streams))
        st = eng.stats()
        eng.close()
        return streams, st

    streams, st = asyncio.run(main())
    expected, preemptions = _offline(prof, [(s.arrival_s, s.prompt_tokens, s.max_tokens) for s in streams])
    for s, (ft, fin, _) in zip(streams, expected):
        assert s.first_token_s == pytest.approx(ft, abs=1e-9)
        assert s.finish_s == pytest.approx(fin, abs=1e-9)
        assert s.generated == s.max_tokens
        times = rec.times[s.id]
        assert len(times) == s.max_tokens and times == sorted(times)
    assert st.preemptions == preemptions
    assert (preemptions > 0) == (kv_tokens == 160)
    assert st.running == st.waiting == 0 and st.kv_usage == 0.0
    assert st.prompt_tokens == sum(p for _, p, _ in plan)
    assert st.generation_tokens == sum(n for _, _, n in plan)
    assert st.finished == {"length": len(plan), "abort": 0}


# ---------------------------------------------------------------- SimInstance.abort

class _Driver:
    """Minimal offline event loop around one SimInstance."""

    def __init__(self, prof) -> None:
        self.heap: list = []
        self.seq = 0
        self.finished: list[SimRequest] = []
        self.inst = SimInstance(0, prof, self._sched, lambda r, t: None, lambda r, t: self.finished.append(r))

    def _sched(self, t, inst):
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, inst.version))

    def run_until(self, t_end: float) -> float:
        now = 0.0
        while self.heap and self.heap[0][0] <= t_end:
            now, _, ver = heapq.heappop(self.heap)
            if ver == self.inst.version and self.inst.busy:
                self.inst.step_end(now)
        return now


def _assert_empty(inst: SimInstance) -> None:
    assert not inst.running and not inst.waiting and not inst.busy
    assert inst.free_blocks == inst.total_blocks
    assert inst.n_res == 0 and inst.n_dec == 0 and inst.n_prefill == 0 and inst.ctx_sum == 0
    assert inst.sum_pd == 0 and all(x == 0 for x in inst.phase) and inst.dec_hist == [0, 0, 0]
    assert inst.fT_static == pytest.approx(0) and inst.fT_W == pytest.approx(0)


@pytest.mark.parametrize("when", [0.0005, 0.02, 0.3])
def test_abort_frees_everything_and_the_others_finish(when):
    prof = toy_profile(kv_capacity_tokens=256, max_num_seqs=4)  # 16 blocks: preemption under load
    d = _Driver(prof)
    reqs = [SimRequest(i, 0.0, p, n, None, float(n)) for i, (p, n) in enumerate([(30, 40), (40, 30), (20, 40),
                                                                                  (50, 10), (10, 20)])]
    for r in reqs:
        d.inst.enqueue(r, 0.0)
    d.inst.start(0.0)
    d.run_until(when)
    states_before = {r.id: r.state for r in reqs}
    victims = [reqs[1], reqs[4]]  # one admitted first, one queued behind
    for v in victims:
        d.inst.abort(v, when)
    d.run_until(1e9)
    for v in victims:
        assert v.state == DONE
        if v.finish_s < 0:
            assert v not in d.finished
    survivors = [r for r in reqs if r not in victims]
    assert all(r in d.finished and r.generated == r.output for r in survivors)
    _assert_empty(d.inst)
    assert set(states_before) == {r.id for r in reqs}


def test_abort_while_idle_and_twice_is_harmless():
    prof = toy_profile()
    d = _Driver(prof)
    r = SimRequest(0, 0.0, 20, 5, None, 5.0)
    d.inst.enqueue(r, 0.0)  # not started yet: still waiting
    d.inst.abort(r, 0.0)
    d.inst.abort(r, 0.0)
    _assert_empty(d.inst)
    assert d.inst.free_blocks == d.inst.total_blocks


def test_engine_abort_mid_decode_releases_kv_at_the_next_step():
    prof = _fast_profile()

    async def main():
        eng = SimEngine(prof)
        a = eng.submit(40, 200)
        b = eng.submit(40, 8)
        await a.wait(3)
        before = eng.stats().kv_usage
        eng.abort(a)
        eng.abort(a)  # twice: no double count
        await b.wait_done()
        st = eng.stats()
        eng.close()
        return a, b, before, st

    a, b, before, st = asyncio.run(main())
    assert a.aborted and a.done and 3 < a.generated < 200
    assert b.generated == 8 and not b.aborted
    assert before > 0 and st.kv_usage == 0.0 and st.running == 0
    assert st.finished == {"length": 1, "abort": 1}


def test_fixed_timing_engine_ignores_load():
    prof = _fast_profile()
    rec = Recorder()
    ttft, tpot = 0.01, 0.002

    async def main():
        eng = FixedTimingEngine(ttft, tpot, prof, rec)
        streams = [eng.submit(10 + i, 5 + i) for i in range(20)]
        mid = eng.stats()
        eng.abort(streams[0])
        await asyncio.gather(*(s.wait_done() for s in streams))
        st = eng.stats()
        eng.close()
        return streams, mid, st

    streams, mid, st = asyncio.run(main())
    assert mid.running == 20 and mid.waiting == 0
    assert mid.kv_usage == pytest.approx(sum(prof.blocks_for(10 + i) for i in range(20)) / prof.num_blocks)
    assert streams[0].aborted and streams[0].generated == 0
    for s in streams[1:]:
        times = rec.times[s.id]
        expect = [s.arrival_s + ttft + k * tpot for k in range(s.max_tokens)]
        assert times == pytest.approx(expect, abs=1e-9)
    assert st.running == 0 and st.kv_usage == 0.0
    assert st.finished == {"length": 19, "abort": 1}
    assert st.generation_tokens == sum(5 + i for i in range(1, 20))


def test_a_timer_firing_early_never_stalls_the_engine():
    # uvloop rounds timers to milliseconds, so a tick may run up to 0.5 ms before its
    # deadline and apply that iteration at the deadline. A request arriving right after
    # (loop clock still before the deadline) must not cut the decode segment behind the
    # iteration already delivered: that once left the engine waiting forever.
    # Iterations of ~0.1 s: the test wakes after token 3 and fires the next tick by hand,
    # which must still be before that tick's deadline; a few ms of preemption on a loaded
    # machine cannot use up a whole iteration (issue 19).
    prof = _fast_profile(overhead_s=0.1)
    rec = Recorder()

    async def main():
        eng = SimEngine(prof, rec)
        loop = asyncio.get_running_loop()
        a = eng.submit(30, 12)
        await a.wait(3)  # decoding: a multi-iteration segment is in flight
        assert eng.inst.seg_K > 1
        deadline = eng._timer_t
        eng._timer.cancel()
        eng._timer = None
        eng._tick()  # fired "early": the loop clock is before the deadline
        assert loop.time() < deadline
        b = eng.submit(20, 4)
        # ~1.5 s of simulated work; a stalled engine never finishes.
        await asyncio.wait_for(asyncio.gather(a.wait_done(), b.wait_done()), 30)
        eng.close()
        return a, b

    a, b = asyncio.run(main())
    assert a.generated == 12 and b.generated == 4
    expected, _ = _offline(prof, [(a.arrival_s, 30, 12), (b.arrival_s, 20, 4)])
    assert [a.first_token_s, a.finish_s] == pytest.approx(expected[0][:2], abs=1e-9)
    assert [b.first_token_s, b.finish_s] == pytest.approx(expected[1][:2], abs=1e-9)


def test_a_late_loop_hands_the_sink_every_pending_token_at_once():
    # vLLM's RequestOutputCollector merges a request's outputs while its consumer is behind;
    # here a sink gets one call per engine callback. Blocking the loop for 0.2 s while
    # iterations last 5 ms (overhead 4 ms + 1 ms per sequence) leaves at least 0.2 / 0.005 -
    # 1 = 39 iterations due when it resumes: they reach the sink in one call.
    prof = _fast_profile()
    iteration_s = prof.overhead_s + prof.decode_per_seq_s + prof.decode_per_ctx_token_s * 200
    calls: list[int] = []

    async def main():
        eng = SimEngine(prof)
        s = eng.submit(20, 200)
        s.sink = calls.append
        while not calls:
            await asyncio.sleep(0)
        time.sleep(0.2)  # the loop is busy elsewhere: nothing is flushed meanwhile
        await s.wait_done()
        eng.close()
        return s

    s = asyncio.run(main())
    assert calls == sorted(set(calls)) and calls[-1] == s.generated == 200
    jumps = [b - a for a, b in zip(calls, calls[1:])]
    assert max(jumps) >= int(0.2 / iteration_s) - 1, jumps
