"""Decision cost with prefix scoring: one policy ``pick`` on routerd's instance views, with the
request's prefix and, in the same run, with ``prefix=None`` (the load-only baseline), as a ratio.

Setting: each policy as routerd builds it in approximate mode (its ``prefix_source`` following
the mode), ``--instances`` (4 and 8) of ``llama3.1-8b-h100`` as routerd's own views
(:class:`routerd.daemon.state.EndpointState`, ``--load`` requests in flight on each, refreshed as
routerd refreshes them before a decision). The policies' approximate indexes are populated the way
routerd populates them, by picking: a warm-up of conversations (``--conversations`` per instance,
in groups of 4 sharing a system prompt of a quarter of the prompt) is sent once, then each timed
request continues a random conversation: its first ``prompt - 50`` tokens are that conversation's
history (cached, in the index's belief, where the policy sent it), the system prompt is cached
wherever the group's other conversations went, the last 50 tokens are new. Prompts are hashed by
routerd's :class:`~routerd.daemon.prefix.PrefixIdentity` (``prefix.chunk_blocks`` as given), untimed,
right before each pick, as routerd hashes a prompt when it parses the request and then decides
in the same callback; ``--hash-up-front`` hashes them all before timing instead (the setting until
2026-12-03, about 0.7-0.85x the p50 of this one). A second table, ``worst``, gives every instance the whole prompt (a system prompt of
the full length replicated everywhere), so every candidate's match walks every extent.

Each timed pick is the policy's whole ``pick`` (scoring every candidate, its index's match per
candidate and its insert into the chosen one) plus what routerd reads right after it (the chosen
engine's match in precise mode, the index's match at the insert, ``last_insert``, otherwise), by the wall clock (``perf_counter_ns``) and by the
thread's CPU clock (``thread_time_ns``: what it costs; the wall clock also counts the time the
thread was preempted, which dominates p99 on a shared machine); p50 and p99 over ``--n`` picks
after 10% warm-up. Each cell runs ``--repeat`` times on the same seeded prompts and views and
prints the median of each figure over the runs, with the worst run's CPU p99 and the
hypervisor's ``steal`` over the cell (percent of the machine's CPU time, ``/proc/stat``) beside:
a thread's CPU clock keeps running while its virtual CPU is descheduled, and on this machine
bursts of steal or of other processes set a single run's p99 (the load-only ``None`` column
moves with them). The indexes defer their inserts as routerd's do (``PrefixIndex.defer_updates``:
routerd applies them, evictions included, on the next event-loop turn, after the request is on
its way), so a pick is the decision; ``+update`` is the pick plus that insert (its CPU clock),
what the decision costs the event loop in all. The garbage collector runs as routerd runs it
(``--collector routerd``, :mod:`routerd.daemon.collector`: the same collections at routerd's
thresholds between callbacks, here after each decision's update, CPython's own only as a
backstop), and
``gc`` is its mean CPU per decision (us); ``--collector cpython`` keeps CPython's automatic
collector at its default thresholds, which collects inside the picks. The prefix hashing (``PrefixIdentity.blocks_for``, what
routerd does once per request at parse) is timed apart, per prompt size and chunk size.

``--modes precise`` measures routerd's precise mode the same way: prompts keyed per 16-token
block from the emulator's byte tokenizer (:class:`~routerd.daemon.prefix.EngineKeyed`), each
policy with ``prefix_source=precise``, and each view with an
:class:`~routerd.prefix.engine_index.EngineBlockIndex` fed the ``BlockStored`` batches an engine
would publish for the warm-up prompts sent to it (only the blocks it did not hold yet, keyed by
content as vLLM's chained hashes are), so every candidate's match is the engine index's lookup.
Tokenization is timed apart (``tokenize``), as the issue asks.

First, the machine's own tail (:func:`machine_tail`): p50 and p99 of a fixed loop of Python
integer arithmetic sized to about 25, 50, 75 and 100 us. On a shared virtual machine its p99 is
well above its p50 (session 31, three runs: p50 40.6-49.3 us with p99 81.1-106.2, p50 55.2-78.0
with p99 100.5-150.6), so there a pick whose p50 is over about 45 us has a p99 near or over 100 us
whatever its code; a pick's p99 is read beside the fixed work's at the same p50.

``--baseline in-place`` changes what the ``None`` columns measure in precise mode: the
load-only pick in precise mode's surroundings (each chosen engine's ``BlockStored`` batch applied
between picks, as in the prefix run; the prompts are hashed before each pick either way), so the
ratio is the prefix scoring's own share of the pick. The default ``idle`` baseline applies no KV
events between its picks (the warm-up's are applied, and each prompt is still hashed before its
pick), so it is closer to routerd with prefix scoring off.

Also the index's memory (``--memory-bound``): the process's RSS while a stream of unique 4K-token
prompts fills 4 instances' index to the bound and goes on for twice as much again (it levels off
past the bound: the dicts' tables and the allocator keep what churn needs).

Target (issue 14): <= 100 us p99 per decision with prefix scoring for prompts up to 8K tokens;
the index holds its memory bound under a stream of unique prompts. No timed tests: this prints
figures.

Usage: python benchmarks/prefix_decision_cost.py [--n 3000] [--instances 4,8] [--tokens 1024,4096,8192]
       [--chunk-blocks 4,1] [--policies llmd,sglang_cache_aware,dynamo_kv,phasewise] [--load 16]
       [--memory-bound 262144] [--modes approximate,precise] [--collector routerd|cpython]
       [--repeat 3] [--hash-up-front] [--baseline idle|in-place]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time

import numpy as np

from routerd.daemon.app import _with_prefix_source
from routerd.daemon.config import PolicyConfig, PrefixConfig
from routerd.policies.registry import parse_policy_spec
from routerd.daemon.prefix import PrefixIdentity
from routerd.daemon.router import build_routing_policy, prefix_indexes
from routerd.daemon.state import EndpointState, Inflight
from routerd.policies.base import ClusterView, RequestFeatures
from routerd.profiles import get_profile

PROFILE = "llama3.1-8b-h100"
HASH_AT_PARSE = True  # --hash-up-front: False
BASELINE_IN_PLACE = False  # --baseline in-place: the None run meets the engines' KV events too
PACER = None  # routerd's collector (--collector routerd), run between decisions
NEW_TOKENS = 50  # the new question at the end of each timed prompt


def pct(ns: list[int]) -> tuple[float, float]:
    a = np.asarray(ns, dtype=float) / 1000.0
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


_VOCAB = ["".join(random.Random(k).choice("abcdefghijklmnopqrstuvwxyz") for _ in range(2 + k % 7)) + " "
          for k in range(4096)]


def words(rng: random.Random, nbytes: int) -> str:
    """``nbytes`` of ASCII text: random words of 3-9 bytes from a 4,096-word vocabulary."""
    return "".join(rng.choices(_VOCAB, k=nbytes // 3 + 1))[:nbytes]


def views(prof, m: int, load: int, rng: np.random.Generator) -> list[EndpointState]:
    """``m`` of routerd's own endpoint views with ``load`` requests in flight each (3 in 4
    decoding), drawn from ``rng``; ``prof``: one profile for all, or a sequence of ``m``."""
    profs = list(prof) if isinstance(prof, (list, tuple)) else [prof] * m
    eps = []
    for i in range(m):
        ep = EndpointState(i, f"e{i}", f"http://10.0.0.{i}:8000", None, True, profs[i])
        for k in range(load):
            r = Inflight(k, k, int(rng.integers(200, 4000)), int(rng.integers(0, 4)), 400.0, 0.0)
            ep.add(r, 0.0)
            if k % 4:  # three in four decoding, one prefilling or waiting
                ep.on_first_token(r)
                ep.on_tokens(r, int(rng.integers(1, 300)))
        ep.refresh(0.0, 2.0)
        eps.append(ep)
    return eps


def flush(ix) -> None:
    """Apply ``ix``'s deferred inserts (an index from before ``defer_updates`` has none: measured
    as it is, with ``PYTHONPATH`` pointing at an older checkout)."""
    fn = getattr(ix, "flush", None)
    if fn is not None:
        fn()


def features(rid: int, tokens: int, prefix) -> RequestFeatures:
    return RequestFeatures(rid, 0.0, tokens, 1, 400.0, None, prefix)


def engine_store(ep: EndpointState, prefix, text: str, seq: list[int]) -> None:
    """Publish to ``ep``'s engine index the blocks of ``prefix`` (``text``'s EngineKeyed identity)
    that it does not hold yet, as one ``BlockStored`` batch numbered ``seq[0]`` (then incremented):
    what vLLM publishes once it has computed a prompt. The engine's block hashes are the keys
    themselves (vLLM's hashes chain the content too); the token ids are the emulator's byte
    tokenizer's, from which the index derives the same keys."""
    from routerd.prefix.kv_wire import BlockStored, EventBatch
    from routerd.prefix.text import byte_token_ids

    idx = ep.engine_index
    held = idx.cached_blocks(prefix) or 0
    keys = [k for k, _ in prefix.extents]
    if held >= len(keys):
        return
    bs = idx.block_size
    toks = byte_token_ids(text)[held * bs: len(keys) * bs]
    ev = BlockStored(block_hashes=keys[held:], parent_block_hash=keys[held - 1] if held else None,
                     token_ids=toks, block_size=bs)
    idx.apply(EventBatch(float(seq[0]), [ev]), seq[0])
    seq[0] += 1


def measure(name: str, m: int, tokens: int, chunk: int, n: int, load: int, conversations: int,
            worst: bool, precise: bool = False) -> tuple[list[float], float]:
    """([p50, p99 with prefix, p50, p99 without] by the wall clock, then the same by the thread's CPU
    clock, then p50 and p99 of the decision plus its deferred insert by the CPU clock (us);
    mean matched blocks on the chosen instance). ``precise``: routerd's precise mode (see the
    module docstring); ``chunk`` is then unused."""
    prof = get_profile(PROFILE)
    if precise:
        from routerd.prefix.tokenize import load_tokenizer

        ident = PrefixIdentity(PrefixConfig(mode="precise", tokenizer="bytes"), prof.block_size,
                               load_tokenizer("bytes"))
    else:
        ident = PrefixIdentity(PrefixConfig(chunk_blocks=chunk), prof.block_size)
    rng = random.Random(tokens * 31 + m)
    nbytes = tokens * 4
    sys_bytes = nbytes if worst else nbytes // 4
    groups = [words(rng, sys_bytes) for _ in range(max(1, conversations * m // 4))]
    convs = [groups[c % len(groups)] + words(rng, nbytes - sys_bytes) for c in range(conversations * m)]
    hist = nbytes - NEW_TOKENS * 4
    timed, texts = [], []
    for k in range(n):
        c = rng.randrange(len(convs))
        text = convs[c][:hist] + words(rng, NEW_TOKENS * 4)
        timed.append(ident.blocks_for(text))
        texts.append(text)
    eps = views(prof, m, load, np.random.default_rng(m))

    out: list[float] = []
    cpu_out: list[float] = []
    matched = []
    for with_prefix in (True, False):
        # As routerd builds it: prefix_source follows the mode.
        pol, params = parse_policy_spec(name)
        cfg = _with_prefix_source(PolicyConfig(name=pol, params=params), "precise" if precise else "approximate")
        policy = build_routing_policy(cfg, prof, m, near_tie=0.05)
        for ix in prefix_indexes(policy):
            ix.limit_capacity(262_144)  # routerd's default bound
            ix.defer_updates = True  # as routerd: updated after the decision (Router._flush_soon)
        now = 1.0
        seqs: dict[int, list[int]] = {}
        if precise:
            from routerd.prefix.engine_index import EngineBlockIndex
            from routerd.prefix.kv_wire import EventBatch

            for ep in eps:  # every engine's publisher joined from its batch 0: every index answers
                ep.engine_index = EngineBlockIndex(prof.block_size, stale_after_s=None)
                ep.engine_index.apply(EventBatch(0.0, []), 0)
                seqs[ep.index] = [1]
        if worst:
            for ix in prefix_indexes(policy):
                for ep in eps:
                    ix.set_capacity(ep.index, max(1, ep.kv_total_blocks)) if not ix.has_instance(ep.index) else None
                    ix.insert(ep.index, ident.blocks_for(convs[0]), now)
                    flush(ix)
            if precise:
                for ep in eps:
                    engine_store(ep, ident.blocks_for(convs[0]), convs[0], seqs[ep.index])
        else:
            for c, text in enumerate(convs):  # the warm-up: every conversation's history sent once
                view = ClusterView(now, eps, 1)
                p = ident.blocks_for(text[:hist])
                choice = policy.pick(features(c, tokens, p if with_prefix else None), view)
                for ix in prefix_indexes(policy):
                    flush(ix)
                if precise and choice is not None:
                    engine_store(eps[choice], p, text[:hist], seqs[choice])
        gc.collect()
        ns: list[int] = []
        cpu_ns: list[int] = []
        after_ns: list[int] = []
        gc_ns = 0
        wall, cpu = time.perf_counter_ns, time.thread_time_ns
        ixs = prefix_indexes(policy)
        for k, prefix in enumerate(timed):
            if HASH_AT_PARSE:
                # routerd hashes a request's prompt when it parses the request, in the callback
                # that then decides (DaemonApp.prefix_blocks, Router.submit): what the pick meets
                # is what that hashing left behind (measured: 1.2-1.4x the p50 of a pick whose
                # prompt was hashed thousands of picks earlier, session 29).
                prefix = ident.blocks_for(texts[k])
            now += 0.01
            for ep in eps:
                ep.refresh(now, 2.0)
            f = features(10_000 + k, tokens, prefix if with_prefix else None)
            view = ClusterView(now, eps, 1)
            for ix in ixs:
                ix.last_insert = None
            c, t = cpu(), wall()
            choice = policy.pick(f, view)
            # What routerd's decision reads next (Router._decide): in precise mode the chosen
            # engine's match, else the policy's index's match at the insert (last_insert, which a
            # deferred insert searches on first read).
            held, li = 0, None
            if with_prefix and choice is not None:
                if precise:
                    held = eps[choice].engine_match(prefix) or 0
                else:
                    li = next((ix.last_insert for ix in ixs if ix.last_insert is not None), None)
            t, c = wall() - t, cpu() - c
            a = cpu()
            for ix in ixs:  # routerd's next event-loop turn, after the request is on its way
                flush(ix)
            a = cpu() - a
            if PACER is not None:  # routerd's collector timer, a callback of its own
                g = cpu()
                PACER.collect_if_due()
                gc_ns += cpu() - g
            if precise and (with_prefix or BASELINE_IN_PLACE) and choice is not None:
                engine_store(eps[choice], prefix, texts[k], seqs[choice])  # the engine's events, later
            ns.append(t)
            cpu_ns.append(c)
            after_ns.append(c + a)
            if with_prefix and k >= n // 10:
                if precise:  # what the chosen engine held, by its KV events (before this prompt's)
                    if choice is not None:
                        matched.append(held)
                    continue
                if li is not None:
                    matched.append(li[1])
        out.extend(pct(ns[n // 10:]))
        cpu_out.extend(pct(cpu_ns[n // 10:]))
        if with_prefix:
            total = pct(after_ns[n // 10:])
            gc_mean = gc_ns / 1000.0 / len(timed)
    return out + cpu_out + list(total) + [gc_mean], float(np.mean(matched)) if matched else 0.0


def hashing(tokens: int, chunk: int, n: int, precise: bool = False) -> tuple[float, float, int]:
    """p50, p99 (us) of a prompt's identity at parse, and its extents; ``precise``: tokenized by the
    emulator's byte tokenizer and keyed per block (``chunk`` unused)."""
    prof = get_profile(PROFILE)
    if precise:
        from routerd.prefix.tokenize import load_tokenizer

        ident = PrefixIdentity(PrefixConfig(mode="precise", tokenizer="bytes"), prof.block_size,
                               load_tokenizer("bytes"))
    else:
        ident = PrefixIdentity(PrefixConfig(chunk_blocks=chunk), prof.block_size)
    rng = random.Random(tokens)
    texts = [words(rng, tokens * 4 - 16) + f"{k:016d}" for k in range(64)]
    ns = []
    wall = time.perf_counter_ns
    for k in range(n):
        text = texts[k % len(texts)]
        t = wall()
        p = ident.blocks_for(text)
        ns.append(wall() - t)
    p50, p99 = pct(ns[n // 10:])
    return p50, p99, len(p.extents)


def _spin(n: int) -> int:
    s = 0
    for i in range(n):
        s += i * i
    return s


def machine_tail(targets_us: tuple[int, ...] = (25, 50, 75, 100), n: int = 3000) -> list[tuple[int, float, float]]:
    """The machine's own tail for a fixed amount of Python work: ``(target us, p50, p99)`` of the
    thread CPU time (us) of an integer-arithmetic loop (the same work every time; its only
    allocations are the loop's own integers, freed as it goes), sized to take about ``target``
    us, timed ``n`` times after 10% warm-up. Its p99 above its p50 is
    what this machine adds to any computation of that length (timer interrupts, the
    hypervisor's exits and steal, the other core's work evicting caches), so a pick's p99 is
    read beside the fixed work's p99 at the pick's p50, not against an absolute figure alone."""
    cpu = time.thread_time_ns
    t = cpu()
    _spin(200_000)
    per = max(1, cpu() - t) / 200_000
    rows = []
    for target in targets_us:
        k = max(1, int(target * 1000 / per))
        ns = []
        for _ in range(n):
            c = cpu()
            _spin(k)
            ns.append(cpu() - c)
        rows.append((target, *pct(ns[n // 10:])))
    return rows


def steal_jiffies() -> int | None:
    """The machine's CPU time stolen by its hypervisor so far (``/proc/stat``'s ``steal``,
    USER_HZ ticks summed over CPUs), or None where the kernel does not say. Thread CPU clocks
    keep running while a virtual CPU is descheduled, so steal inflates a decision's measured
    CPU time without being any of its cost."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8])
    except (OSError, IndexError, ValueError):
        return None


def measure_repeated(repeat: int, *args) -> tuple[list[float], float, float, float | None]:
    """:func:`measure` ``repeat`` times over the same seeded setting: (the median of each figure
    over the repeats, mean matched blocks, the largest CPU p99 of any repeat (us), the steal
    while it ran as a percentage of the machine's CPU time, None where unknown). The median of
    per-repeat percentiles keeps one burst of outside noise (another process, the hypervisor)
    from setting a cell's p99; the worst repeat is printed beside it."""
    runs = []
    s0, t0 = steal_jiffies(), time.perf_counter()
    for _ in range(repeat):
        runs.append(measure(*args))
    s1, dt = steal_jiffies(), time.perf_counter() - t0
    figs = [float(np.median([r[0][i] for r in runs])) for i in range(len(runs[0][0]))]
    steal = None
    if s0 is not None and s1 is not None and dt > 0:
        steal = 100.0 * (s1 - s0) / (os.sysconf("SC_CLK_TCK") * dt * (os.cpu_count() or 1))
    return figs, runs[0][1], max(r[0][5] for r in runs), steal


def rss_mb() -> float:
    """This process's resident set (MB, ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def memory(bound: int, m: int, ttl: bool) -> list[tuple[int, float, int]]:
    """RSS while a stream of unique 4K-token prompts fills ``m`` instances' index to ``bound``
    blocks each and goes on for twice as much again: ``(prompts, RSS MB, blocks held)`` rows."""
    from routerd.prefix.index import PrefixIndex

    ident = PrefixIdentity(PrefixConfig(), 16)
    ix = PrefixIndex(None, ttl_s=120.0 if ttl else None)
    ix.limit_capacity(bound)
    base = words(random.Random(5), 16384 - 16)
    per = ident.blocks_for(base).num_blocks
    total = 3 * bound * m // per
    rows = []
    gc.collect()
    rows.append((0, rss_mb(), 0))
    for k in range(total):
        ix.insert(k % m, ident.blocks_for(f"{k:016d}" + base), k * 1e-4)  # distinct from the first chunk
        if (k + 1) % (total // 6) == 0:
            gc.collect()
            rows.append((k + 1, rss_mb(), sum(ix.size(i) for i in range(m))))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--n", type=int, default=3000, help="timed picks per case")
    ap.add_argument("--instances", default="4,8", help="','-separated instance counts")
    ap.add_argument("--tokens", default="1024,4096,8192", help="prompt sizes (tokens)")
    ap.add_argument("--chunk-blocks", default="4,1", help="prefix.chunk_blocks values (routerd's default first)")
    ap.add_argument("--policies", default="llmd,sglang_cache_aware,dynamo_kv,phasewise",
                    help="','-separated policies that keep a prefix index, or ';'-separated specs "
                         "(name:key=value|key=value, e.g. 'phasewise;phasewise:interference_weight=0.1|"
                         "interference_count=decoding', the default before 2026-12)")
    ap.add_argument("--load", type=int, default=16, help="requests in flight per instance")
    ap.add_argument("--conversations", type=int, default=8, help="warm-up conversations per instance")
    ap.add_argument("--memory-bound", type=int, default=262_144,
                    help="prefix.index_capacity_blocks for the memory part (0: skip it)")
    ap.add_argument("--collector", default="routerd", choices=["routerd", "cpython"],
                    help="routerd: collections paced between decisions as routerd runs them "
                         "(routerd.daemon.collector); cpython: CPython's default automatic collector")
    ap.add_argument("--modes", default="approximate,precise",
                    help="prefix.mode values (precise: the engines' KV-event indexes, bytes tokenizer)")
    ap.add_argument("--hash-up-front", action="store_true",
                    help="hash every timed prompt before timing (as the benchmark did until 2026-12-03) instead of right "
                         "before its pick, as routerd does at parse")
    ap.add_argument("--baseline", default="idle", choices=["idle", "in-place"],
                    help="precise mode's prefix=None run: idle (no KV events applied between its "
                         "picks) or in-place (each chosen engine's KV events applied between picks, as "
                         "in the prefix run: only the pick's prefix scoring left out); needs --modes precise")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of each cell (the same seeded prompts and views); its figures are "
                         "the medians over the runs, and the worst run's CPU p99 is printed beside")
    a = ap.parse_args()
    if a.repeat < 1:
        ap.error(f"--repeat: at least 1, got {a.repeat}")
    modes = a.modes.split(",")
    if not set(modes) <= {"approximate", "precise"}:
        ap.error(f"--modes: approximate and/or precise, got {a.modes!r}")
    lists = {}
    for flag, text in (("--instances", a.instances), ("--tokens", a.tokens), ("--chunk-blocks", a.chunk_blocks)):
        try:
            lists[flag] = [int(x) for x in text.split(",")]
        except ValueError:
            ap.error(f"{flag}: a ','-separated list of integers, got {text!r}")
        if min(lists[flag]) < 1:
            ap.error(f"{flag}: every value at least 1, got {text!r}")
    ms, sizes, chunks = lists["--instances"], lists["--tokens"], lists["--chunk-blocks"]
    pols = a.policies.split(";") if ";" in a.policies else a.policies.split(",")
    from routerd.policies.registry import POLICIES as REGISTERED

    for spec in pols:
        try:
            name, params = parse_policy_spec(spec)
            PolicyConfig(name=name, params=params)
        except Exception as e:  # noqa: BLE001 - one line naming the spec, not a traceback
            ap.error(f"--policies: {spec!r}: {e}".splitlines()[0])
        if name not in REGISTERED:
            ap.error(f"--policies: unknown policy {name!r}; valid: {', '.join(REGISTERED)}")
    if a.baseline == "in-place" and "precise" not in modes:
        ap.error("--baseline in-place changes precise mode's baseline only; add --modes precise")
    tail = " | ".join(f"~{t} us: p50 {p50:.1f} p99 {p99:.1f}" for t, p50, p99 in machine_tail())
    print(f"this machine's tail (a fixed loop of Python arithmetic, thread CPU, us): {tail}")
    if a.memory_bound:
        for ttl in (False, True):
            rows = memory(a.memory_bound, 4, ttl)
            print(f"index memory: unique 4K-token prompts into 4 instances bounded at {a.memory_bound} blocks each "
                  f"({'with a TTL, as dynamo_kv' if ttl else 'no TTL'}); RSS MB: " +
                  ", ".join(f"{n} prompts {r:.0f} MB ({b} blocks)" for n, r, b in rows) +
                  f"; {(rows[-1][1] - rows[0][1]) * 1e6 / max(1, rows[-1][2] // 4):.0f} bytes per entry of 4 blocks"
                  " at the end")
    global PACER, HASH_AT_PARSE, BASELINE_IN_PLACE
    HASH_AT_PARSE = not a.hash_up_front
    BASELINE_IN_PLACE = a.baseline == "in-place"
    if a.collector == "routerd":
        # As routerd runs (routerd.daemon.collector): start-up objects frozen, no automatic
        # collection, the same collections between callbacks (here: after each decision's update).
        from routerd.daemon.collector import BACKSTOP, THRESHOLDS, CollectorPacer

        gc.collect()
        gc.freeze()
        gc.set_threshold(BACKSTOP * THRESHOLDS[0], *THRESHOLDS[1:])  # CPython's own, as routerd's backstop
        PACER = CollectorPacer()
    else:
        gc.freeze()

    print(f"prefix hashing (PrefixIdentity.blocks_for, once per request at parse; precise: tokenization "
          f"included), us; {a.n} prompts per row")
    print(f"{'tokens':>7} {'chunk_blocks':>12} {'extents':>8} {'p50':>8} {'p99':>8}")
    cases = [(c, False) for c in chunks] if "approximate" in modes else []
    cases += [(0, True)] if "precise" in modes else []
    for chunk, precise in cases:
        for tokens in sizes:
            p50, p99, ext = hashing(tokens, chunk, a.n, precise)
            print(f"{tokens:>7} {'tok' if precise else chunk:>12} {ext:>8} {p50:>8.1f} {p99:>8.1f}")
    for worst in (False, True):
        what = ("worst: the whole prompt cached on every instance" if worst else
                "conversations: history on one instance, system prompt (1/4) on several")
        base = "in place: KV events applied between its picks too" if BASELINE_IN_PLACE else "idle"
        print(f"\npick with prefix vs prefix=None ({base}), us ({what}; {PROFILE}, {a.load} in flight per instance);"
              f" wall clock, then the thread's CPU clock (without preemption); chunk 'tok': precise mode (KV-event"
              f" index, one key per token block); medians of {a.repeat} runs, the largest run's CPU p99 beside")
        print(f"{'policy':>19} {'m':>2} {'tokens':>6} {'chunk':>5} | {'p50':>6} {'p99':>6} {'None':>5} {'None':>5} "
              f"{'x p50':>5} {'x p99':>5} | {'cpu p50':>7} {'p99':>6} {'None':>5} {'None':>5} {'x p50':>5} "
              f"{'x p99':>5} | {'+update p50':>11} {'p99':>6} | {'gc':>5} | {'matched':>7} | {'max-run p99':>11} {'steal%':>6}")
        for chunk, precise in cases:
            for name in pols:
                for m in ms:
                    for tokens in sizes:
                        f, mb, worst99, steal = measure_repeated(
                            a.repeat, name, m, tokens, chunk, a.n, a.load, a.conversations, worst, precise)
                        w50, w99, o50, o99, c50, c99, d50, d99, e50, e99, gcm = f
                        flag = "" if c99 <= 100.0 else "  CPU p99 > 100 us"
                        print(f"{name:>19} {m:>2} {tokens:>6} {'tok' if precise else chunk:>5} | {w50:6.1f} {w99:6.1f} {o50:5.1f} "
                              f"{o99:5.1f} {w50 / o50:5.2f} {w99 / o99:5.2f} | {c50:7.1f} {c99:6.1f} {d50:5.1f} "
                              f"{d99:5.1f} {c50 / d50:5.2f} {c99 / d99:5.2f} | {e50:11.1f} {e99:6.1f} | {gcm:5.1f} | {mb:7.1f} | "
                              f"{worst99:11.1f} {'-' if steal is None else f'{steal:.1f}':>6}{flag}")


if __name__ == "__main__":
    main()
