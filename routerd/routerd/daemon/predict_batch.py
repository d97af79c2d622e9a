"""Micro-batching of length predictions: requests that arrive together are predicted together.

The shipped n-gram predictor costs about 0.5 ms of CPU for one request alone but about
0.18 ms per request in a batch of 64 (``benchmarks/predictor_default_speed.py``): most of
a lone call is numpy's fixed cost per operation. Under load many requests are parsed in
the same event-loop iteration, so :class:`PredictionBatcher` collects the predictions
asked for during one iteration and runs them as one batch at its end (``call_soon``),
at most ``max_batch`` at a time. A request waits for at most the rest of the current
iteration. Blocking predictors (the transformer) run each batch in a worker thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

#: One pending prediction: (predictor, item, future of its bucket).
_Pending = tuple[Any, tuple, asyncio.Future]


class PredictionBatcher:
    """Batches ``predictor.predict`` calls made in one event-loop iteration.

    Args:
        is_blocking: whether a predictor must run off the event loop (a worker thread).
        max_batch: most items per ``predict`` call (64: the batch the speed target uses).
    """

    def __init__(self, is_blocking: Callable[[Any], bool], max_batch: int = 64):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._is_blocking = is_blocking
        self._max_batch = max_batch
        self._pending: list[_Pending] = []
        self._scheduled = False
        self.batches = 0
        """``predict`` calls made (for tests and metrics)."""

    async def predict(self, predictor: Any, item: tuple) -> int:
        """The bucket ``predictor`` gives ``item``; raises what ``predict`` raised for its batch."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append((predictor, item, fut))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return await fut

    def _flush(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, []
        # A reload may swap the predictor mid-iteration: each batch holds one predictor.
        groups: dict[int, list[_Pending]] = {}
        for p in pending:
            groups.setdefault(id(p[0]), []).append(p)
        for group in groups.values():
            for k in range(0, len(group), self._max_batch):
                chunk = [p for p in group[k: k + self._max_batch] if not p[2].done()]
                if chunk:
                    self._run(chunk)

    def _run(self, chunk: list[_Pending]) -> None:
        predictor = chunk[0][0]
        items = [p[1] for p in chunk]
        self.batches += 1
        if self._is_blocking(predictor):
            task = asyncio.ensure_future(asyncio.to_thread(predictor.predict, items))
            task.add_done_callback(lambda t: self._finished(chunk, t))
            return
        try:
            out = predictor.predict(items)
        except Exception as e:  # noqa: BLE001 - handed to every waiter, which routes without a prediction
            self._deliver(chunk, e, None)
            return
        self._deliver(chunk, None, out)

    def _finished(self, chunk: list[_Pending], task: asyncio.Future) -> None:
        """Hand a worker thread's result to the waiters (cancelled at shutdown: cancel them)."""
        if task.cancelled():
            for _, _, fut in chunk:
                fut.cancel()
            return
        err = task.exception()
        self._deliver(chunk, err, None if err is not None else task.result())

    @staticmethod
    def _deliver(chunk: list[_Pending], error: BaseException | None, out) -> None:
        if error is None and (out is None or len(out) != len(chunk)):
            error = RuntimeError(f"predictor returned {None if out is None else len(out)} buckets "
                                 f"for {len(chunk)} requests")
        for k, (_, _, fut) in enumerate(chunk):
            if fut.done():  # the request was cancelled (client gone) meanwhile
                continue
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(out[k])
