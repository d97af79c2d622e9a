"""The cyclic garbage collector, run between routerd's event-loop callbacks instead of inside them.

CPython collects a generation when an allocation pushes the count of new container objects past
its threshold, so a young-generation collection lands inside whatever code allocates at that
moment: often a routing decision. With the prefix index a request's prompt is a few hundred
tuples (an 8K-token prompt in precise mode: 513, one per 16-token block), and at routerd's
thresholds a young collection scans about 20,000 survivors: 1-2 ms, inside a decision whose own
cost is 20-40 us (``benchmarks/prefix_decision_cost.py``, session 27: precise ``phasewise`` on 8
instances, 8K tokens, p99 77 us with CPython's default collector, 63 us with none during the
picks). :class:`CollectorPacer` turns automatic collection off and runs the same collections, at
the same thresholds, from a timer on the event loop, so a collection is a callback of its own
between others (a decision is one synchronous callback, so it never contains one).

The rule is CPython's own (``Modules/gcmodule.c``, ``collect_generations``): collect the oldest
generation whose count has passed its threshold, where generation 0's count is container
allocations less deallocations and generation ``i``'s is collections of generation ``i - 1``
since its last collection. CPython's extra condition for the oldest generation (only once the
objects waiting for it are a quarter of those it holds) is not visible from Python, so that
generation is collected on its count alone: at most once per ``t1 * t2`` young collections
(400 at routerd's thresholds).

CPython's own collector stays on as a backstop, with a young threshold :data:`BACKSTOP` times
the paced one: it acts only when the loop has not run the timer for that long (a blocked loop
while other threads allocate). Python 3.14's collector is incremental (``gc.collect(1)`` is an
increment, not a generation), so there the pacer leaves collection to CPython.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys

log = logging.getLogger("routerd")

#: routerd's thresholds: a young collection every 20,000 net new containers (CPython's default,
#: 700, is 1-2 requests with long prompts), the middle one every 20 of those, the oldest every 20
#: middle ones.
THRESHOLDS = (20_000, 20, 20)
#: How often the loop looks at the counts (s). Between two looks a busy routerd makes some
#: thousands of containers (300 req/s of 8K-token precise prompts, 513 tuples each, is 8,000 in
#: 50 ms), well under the backstop's 100,000, so CPython's collector stays idle. The timer's own
#: cost at 5 ms was 0.8% of routerd's CPU at 128 streams (py-spy, session 27); at 50 ms a tenth.
INTERVAL_S = 0.05
#: CPython's automatic collector stays on with this many times the paced young threshold.
BACKSTOP = 5
#: Whether pacing applies: CPython 3.11-3.13's generational collector (3.14's is incremental).
SUPPORTED = (3, 11) <= sys.version_info[:2] < (3, 14)

_active = 0
"""Pacers started and not stopped, process-wide (the collector is one per process)."""
_saved: tuple[tuple[int, int, int], bool] | None = None
"""The collector's settings before the first pacer started, given back when the last stops."""


def due_generation(counts: tuple[int, int, int], thresholds: tuple[int, int, int]) -> int | None:
    """The generation CPython would collect now, or None when no count has passed its threshold.

    ``counts``: ``gc.get_count()``; ``thresholds``: ``gc.get_threshold()`` form. A generation
    counts as due when its count exceeds its threshold, as in ``collect_generations``; the young
    generation must be due first (older counts only grow by young collections)."""
    if counts[0] <= thresholds[0]:
        return None
    for gen in (2, 1):
        if counts[gen] > thresholds[gen]:
            return gen
    return 0


class CollectorPacer:
    """Automatic collection off, the same collections from a timer task on the running loop.

    :meth:`start` collects everything once, freezes what survives (the modules, settings and
    policy made at start-up live as long as the process: ``gc.freeze`` moves them out of every
    later scan), raises CPython's own young threshold to the backstop and starts the timer;
    :meth:`stop` ends the timer, and the last pacer to stop gives back the collector's settings
    as the first one found them. ``collections[g]`` counts the collections of generation ``g``
    it ran. Outside CPython 3.11-3.13 (:data:`SUPPORTED`) both do nothing.
    """

    def __init__(self, thresholds: tuple[int, int, int] = THRESHOLDS, interval_s: float = INTERVAL_S) -> None:
        self.thresholds = thresholds
        self.interval_s = interval_s
        self.collections = [0, 0, 0]
        self._task: asyncio.Task | None = None

    def collect_if_due(self) -> int | None:
        """Collect the due generation (:func:`due_generation`) now; the generation, or None."""
        gen = due_generation(gc.get_count(), self.thresholds)
        if gen is not None:
            gc.collect(gen)
            self.collections[gen] += 1
        return gen

    def start(self) -> None:
        """Collect, freeze, turn automatic collection off and start the timer (on the running loop).

        Raises RuntimeError when no event loop is running."""
        global _active, _saved
        loop = asyncio.get_running_loop()
        if self._task is not None or not SUPPORTED:
            return
        gc.collect()
        gc.freeze()
        if _active == 0:
            _saved = (gc.get_threshold(), gc.isenabled())
        _active += 1
        t0, t1, t2 = self.thresholds
        gc.set_threshold(BACKSTOP * t0, t1, t2)
        gc.enable()
        self._task = loop.create_task(self._run(), name="routerd-gc-pacer")
        self._task.add_done_callback(self._ended)

    @staticmethod
    def _ended(task: asyncio.Task) -> None:
        if not task.cancelled():
            log.error("garbage collection pacing stopped (%r); CPython's collector runs alone at the backstop "
                      "threshold", task.exception())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.collect_if_due()
            except Exception:  # a finalizer that raises must not end pacing: collection would stop
                log.exception("garbage collection failed")

    async def stop(self) -> None:
        """Stop the timer and give collection back to CPython (its thresholds as found at start)."""
        global _active, _saved
        task, self._task = self._task, None
        if task is None:
            return
        task.remove_done_callback(self._ended)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        _active -= 1
        if _active == 0 and _saved is not None:
            thresholds, enabled = _saved
            _saved = None
            gc.set_threshold(*thresholds)
            gc.enable() if enabled else gc.disable()
