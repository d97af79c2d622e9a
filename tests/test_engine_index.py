"""routerd.prefix.engine_index: one engine's cache from its KV events, by hand and against a set model.

Block size 4 throughout; blocks A, B, C, D are 4 token ids each. Requests are keyed the way routerd
keys them (token_prefix_blocks); events carry arbitrary engine hashes (vLLM's are seeded per process),
so a hit can only come from the index's own hash -> key mapping.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from routerd.prefix.engine_index import DROP_CAUSES, RECOVERY_CAUSES, STALE_REASONS, EngineBlockIndex
from routerd.prefix.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from routerd.prefix.text import byte_token_array, token_prefix_blocks

BS = 4
A, B, C, D = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]


def req(*blocks, tail=()):
    """A request's prefix: the given blocks' tokens (plus a partial tail, never a block)."""
    return token_prefix_blocks([t for b in blocks for t in b] + list(tail), BS)


def stored(hashes, parent, *blocks, **kw):
    return BlockStored(list(hashes), parent, [t for b in blocks for t in b], kw.pop("block_size", BS), **kw)


class Feed:
    """An index plus the publisher's side: numbered batches, like one vLLM process."""

    def __init__(self, **kw):
        kw.setdefault("stale_after_s", None)
        self.idx = EngineBlockIndex(BS, **kw)
        self.seq = 0
        self.ts = 1000.0

    def send(self, *events, seq=None):
        if seq is not None:
            self.seq = seq
        self.ts += 1.0
        self.idx.apply(EventBatch(self.ts, list(events), 0), self.seq)
        self.seq += 1


def fresh(**kw) -> Feed:
    f = Feed(**kw)
    f.send()  # seq 0: an engine that just started, its cache empty
    assert f.idx.stale_reason is None
    return f


# --- keying and lookups ---------------------------------------------------------------------------


def test_a_stored_chain_is_found_as_the_leading_blocks_of_a_request():
    f = fresh()
    f.send(stored([101, 102], None, A, B))
    f.send(stored([103], 102, C))  # C's parent is B (engine hash 102)
    ix = f.idx
    assert ix.cached_blocks(req(A, B, C)) == 3
    assert ix.cached_blocks(req(A, B, C, D)) == 3
    assert ix.cached_blocks(req(A, B, C, tail=[99, 98])) == 3  # a partial tail is no block
    assert ix.cached_blocks(req(A, B, D)) == 2
    assert ix.cached_blocks(req(A, D, C)) == 1  # C after D is another block than C after B
    assert ix.cached_blocks(req(B, C)) == 0  # B at the start is not B after A
    assert ix.cached_blocks(req()) == 0
    assert ix.cached_blocks(None) == 0
    assert (ix.size, ix.num_keys, ix.batches_applied) == (3, 3, 3)


def test_a_removed_block_ends_the_run_even_if_later_blocks_remain():
    f = fresh()
    f.send(stored([101, 102, 103], None, A, B, C))
    assert f.idx.orphans == 0
    f.send(BlockRemoved([102]))
    assert f.idx.orphans == 1  # C is held without B: lookups walk
    assert f.idx.cached_blocks(req(A, B, C)) == 1
    f.send(BlockRemoved([101, 555]))  # 555 was never stored
    assert f.idx.cached_blocks(req(A, B, C)) == 0
    assert f.idx.removed_unknown == 1
    assert f.idx.size == 1 and f.idx.num_keys == 1  # C stays until its own removal
    f.send(BlockRemoved([103]))
    assert f.idx.size == 0 and f.idx.num_keys == 0 and f.idx.orphans == 0


def test_long_prompts_bisect_and_walk_to_the_same_answers():
    blocks = [[i, i + 1, i + 2, i + 3] for i in range(0, 4 * 600, 4)]  # 600 blocks
    f = fresh()
    f.send(stored(range(1, 601), None, *blocks))
    q = req(*blocks)
    assert f.idx.cached_blocks(q) == 600 and f.idx.orphans == 0
    f.send(BlockRemoved(list(range(401, 601))))  # tail first, as vLLM evicts: still no orphan
    assert f.idx.orphans == 0
    for k in (1, 2, 399, 400, 401, 600):
        assert f.idx.cached_blocks(req(*blocks[:k])) == min(k, 400), k
    f.send(BlockRemoved([100]))  # a hole: blocks 100 .. 399 held without block 99
    assert f.idx.orphans == 1
    assert f.idx.cached_blocks(q) == 99 and f.idx.cached_blocks(req(*blocks[:50])) == 50
    f.send(stored([100], 99, blocks[99]))  # the hole refilled
    assert f.idx.orphans == 0 and f.idx.cached_blocks(q) == 400


def test_one_prompt_asked_of_several_engines_answers_as_the_walk_whatever_the_answers_before():
    # A decision asks every candidate's engine about the same prompt, the answers before being
    # the next one's hints (right, too short or too long): every answer equals the linear walk.
    import random

    rng = random.Random(3)
    blocks = [[i, i + 1, i + 2, i + 3] for i in range(0, 4 * 300, 4)]
    feeds = []
    for held in (0, 1, 7, 150, 150, 151, 299, 300, 42, 150):  # leading blocks each engine holds
        f = fresh()
        if held:
            f.send(stored(range(1, held + 1), None, *blocks[:held]))
        feeds.append((f, held))
    for _ in range(60):
        n = rng.randrange(1, 301)
        q = req(*blocks[:n])
        for f, held in rng.sample(feeds, len(feeds)):
            keys = f.idx._keys
            walk = next((j for j, (k, _) in enumerate(q.extents) if k not in keys), n)
            assert walk == min(held, n)
            assert f.idx.cached_blocks(q) == walk, (n, held)


def test_copies_of_one_hash_and_hashes_sharing_a_key_are_counted():
    f = fresh()
    # Two requests computed A in one step: two physical blocks with one hash (vLLM does not de-duplicate).
    f.send(stored([101], None, A), stored([101], None, A))
    # Another engine hash for the same tokens (e.g. stored under another hash seed): the same key.
    f.send(stored([201], None, A))
    key = req(A).extents[0][0]
    assert f.idx.key_count(key) == 3 and f.idx.size == 2
    f.send(BlockRemoved([101]))
    assert f.idx.cached_blocks(req(A)) == 1
    f.send(BlockRemoved([101]))
    assert f.idx.cached_blocks(req(A)) == 1 and f.idx.key_count(key) == 1
    f.send(BlockRemoved([201]))
    assert f.idx.cached_blocks(req(A)) == 0 and f.idx.size == 0


def test_the_emulators_byte_tokens_key_like_a_request_of_the_same_text():
    text = "You are a helpful assistant. " * 4 + "What is the capital of France?"
    ids = byte_token_array(text).tolist()
    n = len(ids) // 16
    f = Feed()
    f.idx = EngineBlockIndex(16, stale_after_s=None)
    f.send()
    f.send(BlockStored(list(range(1000, 1000 + n)), None, ids[: n * 16], 16))
    pb = token_prefix_blocks(byte_token_array(text + " And of Spain?"), 16)
    assert n >= 2 and pb.num_blocks >= n and f.idx.cached_blocks(pb) == n


def test_events_that_cannot_be_keyed_are_dropped_and_counted():
    f = fresh()
    f.send(stored([101, 102], 999, A, B))  # parent never seen
    f.send(stored([103], None, A, block_size=8))  # not routerd's block size (8 tokens would be needed anyway)
    f.send(stored([104], None, A, B))  # 8 token ids for one block of 4
    f.send(BlockStored([105], None, [1, 2, 3, 2**32], BS))  # a token id no uint32 holds
    d = f.idx.dropped_blocks
    assert (d["unknown_parent"], d["block_size"], d["token_count"], d["token_range"]) == (2, 1, 1, 1)
    assert f.idx.size == 0 and f.idx.cached_blocks(req(A)) == 0  # 4 unkeyed of 4 < 8 allowed: still fresh


def test_other_media_and_groups_are_ignored_lora_and_extra_keys_never_match_plain_requests():
    f = fresh()
    f.send(stored([101], None, A, medium="CPU"), stored([102], None, A, group_idx=1))
    assert f.idx.size == 0 and f.idx.dropped_blocks["medium"] == 1 and f.idx.dropped_blocks["group"] == 1
    f.send(stored([103], None, A, lora_name="sql-adapter"), stored([104], 103, B, lora_name="sql-adapter"))
    f.send(stored([105], None, A, extra_keys=[("salt-xyz",)]), stored([106], 105, B))
    assert f.idx.size == 4 and f.idx.num_keys == 4  # four distinct keys: A, B under LoRA; A, B salted
    assert f.idx.cached_blocks(req(A, B)) == 0
    f.send(stored([107], None, A, medium="gpu"))  # the device cache, any case
    assert f.idx.cached_blocks(req(A, B)) == 1
    f.send(BlockRemoved([107], medium="CPU"))  # another tier's eviction leaves the GPU copy
    assert f.idx.cached_blocks(req(A, B)) == 1


def test_a_hash_stored_again_with_other_content_replaces_the_old_key():
    f = fresh()
    f.send(stored([101], None, A))
    f.send(stored([101], None, B))
    assert f.idx.hash_conflicts == 1 and f.idx.size == 1
    assert f.idx.cached_blocks(req(A)) == 0 and f.idx.cached_blocks(req(B)) == 1


# --- the memory bound -------------------------------------------------------------------------------


def test_at_the_bound_the_oldest_stored_block_is_forgotten():
    f = fresh(max_blocks=3)
    f.send(stored([1], None, A))
    f.send(stored([2], 1, B))
    f.send(stored([3], 2, C))
    f.send(stored([1], None, A))  # a second copy of A: moves A to the newest end, adds no entry
    f.send(stored([4], 3, D))  # the bound: forgets B (oldest stored), not A
    ix = f.idx
    assert ix.size == 3 and ix.dropped_blocks["bound"] == 1
    assert ix.cached_blocks(req(A, B, C, D)) == 1
    assert ix.cached_blocks(req(A)) == 1
    f.send(stored([5], 2, D))  # child of the forgotten B: unknown parent now
    assert ix.dropped_blocks["unknown_parent"] == 1


def test_a_flood_of_unique_blocks_stays_within_the_bound():
    f = fresh(max_blocks=100, max_unkeyed_fraction=1.0)
    for i in range(2000):
        f.send(BlockStored([10_000 + i], None, [i, i + 1, i + 2, i + 3], BS))
    ix = f.idx
    assert ix.size == 100 and ix.num_keys == 100 and ix.dropped_blocks["bound"] == 1900
    assert ix.cached_blocks(token_prefix_blocks([1999, 2000, 2001, 2002], BS)) == 1  # the newest stays
    assert ix.cached_blocks(token_prefix_blocks([0, 1, 2, 3], BS)) == 0


# --- staleness and recovery -------------------------------------------------------------------------


def test_before_any_batch_the_index_is_stale_and_a_seq_0_batch_makes_it_exact():
    f = Feed()
    assert f.idx.stale_reason == "no_events" and f.idx.cached_blocks(req(A)) is None
    assert f.idx.stale_answers == 1
    f.send(stored([101], None, A))
    assert f.idx.stale_reason is None and f.idx.cached_blocks(req(A)) == 1
    assert f.idx.recoveries["fresh_start"] == 1 and sum(f.idx.stale_transitions.values()) == 0


def test_joining_a_running_publisher_is_stale_until_stored_events_settle():
    f = Feed(settle_events=4)
    f.send(stored([101], None, A), seq=7)  # first batch seen: 7
    assert f.idx.stale_reason == "late_join" and f.idx.cached_blocks(req(A)) is None
    f.send(stored([102], 101, B))  # 2 clean stored events so far (A, B)
    f.send(stored([201], 555, C))  # a block after one we never saw: resets the run
    f.send(stored([103], 102, C), stored([104], 103, D))
    f.send(stored([301], None, D))
    assert f.idx.stale_reason == "late_join"  # 3 clean since the unkeyed one
    f.send(stored([302], 301, A))
    assert f.idx.stale_reason is None and f.idx.recoveries["settled"] == 1
    assert f.idx.cached_blocks(req(A, B, C, D)) == 4


def test_a_sequence_gap_clears_and_marks_stale_then_all_blocks_cleared_makes_it_exact():
    f = fresh()
    f.send(stored([101], None, A))  # seq 1
    f.send(BlockRemoved([999]), seq=5)  # 2, 3, 4 were lost (one may have removed A)
    ix = f.idx
    assert ix.stale_reason == "gap" and ix.batches_missed == 3 and ix.stale_transitions["gap"] == 1
    assert ix.size == 0  # no phantom A
    f.send(AllBlocksCleared(), stored([102], None, B))
    assert ix.stale_reason is None and ix.recoveries["cleared"] == 1
    assert ix.cached_blocks(req(B)) == 1 and ix.cached_blocks(req(A)) == 0


def test_a_duplicated_batch_is_ignored():
    f = fresh()
    batch = EventBatch(5.0, [stored([101], None, A)], 0)
    f.idx.apply(batch, 1)
    f.idx.apply(batch, 1)  # the same batch again: would add a second copy if applied
    f.idx.apply(EventBatch(6.0, [BlockRemoved([101])], 0), 2)
    assert f.idx.batches_duplicate == 1 and f.idx.cached_blocks(req(A)) == 0
    assert f.idx.stale_reason is None


def test_a_publisher_restart_is_detected_from_the_sequence_going_back():
    f = fresh()
    f.send(stored([101], None, A))
    f.send(stored([102], 101, B))  # seq 2
    f.send(stored([201], None, C), seq=0)  # a new process: empty cache, numbered from 0 again
    ix = f.idx
    assert ix.restarts == 1 and ix.stale_reason is None
    assert ix.cached_blocks(req(A)) == 0 and ix.cached_blocks(req(C)) == 1
    f.send(stored([301], None, D), seq=0)  # restarted again after only one batch: seq 0 again, a new ts
    assert ix.restarts == 2 and ix.cached_blocks(req(C)) == 0 and ix.cached_blocks(req(D)) == 1
    f.send(stored([501], None, A), seq=1)
    f.send(stored([502], None, B), seq=2)
    f.send(stored([601], None, C), seq=1)  # back to 1: a new publisher whose seq 0 we missed
    assert ix.restarts == 3 and ix.stale_reason == "restart" and ix.stale_transitions["restart"] == 1
    assert ix.size == 1  # cleared, then C


def test_a_malformed_message_clears_and_keeps_the_sequence():
    f = fresh()
    f.send(stored([101], None, A))  # seq 1
    f.idx.record_malformed(2)
    ix = f.idx
    assert ix.stale_reason == "malformed" and ix.batches_malformed == 1 and ix.size == 0
    f.send(stored([102], None, B), seq=3)  # in sequence after the malformed seq 2: no gap
    assert ix.stale_reason == "malformed" and ix.batches_missed == 0
    f.idx.record_malformed(None)  # frames we could not even number
    assert ix.batches_malformed == 2 and ix.stale_transitions["malformed"] == 1  # one transition


def test_too_many_unkeyed_stored_events_in_the_window_mark_stale_without_clearing():
    f = fresh(settle_events=8, max_unkeyed_fraction=0.25)  # stale above 2 of the last 8
    f.send(stored([101], None, A))
    f.send(stored([201], 900, B), stored([202], 901, B))
    assert f.idx.stale_reason is None
    f.send(stored([203], 902, B))
    assert f.idx.stale_reason == "unkeyed" and f.idx.stale_transitions["unkeyed"] == 1
    assert f.idx.size == 1  # what it had stays: it is incomplete, not wrong
    for i in range(7):
        f.send(stored([300 + i], None, [20 + i] * 4))
    assert f.idx.stale_reason == "unkeyed"
    f.send(stored([400], None, C))  # 8 clean in a row
    assert f.idx.stale_reason is None and f.idx.recoveries["settled"] == 1
    assert f.idx.cached_blocks(req(A)) == 1


def test_silence_after_a_dispatch_marks_stale_and_the_next_batch_in_sequence_resumes():
    now = [100.0]
    f = fresh(stale_after_s=10.0, clock=lambda: now[0])
    f.send(stored([101], None, A))
    ix = f.idx
    ix.note_dispatch(0)  # fully cached: nothing to store, no clock started
    now[0] += 60.0
    assert ix.cached_blocks(req(A)) == 1
    ix.note_dispatch(3)
    now[0] += 9.0
    ix.note_dispatch(2)  # the clock runs from the first unanswered dispatch
    assert ix.cached_blocks(req(A)) == 1
    now[0] += 1.0
    assert ix.cached_blocks(req(A)) is None and ix.stale_reason == "silent"
    assert ix.stale_transitions["silent"] == 1
    f.send(stored([102], 101, B))
    assert ix.stale_reason is None and ix.recoveries["resumed"] == 1
    assert ix.cached_blocks(req(A, B)) == 2
    ix.note_dispatch(1)
    now[0] += 30.0
    assert ix.check() == "silent"
    f.send(seq=10)  # the publisher was gone and batches were lost: a gap, not a resume
    assert ix.stale_reason == "gap" and ix.recoveries["resumed"] == 1
    assert ix.stale_transitions["gap"] == 0  # it was already stale


def test_an_engine_seen_down_is_cleared_and_stale_until_its_restart_numbers_from_0():
    f = fresh()
    f.send(stored([101, 102], None, A, B))
    assert f.idx.cached_blocks(req(A, B)) == 2
    f.idx.engine_down()  # routerd's connect to it failed
    assert (f.idx.stale_reason, f.idx.size, f.idx.cached_blocks(req(A, B))) == ("engine_down", 0, None)
    assert f.idx.stale_transitions["engine_down"] == 1
    f.send(seq=0)  # the restarted process's first batch: its cache is empty, the index exact
    assert f.idx.stale_reason is None and f.idx.cached_blocks(req(A, B)) == 0
    f.send(stored([201], None, A))
    assert f.idx.cached_blocks(req(A, B)) == 1


def test_counters_cover_every_reason_cause_and_drop_from_the_start():
    ix = EngineBlockIndex()
    assert set(ix.stale_transitions) == set(STALE_REASONS)
    assert set(ix.recoveries) == set(RECOVERY_CAUSES)
    assert set(ix.dropped_blocks) == set(DROP_CAUSES)
    assert not any(ix.stale_transitions.values()) and not any(ix.dropped_blocks.values())


@pytest.mark.parametrize("kw", [dict(block_size=0), dict(max_blocks=0), dict(settle_events=0),
                                dict(stale_after_s=0.0), dict(max_unkeyed_fraction=1.5)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        EngineBlockIndex(**kw)


# --- against a set model ----------------------------------------------------------------------------

# A universe of blocks: a path of choices from {0, 1, 2}, depth 1..4; block content of choice c at depth d
# is [c, d, c, d] (so equal content at another depth or after another parent is another block).
PATHS = [p for d in range(1, 5) for p in __import__("itertools").product(range(3), repeat=d)]
HASH = {p: 7_000 + i for i, p in enumerate(PATHS)}


def _tokens(path):
    return [t for d, c in enumerate(path, start=1) for t in (c, d, c, d)]


ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.sampled_from(PATHS), st.integers(1, 4)),
        st.tuples(st.just("remove"), st.sampled_from(PATHS)),
        st.tuples(st.just("clear")),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(1, 5))
def test_random_events_agree_with_a_multiset_of_token_prefixes(seq_ops, per_batch):
    f = fresh(max_unkeyed_fraction=1.0)
    present: dict[tuple, int] = {}  # the model: path -> engine blocks holding it
    batch = []
    for op in seq_ops:
        if op[0] == "store":
            path, k = op[1], min(op[2], len(op[1]))
            parent = path[: len(path) - k]
            ev = stored([HASH[path[:j]] for j in range(len(parent) + 1, len(path) + 1)],
                        HASH[parent] if parent else None, [])
            ev.token_ids = _tokens(path)[len(parent) * BS:]
            if not parent or present.get(parent, 0) > 0:  # an unknown parent: the blocks cannot be keyed
                for j in range(len(parent) + 1, len(path) + 1):
                    present[path[:j]] = present.get(path[:j], 0) + 1
        elif op[0] == "remove":
            ev = BlockRemoved([HASH[op[1]]])
            if present.get(op[1], 0) > 0:
                present[op[1]] -= 1
        else:
            ev = AllBlocksCleared()
            present.clear()
        batch.append(ev)
        if len(batch) >= per_batch:
            f.send(*batch)
            batch = []
    f.send(*batch)
    assert f.idx.stale_reason is None
    assert f.idx.size == sum(1 for c in present.values() if c > 0)
    held = {p for p, c in present.items() if c > 0}
    assert f.idx.orphans == sum(1 for p in held if len(p) > 1 and p[:-1] not in held)
    for path in PATHS:
        expect = 0
        while expect < len(path) and present.get(path[: expect + 1], 0) > 0:
            expect += 1
        assert f.idx.cached_blocks(token_prefix_blocks(_tokens(path), BS)) == expect, path


def test_awaiting_for_runs_from_the_first_dispatch_that_expects_events():
    now = [100.0]
    idx = EngineBlockIndex(BS, stale_after_s=None, clock=lambda: now[0])
    idx.note_dispatch(0)  # nothing new for the engine to store: nothing expected
    assert idx.awaiting_for is None
    idx.note_dispatch(3)
    now[0] = 104.5
    idx.note_dispatch(2)  # already awaiting: the clock keeps its start
    assert idx.awaiting_for == 4.5
    idx.apply(EventBatch(1.0, [], 0), 0)  # a batch came
    assert idx.awaiting_for is None


# --- the engine's block size, extra keys and losses (real vLLM: tests/realvllm/) -------------------


def test_the_engines_block_size_is_learnt_from_its_events_and_said_when_unexpected():
    said = []
    f = Feed(on_block_size=lambda want, got: said.append((want, got)))
    f.idx.block_size = f.idx.expected_block_size = 16  # configured 16; the engine caches blocks of 4
    f.send()
    f.send(stored([101, 102], None, A, B))
    assert said == [(16, 4)] and f.idx.block_size == 4 and f.idx.reported_block_size == 4
    assert f.idx.cached_blocks(req(A, B, C)) == 2 and f.idx.dropped_blocks["block_size"] == 0
    # An engine cannot change its block size while it runs: another size now is dropped, counted.
    f.send(BlockStored([103], None, [1, 2, 3, 4, 5, 6, 7, 8], 8))
    assert f.idx.dropped_blocks["block_size"] == 1 and f.idx.block_size == 4 and said == [(16, 4)]
    # A restarted engine (seq 0) may come back with another size: learnt again, said again.
    f.send(seq=0)
    f.send(BlockStored([201], None, A + B, 8))
    assert said == [(16, 4), (16, 8)] and f.idx.block_size == 8
    assert f.idx.cached_blocks(token_prefix_blocks(A + B + C, 8)) == 1


def test_without_an_expected_size_the_first_event_sets_it():
    said = []
    idx = EngineBlockIndex(None, stale_after_s=None, on_block_size=lambda want, got: said.append((want, got)))
    assert idx.block_size is None and idx.stale_reason == "no_events"
    idx.apply(EventBatch(1.0, [stored([1, 2], None, A, B)], 0), 0)
    assert said == [(None, 4)] and idx.cached_blocks(req(A, B)) == 2


def test_extra_keys_match_requests_with_the_same_adapter_and_salt_only():
    from routerd.prefix.text import request_extra_keys

    f = fresh()
    # What vLLM 0.32 sent for adapter a1 with cache_salt s1: the salt in block 0 only, after the name.
    f.send(stored([101, 102, 103], None, A, B, C, lora_name="a1", lora_id=1,
                  extra_keys=[["a1", "s1"], ["a1"], ["a1"]]))
    toks = A + B + C + D

    def keyed(lora, salt):
        return token_prefix_blocks(toks, BS, extra_keys=request_extra_keys(lora, salt, 4))

    assert f.idx.cached_blocks(keyed("a1", "s1")) == 3
    assert f.idx.cached_blocks(keyed("a1", None)) == 0
    assert f.idx.cached_blocks(keyed(None, "s1")) == 0
    assert f.idx.cached_blocks(keyed(None, None)) == 0
    assert f.idx.cached_blocks(keyed("a2", "s1")) == 0
    # Continued by a later request of the same adapter and salt (no extra key in the new block's
    # salt position 0, but the adapter's name): found whole.
    f.send(stored([104], 103, D, lora_name="a1", lora_id=1, extra_keys=[["a1"]]))
    assert f.idx.cached_blocks(keyed("a1", "s1")) == 4
    # A vLLM that sends the adapter's name but no extra_keys: the name salts every block.
    g = fresh()
    g.send(stored([201, 202], None, A, B, lora_name="a1"))
    assert g.idx.cached_blocks(token_prefix_blocks(A + B, BS, extra_keys=request_extra_keys("a1", None, 2))) == 2
    assert g.idx.cached_blocks(req(A, B)) == 0


def test_on_loss_is_called_when_the_engine_itself_lost_its_blocks():
    losses = []
    f = Feed(on_loss=losses.append)
    f.send()  # seq 0: a fresh engine (an empty cache: whatever others believed of it is gone)
    f.send(stored([101], None, A))
    f.send(AllBlocksCleared())
    f.send(seq=5)  # a gap: batches lost, the engine still holds its blocks
    f.send(seq=2)  # seq went back, not to 0: another process
    f.idx.record_malformed(9)
    f.idx.engine_down()
    f.idx.engine_down("disconnected")
    assert losses == ["fresh_start", "cleared", "restart", "engine_down", "disconnected"]
