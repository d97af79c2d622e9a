"""PredictionBatcher: one predict call per event-loop iteration, errors and cancellations."""

from __future__ import annotations

import asyncio
import threading

import pytest

from routerd.daemon.predict_batch import PredictionBatcher


class Recorder:
    def __init__(self, fail: bool = False, short: bool = False):
        self.calls: list[list] = []
        self.threads: list[str] = []
        self.fail, self.short = fail, short

    def predict(self, items):
        self.calls.append(list(items))
        self.threads.append(threading.current_thread().name)
        if self.fail:
            raise ValueError("boom")
        out = [len(p or "") % 4 for p, _, _ in items]
        return out[:-1] if self.short else out


def run(coro):
    return asyncio.run(coro)


def test_requests_of_one_iteration_share_one_call_in_order():
    rec = Recorder()
    b = PredictionBatcher(lambda p: False, max_batch=3)

    async def main():
        items = [("x" * k, k, None) for k in range(7)]
        got = await asyncio.gather(*(b.predict(rec, it) for it in items))
        later = await b.predict(rec, ("yy", 2, None))
        return got, later

    got, later = run(main())
    assert got == [k % 4 for k in range(7)] and later == 2
    # 7 in one iteration at most 3 per call -> 3 calls, then 1 for the later request.
    assert [len(c) for c in rec.calls] == [3, 3, 1, 1] and b.batches == 4
    assert [c[0] for call in rec.calls for c in call] == ["x" * k for k in range(7)] + ["yy"]
    assert set(rec.threads) == {threading.main_thread().name}


def test_a_failing_or_short_predictor_fails_every_waiter_of_its_batch():
    for rec, exc in ((Recorder(fail=True), ValueError), (Recorder(short=True), RuntimeError)):
        b = PredictionBatcher(lambda p: False)

        async def main():
            return await asyncio.gather(*(b.predict(rec, ("a", 1, None)) for _ in range(3)), return_exceptions=True)

        out = run(main())
        assert all(isinstance(e, exc) for e in out), out


def test_blocking_predictors_run_in_a_thread_and_predictors_are_not_mixed():
    slow, other = Recorder(), Recorder()
    b = PredictionBatcher(lambda p: p is slow)

    async def main():
        return await asyncio.gather(b.predict(slow, ("ab", 1, None)), b.predict(other, ("abc", 1, None)),
                                    b.predict(slow, ("a", 1, None)))

    assert run(main()) == [2, 3, 1]
    assert [len(c) for c in slow.calls] == [2] and [len(c) for c in other.calls] == [1]
    assert slow.threads[0] != threading.main_thread().name
    assert other.threads[0] == threading.main_thread().name


def test_a_cancelled_waiter_is_skipped():
    rec = Recorder()
    b = PredictionBatcher(lambda p: False)

    async def main():
        t1 = asyncio.ensure_future(b.predict(rec, ("gone", 1, None)))
        t2 = asyncio.ensure_future(b.predict(rec, ("kept", 1, None)))
        await asyncio.sleep(0)  # both enqueued; the flush is scheduled
        t1.cancel()
        return await t2, t1

    kept, t1 = run(main())
    assert kept == 0 and t1.cancelled()
    assert [c[0] for call in rec.calls for c in call] == ["kept"]


def test_max_batch_must_be_positive():
    with pytest.raises(ValueError, match="max_batch"):
        PredictionBatcher(lambda p: False, max_batch=0)


def test_a_blocking_batch_failing_in_its_thread_fails_its_waiters():
    rec = Recorder(fail=True)
    b = PredictionBatcher(lambda p: True)

    async def main():
        return await asyncio.gather(b.predict(rec, ("a", 1, None)), b.predict(rec, ("b", 1, None)),
                                    return_exceptions=True)

    out = run(main())
    assert all(isinstance(e, ValueError) for e in out) and rec.threads[0] != threading.main_thread().name
