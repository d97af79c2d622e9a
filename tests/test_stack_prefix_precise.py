"""Precise prefix-cache routing online (issue 14, deliverable 6): routerd matching requests against
the engines' own KV events, with real processes only.

One stack for the module: 4 emulators (``llama3.1-8b-h100`` timing, prefix caching on, vLLM KV
events each on a port of its own), a sidecar beside each, routerd in ``prefix.mode: precise``
with the emulator's ``bytes`` tokenizer, reading a YAML file that each test rewrites and reloads
(SIGHUP). Every request goes through the official ``openai`` client, one at a time; which
emulator served it is read from the emulators' own ``vllm:request_success_total``, and what its
cache gave it from their own ``vllm:prefix_cache_hits_total`` / ``_queries_total``.

**The cache model, by hand** (:class:`CacheModel`; it never calls routerd's hashing). A chat
prompt is ``routerd.tokens.chat_prompt_text(messages)`` on both sides. The emulator's tokenizer
is 4 UTF-8 bytes per token (the last token zero-padded), so a prompt of ``B`` bytes has
``T = ceil(B / 4)`` tokens and ``T // 16`` full blocks of 16 tokens, block ``j`` being bytes
``[64 j, 64 j + 64)`` of the padded text; a block's identity is the whole padded text up to its
end (vLLM chains each block's hash to its parent's). The emulator caches every full prompt
block once its request is prefilled, never a generated one (``routerd/routerd/emulator/engine.py``),
and evicts nothing at these sizes (26,971 blocks). A request's hit is its leading run of cached
blocks ``m``, capped so that its last token is computed: ``hits = min(m, (T - 1) // 16) * 16``
tokens, ``queries = T`` (``routerd/routerd/sim/instance.py``, vLLM's rule). routerd's precise
match on the chosen endpoint (``phasewise_prefix_match_blocks{source="precise"}``) is ``m``
itself, and its engine index for an endpoint holds exactly the distinct blocks the model says
the endpoint caches (``phasewise_prefix_engine_index_blocks``), which each test awaits after each
request so that the next decision sees the events.

Exactness: routerd's engine index is exact only once it has seen every batch since an empty
cache, and ZMQ drops what a publisher sends before a subscription has joined. So each test
starts by resetting the emulators' caches (``POST /reset_prefix_cache``: an ``AllBlocksCleared``
batch), repeated until routerd reports each index answering and empty: whatever seq that batch
has, the clear makes the index exact (``engine_index.py``: events are applied after the seq
check). Ties between equal endpoints are broken by routerd's seeded generator
(``router.tie_break_seed``) and the policies' seeded ones, but the sidecars' snapshots can show
an endpoint that has just served with a little KV in use, which breaks a tie too: so where a
first turn routed by routerd lands is never asserted, only what follows from it. Where a test
needs a conversation on a given endpoint it sends that conversation's first turn straight to
the emulator, bypassing routerd, so that only the KV events can tell routerd where it is cached.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import openai
import pytest
import zmq

from routerd.prefix.kv_wire import AllBlocksCleared, EventBatch, encode_batch, frames
from routerd.tokens import chat_prompt_text
from stack_processes import (
    Stack,
    http_post,
    metric_by,
    metric_sum,
    routerd_metrics,
    scrape,
    wait_until,
)

MODEL = "llama-2-7b"
PROFILE = "llama3.1-8b-h100"  # fast simulated timing: a turn is a few tens of ms
TIMEOUT_S = 60.0
N_EMULATORS = 4
BLOCK_TOKENS = 16
BYTES_PER_TOKEN = 4
MAX_TOKENS = 4
#: prefix.kv_events.stale_after_s: short, so that a dead publisher is taken for silent within
#: the test; far above the few ms a live emulator takes to publish a prefill's blocks.
STALE_AFTER_S = 2.0

MATCH = "phasewise_prefix_match_blocks"
FALLBACKS = "phasewise_prefix_fallbacks_total"
ENGINE_BLOCKS = "phasewise_prefix_engine_index_blocks"
ENGINE_STALE = "phasewise_prefix_engine_index_stale"


# -- the stack ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(tmp_path_factory, request):
    s = Stack(tmp_path_factory.mktemp("prefix-precise"), n=N_EMULATORS, kv_events=True,
              emulator_flags=("--profile", PROFILE, "--default-max-tokens", str(MAX_TOKENS)),
              config=_settings("llmd"))
    s.start_for(request)
    s.reloads = 0
    return s


def _settings(policy: str) -> dict:
    # upstream.failure_cooldown_s 0.2: a killed endpoint's connect failure keeps requests off it
    # for 0.2 s only, so it is a candidate again (and its index is queried) well before the
    # restart test needs it; the default 1 s would make that depend on how fast it restarts.
    return {"models": [MODEL], "profile": PROFILE, "policy": {"name": policy},
            "prefix": {"mode": "precise", "tokenizer": "bytes", "kv_events": {"stale_after_s": STALE_AFTER_S}},
            "router": {"tie_break_seed": 7}, "upstream": {"failure_cooldown_s": 0.2},
            "reload": {"watch": False}}


def _reconfigure(s: Stack, policy: str, kv_events: dict[str, str] | None = None) -> None:
    """Reload routerd with ``policy``; ``kv_events`` overrides endpoints' publisher addresses."""
    entries = s.endpoint_entries()
    for e in entries:
        if kv_events and e["name"] in kv_events:
            e["kv_events"] = kv_events[e["name"]]
    s.write_config({**_settings(policy), "endpoints": entries})
    s.routerd.signal(signal.SIGHUP)
    s.reloads += 1
    wait_until(lambda: metric_by(routerd_metrics(s), "phasewise_config_reloads_total", "result").get("ok", 0),
               lambda n: n >= s.reloads, TIMEOUT_S, f"routerd reloading to {policy} ({kv_events or 'own publishers'})")


def _url(s: Stack, name: str) -> str:
    return s.emulator_urls[s.names.index(name)]


def _engine(s: Stack) -> tuple[dict[str, float], dict[str, float]]:
    """routerd's (stale, blocks) gauges of each endpoint's engine index."""
    m = routerd_metrics(s)
    return metric_by(m, ENGINE_STALE, "endpoint"), metric_by(m, ENGINE_BLOCKS, "endpoint")


def _fresh_caches(s: Stack, names: list[str]) -> None:
    """Empty the emulators' caches until routerd's index of each of ``names`` answers, empty."""
    def probe() -> list[str]:
        stale, blocks = _engine(s)
        todo = [n for n in names if stale.get(n) != 0 or blocks.get(n) != 0]
        for n in todo:
            status, _, _ = http_post(_url(s, n) + "/reset_prefix_cache", b"")
            assert status == 200, f"{n}: POST /reset_prefix_cache answered {status}"
        return todo

    wait_until(probe, lambda todo: not todo, TIMEOUT_S, "routerd's engine indexes exact and empty", interval_s=0.2)


def _fresh_driver(s: Stack, request, policy: str) -> "tuple[CacheModel, Driver]":
    """routerd on ``policy``, every emulator's cache empty, and a driver of conversations against
    a model of those caches (closed after the test)."""
    _reconfigure(s, policy)
    _fresh_caches(s, s.names)
    model = CacheModel(s.names)
    d = Driver(s, model, set(s.names))
    request.addfinalizer(d.close)
    return model, d


def _counters(s: Stack) -> dict[str, tuple[float, float, float]]:
    """(requests completed, prefix-cache hit tokens, query tokens) of each live emulator, by its own /metrics."""
    out = {}
    for name, url, p in zip(s.names, s.emulator_urls, s.emulators):
        if p.alive():
            m = scrape(url + "/metrics")
            out[name] = (metric_sum(m, "vllm:request_success_total"), metric_sum(m, "vllm:prefix_cache_hits_total"),
                         metric_sum(m, "vllm:prefix_cache_queries_total"))
    return out


def _established(port: int) -> bool:
    """Whether a TCP connection to local ``port`` is established (the subscriber's, on a publisher's port)."""
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(path).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "01" and int(f[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


# -- the cache model (by hand) ---------------------------------------------------------------------

def _padded(text: str) -> bytes:
    data = text.encode("utf-8")
    return data + b"\0" * (-len(data) % BYTES_PER_TOKEN)


def prompt_tokens(text: str) -> int:
    return max(1, len(_padded(text)) // BYTES_PER_TOKEN)


def full_blocks(text: str) -> list[bytes]:
    """Identity of each full block of the prompt: its padded bytes from the start to the block's end."""
    data = _padded(text)
    step = BLOCK_TOKENS * BYTES_PER_TOKEN
    return [data[:step * (j + 1)] for j in range(len(data) // step)]


class CacheModel:
    """What each emulator caches, from the prompts it served (see the module docstring)."""

    def __init__(self, names: list[str]) -> None:
        self.blocks: dict[str, set[bytes]] = {n: set() for n in names}

    def match(self, name: str, text: str) -> int:
        """Leading full blocks of ``text`` cached on ``name``."""
        m = 0
        for b in full_blocks(text):
            if b not in self.blocks[name]:
                break
            m += 1
        return m

    def hit_tokens(self, name: str, text: str) -> int:
        return min(self.match(name, text), (prompt_tokens(text) - 1) // BLOCK_TOKENS) * BLOCK_TOKENS

    def serve(self, name: str, text: str) -> None:
        self.blocks[name].update(full_blocks(text))

    def clear(self, name: str) -> None:
        self.blocks[name] = set()


class Conversation:
    """A chat whose every turn resends the whole history; ``where``: the endpoint of each turn."""

    def __init__(self, j: int, tag: str) -> None:
        # Distinct from the first bytes ("system: Conversation j (tag)"), about 1.2 KB (19 blocks).
        body = " ".join(f"rule {k}: answer conversation {j} politely and in full sentences." for k in range(20))
        self.j = j
        self.messages = [{"role": "system", "content": f"Conversation {j} ({tag}): {body}"}]
        self.where: list[str] = []
        self.turns = 0


class Driver:
    """Sends turns and checks each against the cache model and the emulators' counters.

    ``matched``: routerd's expected precise (or, for an endpoint without events, approximate)
    match per routed decision; ``fed``: endpoints whose engine index is fed by their emulator
    (awaited after each turn).
    """

    def __init__(self, s: Stack, model: CacheModel, fed: set[str]) -> None:
        self.client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT_S)
        self.s = s
        self.model = model
        self.fed = fed
        self.matched: list[int] = []
        self.routed: list[str] = []
        self.last: dict[str, tuple[float, float, float]] | None = None
        """The counters after the previous turn (only these requests move them); None after an
        emulator was killed or restarted (its counters vanish or start again at 0)."""

    def close(self) -> None:
        self.client.close()

    def turn(self, conv: Conversation, direct: str | None = None) -> str:
        """Conversation ``conv``'s next turn, through routerd, or straight to emulator ``direct``."""
        s = self.s
        conv.messages.append({"role": "user", "content": f"Question {conv.turns} of conversation {conv.j}: what next?"})
        text = chat_prompt_text(conv.messages)
        before = self.last if self.last is not None else _counters(s)
        if direct is None:
            r = self.client.chat.completions.create(model=MODEL, messages=conv.messages, max_tokens=MAX_TOKENS)
        else:  # a client of its own: a restarted emulator must not get a dead pooled connection
            with openai.OpenAI(base_url=_url(s, direct) + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT_S) as c:
                r = c.chat.completions.create(model=MODEL, messages=conv.messages, max_tokens=MAX_TOKENS)
        after = wait_until(lambda: _counters(s),
                           lambda a: sum(v[0] for v in a.values()) == sum(v[0] for v in before.values()) + 1,
                           TIMEOUT_S, "one more request completed by the emulators")
        (name,) = [n for n in after if after[n][0] == before[n][0] + 1]
        assert direct is None or name == direct
        hits = {n: after[n][1] - before[n][1] for n in after}
        expected = self.model.hit_tokens(name, text)
        assert hits == {n: (expected if n == name else 0.0) for n in after}, (
            f"conversation {conv.j} turn {conv.turns} on {name}: prefix-cache hits {hits}, expected {expected} "
            f"tokens there ({self.model.match(name, text)} cached blocks of {len(full_blocks(text))})")
        assert after[name][2] - before[name][2] == prompt_tokens(text)
        if direct is None:
            self.matched.append(self.model.match(name, text))
            self.routed.append(name)
        self.model.serve(name, text)
        if name in self.fed:
            # The next decision must see this turn's BlockStored events.
            want = len(self.model.blocks[name])
            wait_until(lambda: _engine(s)[1].get(name), lambda v: v == want, TIMEOUT_S,
                       f"routerd's engine index of {name} holding the {want} blocks it caches")
        self.last = after
        conv.messages.append({"role": "assistant", "content": r.choices[0].message.content})
        conv.where.append(name)
        conv.turns += 1
        return name


def _delta(m1, m0, name: str, **labels: str) -> float:
    return metric_sum(m1, name, **labels) - metric_sum(m0, name, **labels)


# -- 1. conversations follow the engines' caches ---------------------------------------------------

@pytest.mark.parametrize("policy", ["llmd", "phasewise"])
def test_conversations_follow_the_engines_caches(stack, policy, request):
    """6 conversations x 4 turns, interleaved, then one seeded straight on an emulator: every
    turn's cache hits on every emulator exactly as the model says; each conversation stays
    where its first turn went and they spread; routerd's precise match per decision is the
    model's, counted once per decision; no fallback, no stale index; each engine index holds
    exactly its emulator's blocks."""
    s = stack
    model, d = _fresh_driver(s, request, policy)
    m0 = routerd_metrics(s)
    convs = [Conversation(j, f"{policy}-precise") for j in range(6)]
    for _ in range(4):
        for conv in convs:
            d.turn(conv)
    for conv in convs:
        assert len(set(conv.where)) == 1, f"{policy}: conversation {conv.j} moved: {conv.where}"
    firsts = [conv.where[0] for conv in convs]
    assert len(set(firsts)) >= 2, f"{policy}: every conversation went to one endpoint: {firsts}"

    # A conversation routerd never saw: its first turn straight to the emulator with the fewest
    # conversations. Only that engine's KV events tell routerd where it is cached, so its second
    # turn through routerd goes there (an approximate index would tie it with every endpoint).
    target = min(s.names, key=lambda n: (firsts.count(n), n))
    outsider = Conversation(6, f"{policy}-outsider")
    d.turn(outsider, direct=target)
    assert d.turn(outsider) == target
    assert d.matched[-1] > 0

    m1 = routerd_metrics(s)
    decisions = len(convs) * 4 + 1
    assert _delta(m1, m0, MATCH + "_count", source="precise") == decisions
    assert _delta(m1, m0, MATCH + "_sum", source="precise") == sum(d.matched)
    assert all(m > 0 for m in d.matched[len(convs):]), d.matched  # every later turn found its history
    assert _delta(m1, m0, MATCH + "_count", source="approximate") == 0
    assert _delta(m1, m0, FALLBACKS) == 0, metric_by(m1, FALLBACKS, "endpoint")
    assert metric_by(m1, ENGINE_STALE, "endpoint") == {n: 0.0 for n in s.names}
    assert metric_by(m1, ENGINE_BLOCKS, "endpoint") == {n: float(len(model.blocks[n])) for n in s.names}


# -- 2. a publisher killed and started again ---------------------------------------------------------

def test_publisher_killed_and_restarted(stack, request):
    """What the design guarantees, and so what is asserted:

    * every request is answered: the turn that routerd sends to the dead endpoint (its index still
      claims the blocks: nothing told it otherwise) fails to connect and is retried elsewhere;
    * that refused connect marks the dead endpoint's index stale at once (``engine_down``, cleared:
      its blocks may be gone with it) and every approximate index forgets it; its sidecar then
      reports it unhealthy, so it is no candidate (its stale index is never asked) until it is back;
    * the restarted emulator's cache is empty and its publisher numbers from 0: the first batch
      routerd receives from it (seq 0) clears the index and makes it exact again (blocks equal to
      the new process's, not the dead one's);
    * a conversation follows its longest cache: the one moved off the dead endpoint stays where
      it moved (its history is cached there and nowhere else: the restarted engine lost it);
      later turns routed to the restarted endpoint are matched precisely again.
    """
    s = stack
    model, d = _fresh_driver(s, request, "llmd")
    victim = s.names[0]
    vi = 0
    convs = [Conversation(j, "restart") for j in range(N_EMULATORS)]
    for conv, name in zip(convs, s.names):
        d.turn(conv, direct=name)  # conversation j cached on emulator j only
    for conv in convs:
        assert d.turn(conv) == conv.where[0]  # found from the KV events alone

    m0 = routerd_metrics(s)
    s.kill_emulator(vi)
    d.last = None
    moved = d.turn(convs[0])
    assert moved != victim
    m1 = routerd_metrics(s)
    # Either the turn went to the dead endpoint first (its index still claimed the blocks) and
    # its refused connect sent it elsewhere, or the victim's sidecar had already reported it
    # unhealthy (it scrapes every 100 ms) and it was no candidate.
    refused = _delta(m1, m0, "phasewise_upstream_errors_total", endpoint=victim, kind="connect")
    assert refused in (0, 1)
    # The refused connect, or the publisher's closed connection, marks its index stale at once
    # (engine_down / disconnected: cleared, its blocks may be gone with it), without waiting for
    # the silence rule; every approximate index forgets the engine too.
    wait_until(lambda: _engine(s)[0].get(victim), lambda v: v == 1, TIMEOUT_S, f"{victim}'s index stale")
    assert _delta(routerd_metrics(s), m0, "phasewise_prefix_engine_cache_lost_total", endpoint=victim) >= 1
    # Said by the consumer at its next idle check (every 1 s).
    wait_until(s.routerd.log_text, lambda t: f"{victim} (tcp://127.0.0.1:{s.kv_event_ports[vi]}): precise prefix "
               "index stale (" in t, TIMEOUT_S, f"routerd logging {victim}'s index stale")

    # Its sidecar soon reports it unhealthy (its /metrics refuses): not ready, so no candidate.
    wait_until(lambda: metric_by(routerd_metrics(s), "phasewise_endpoint_ready", "endpoint"),
               lambda r: r.get(victim) == 0.0, TIMEOUT_S, f"{victim}'s sidecar reporting it unhealthy")
    m1 = routerd_metrics(s)
    for conv in convs[1:]:
        assert d.turn(conv) == conv.where[0]
    m2 = routerd_metrics(s)
    # llmd scores every candidate, and the dead endpoint is none: its stale index is never asked,
    # the others answer precisely.
    assert _delta(m2, m1, FALLBACKS) == 0

    s.restart_emulator(vi)
    d.last = None
    model.clear(victim)
    # Its first batch must find routerd subscribed (ZMQ drops what comes before); routerd
    # reconnects by itself, backing off up to 5 s.
    port = s.kv_event_ports[vi]
    wait_until(lambda: _established(port), bool, TIMEOUT_S, f"routerd's subscriber reconnected to port {port}")
    newcomer = Conversation(N_EMULATORS, "restart-new")
    d.turn(newcomer, direct=victim)  # traffic: the restarted publisher's batch 0
    wait_until(lambda: _engine(s), lambda e: e[0].get(victim) == 0, TIMEOUT_S, f"{victim}'s index answering again")
    # Exact again: the new process's blocks only, the dead one's gone.
    first_prompt = chat_prompt_text(newcomer.messages[:2])
    assert _engine(s)[1][victim] == len(model.blocks[victim]) == len(full_blocks(first_prompt))

    m3 = routerd_metrics(s)
    n_matched = len(d.matched)
    assert d.turn(newcomer) == victim
    assert d.matched[-1] > 0
    for conv in convs:
        assert d.turn(conv) == conv.where[-1]
    assert d.turn(newcomer) == victim
    m4 = routerd_metrics(s)
    assert _delta(m4, m3, FALLBACKS) == 0
    assert _delta(m4, m3, MATCH + "_count", source="precise") == len(d.matched) - n_matched
    assert _delta(m4, m3, MATCH + "_sum", source="precise") == sum(d.matched[n_matched:])
    assert convs[0].where == [victim, victim, moved, moved]
    for conv in convs[1:]:
        assert len(set(conv.where)) == 1, conv.where


# -- 3. a malformed event ------------------------------------------------------------------------------

def test_malformed_events(stack, request):
    """One endpoint's ``kv_events`` points at a PUB socket of the test's (an XPUB: it sees the
    subscription arrive, so nothing is sent before routerd listens); its emulator keeps publishing
    on its own port, to nobody. Garbage from the test's socket: routerd keeps routing and
    answering, falls back to the approximate index for that endpoint (counted, reason
    ``malformed``: llmd asks every endpoint per decision and routerd the chosen one again at
    dispatch, so decisions + those routed there), says so once, and keeps consuming: a good
    batch after the garbage is applied. The other endpoints stay precise: no fallback, exact
    hits, their indexes answering."""
    s = stack
    model, d = _fresh_driver(s, request, "llmd")
    convs = [Conversation(j, "malformed") for j in range(N_EMULATORS)]
    for conv in convs:
        d.turn(conv)
    # The broken endpoint: one serving a conversation, so that its approximate index (llmd's own,
    # kept across a reload that changes only publishers) must answer for that conversation.
    broken = convs[0].where[0]
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        pub.bind("tcp://127.0.0.1:*")
        address = pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        log_start = len(s.routerd.log_text())
        _reconfigure(s, "llmd", {broken: address})
        assert pub.poll(int(TIMEOUT_S * 1000)), "routerd never subscribed to the test's publisher"
        assert pub.recv() == b"\x01"  # subscribe, topic ""
        d.fed = set(s.names) - {broken}
        stale, _ = _engine(s)
        assert stale == {n: float(n == broken) for n in s.names}  # a new index: no events yet

        pub.send_multipart([b"", (0).to_bytes(8, "big")])  # 2 frames, not [topic, seq, payload]
        wait_until(lambda: s.routerd.log_text()[log_start:], lambda t: "stale (malformed)" in t, TIMEOUT_S,
                   f"routerd logging {broken}'s malformed message")
        pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1 not msgpack"])  # 0xc1: never valid msgpack

        m0 = routerd_metrics(s)
        for _ in range(2):
            for conv in convs:
                assert d.turn(conv) == conv.where[0]
        m1 = routerd_metrics(s)
        decisions = len(convs) * 2
        on_broken = sum(1 for conv in convs for n in conv.where[1:] if n == broken)
        assert on_broken >= 2  # conversation 0, through the approximate index
        # llmd queries every endpoint once per decision (routerd's own query at dispatch is not counted).
        assert _delta(m1, m0, FALLBACKS, endpoint=broken, reason="malformed") == decisions
        assert _delta(m1, m0, FALLBACKS) == decisions  # no other endpoint fell back
        stale, _ = _engine(s)
        assert stale == {n: float(n == broken) for n in s.names}
        # Decisions for the broken endpoint are matched by the approximate index (labelled so), the
        # others from the KV events; the approximate index matches what routerd sent there: the
        # same blocks the engine caches.
        here = sum(1 for conv in convs for n in conv.where[-2:] if n == broken)
        assert _delta(m1, m0, MATCH + "_count", source="precise") == decisions - here
        assert _delta(m1, m0, MATCH + "_count", source="approximate") == here
        assert (_delta(m1, m0, MATCH + "_sum", source="precise") + _delta(m1, m0, MATCH + "_sum", source="approximate")
                == sum(d.matched[-decisions:]))

        # The consumer survived both: a good batch (seq 1, after the payload numbered 0) that
        # clears the cache makes the index answer again.
        pub.send_multipart(frames(b"", 1, encode_batch(EventBatch(time.time(), [AllBlocksCleared()]))))
        wait_until(lambda: _engine(s)[0].get(broken), lambda v: v == 0, TIMEOUT_S,
                   f"{broken}'s index answering after a good batch")
        pub.send_multipart([b"", (2).to_bytes(8, "big"), b"\xc1"])
        wait_until(lambda: _engine(s)[0].get(broken), lambda v: v == 1, TIMEOUT_S,
                   f"{broken}'s index stale after more garbage")
        log = s.routerd.log_text()[log_start:]
        warnings = [line for line in log.splitlines() if "precise prefix index stale" in line]
        assert len(warnings) == 1, warnings  # said once; the second time at DEBUG
        assert f"{broken} ({address})" in warnings[0] and "expected 3 frames" in warnings[0], warnings[0]
    finally:
        pub.close(0)
        ctx.term()
