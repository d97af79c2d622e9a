"""routerd's garbage-collector pacing (routerd/routerd/daemon/collector.py): CPython's rule for
which generation is due, collections from the loop instead of inside callbacks, and the
collector given back at stop."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from routerd.daemon.collector import BACKSTOP, SUPPORTED, THRESHOLDS, CollectorPacer, due_generation

paced_only = pytest.mark.skipif(not SUPPORTED, reason="pacing applies to CPython 3.11-3.13's collector")

T = (700, 10, 10)  # CPython's default thresholds


@pytest.mark.parametrize(
    ("counts", "want"),
    [
        ((0, 0, 0), None),
        ((700, 50, 50), None),  # the young count must exceed its threshold (">" in gcmodule.c)
        ((701, 0, 0), 0),
        ((701, 10, 0), 0),  # 10 is not past 10
        ((701, 11, 0), 1),
        ((701, 11, 11), 2),  # the oldest due generation wins
        ((701, 3, 11), 2),
        ((5_000, 10, 10), 0),
    ],
)
def test_due_generation_is_the_oldest_past_its_threshold_once_the_young_one_is(counts, want):
    assert due_generation(counts, T) == want


class Node:
    def __init__(self) -> None:
        self.other = self  # a cycle: only the collector frees it


@paced_only
def test_paced_collection_frees_cycles_from_the_loop_and_gives_the_collector_back():
    before = (gc.get_threshold(), gc.isenabled())

    async def main() -> tuple[bool, int, list[int]]:
        pacer = CollectorPacer(thresholds=(200, 2, 2), interval_s=0.001)
        pacer.start()
        try:
            # CPython's own collector stays on, as a backstop BACKSTOP times further away.
            assert gc.isenabled() and gc.get_threshold() == (BACKSTOP * 200, 2, 2)
            garbage = Node()
            ref = weakref.ref(garbage)
            del garbage
            # Nothing collects it inside this callback while it makes fewer containers than the
            # backstop...
            keep = [[k] for k in range(500)]
            assert ref() is not None
            for _ in range(200):  # ...the pacer's callback does, once the young count is due
                keep.extend([k] for k in range(300))  # survivors: the young count grows
                await asyncio.sleep(0.002)
                if ref() is None:
                    break
            return ref() is None, sum(pacer.collections), list(pacer.collections)
        finally:
            await pacer.stop()

    try:
        freed, n, per_gen = asyncio.run(main())
        assert freed
        assert n >= 1 and per_gen[0] >= 1
        assert (gc.get_threshold(), gc.isenabled()) == before
    finally:
        gc.set_threshold(*before[0])
        gc.enable() if before[1] else gc.disable()


def test_older_generations_are_collected_at_their_counts():
    # With thresholds (young, 2, 2) a middle collection comes once 3 young ones have run (its count
    # must pass 2) and an oldest one once 3 middle ones have: CPython's counting (each collection
    # adds one to the next generation's count and zeroes its own and the younger ones').
    pacer = CollectorPacer(thresholds=(50, 2, 2))
    was = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        gens = []
        keep = []
        while len(gens) < 13 and len(keep) < 100_000:
            keep.append([len(keep)])  # survivors: the young count only grows
            g = pacer.collect_if_due()
            if g is not None:
                gens.append(g)
        assert gens == [0, 0, 0, 1] * 3 + [2]  # the oldest, at the next young collection due
    finally:
        if was:
            gc.enable()


def test_routerd_thresholds_keep_the_young_generation_above_a_long_prompts_containers():
    # An 8K-token prompt in precise mode is 513 tuples; CPython's default young threshold (700)
    # would collect inside almost every such request.
    assert THRESHOLDS[0] >= 20 * 513 and THRESHOLDS[1] > 1 and THRESHOLDS[2] > 1


def test_young_and_middle_collections_come_where_cpythons_own_collector_puts_them():
    # The independent source: CPython's automatic collector at the same thresholds, on the same
    # allocations, observed through gc.callbacks (the oldest generation is left out: CPython
    # also waits for its long-lived objects to grow by a quarter, which Python cannot see).
    def run(paced: bool) -> list[int]:
        gens: list[int] = []
        saved = gc.get_threshold()

        def seen(phase, info):
            if phase == "start":
                gens.append(info["generation"])

        pacer = CollectorPacer(thresholds=(50, 2, 2))
        gc.collect()
        gc.set_threshold(50, 2, 2)
        if paced:
            gc.disable()
        else:
            gc.enable()
        gc.callbacks.append(seen)
        keep = []
        try:
            while len(gens) < 12 and len(keep) < 100_000:
                keep.append([len(keep)])
                if paced:
                    pacer.collect_if_due()
        finally:
            gc.callbacks.remove(seen)
            gc.set_threshold(*saved)
            gc.enable()
        return gens[:12]

    assert run(paced=True) == run(paced=False) == [0, 0, 0, 1] * 3


@paced_only
def test_overlapping_pacers_give_back_the_first_ones_settings_and_a_blocked_loop_has_the_backstop():
    before = (gc.get_threshold(), gc.isenabled())
    gens: list[int] = []

    def seen(phase, info):
        if phase == "start":
            gens.append(info["generation"])

    async def main() -> None:
        a, b = CollectorPacer(thresholds=(300, 5, 5)), CollectorPacer(thresholds=(300, 5, 5))
        a.start()
        b.start()
        await a.stop()  # b still runs: the collector stays paced
        assert gc.get_threshold() == (BACKSTOP * 300, 5, 5)
        # The loop blocked in one callback, allocating: CPython's collector still runs, at the
        # backstop (more than BACKSTOP * 300 new containers), never at the paced 300.
        gc.callbacks.append(seen)
        try:
            keep = []
            for k in range(BACKSTOP * 300 + 50):
                keep.append([k])
                if k == BACKSTOP * 300 - 50:
                    assert gens == []
        finally:
            gc.callbacks.remove(seen)
        assert gens and gens[0] == 0
        await b.stop()

    try:
        asyncio.run(main())
        assert (gc.get_threshold(), gc.isenabled()) == before
    finally:
        gc.set_threshold(*before[0])
        gc.enable() if before[1] else gc.disable()
