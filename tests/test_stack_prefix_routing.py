"""Prefix-aware routing online (issue 14): routerd in front of 4 emulators, driven by the official
``openai`` client with multi-turn chat conversations that resend their whole history each turn.

One stack for the module: 4 emulators (fixed timing, no sidecars: every instance is seen through
routerd's own bookkeeping, so an idle cluster gives every candidate the same load score) and
routerd reading a YAML file that each test rewrites and reloads (SIGHUP). Conversations run one
request at a time, interleaved turn by turn (all first turns, then all second turns, ...), so
each policy's index holds several conversations at once. Which emulator served each turn is read
from the emulators' own counters (``vllm:request_success_total``), never from routerd.

What is asserted, per policy with a prefix term (``llmd``, ``phasewise``):

* ``prefix.mode: approximate``: every turn of a conversation goes where its first turn went (the
  history's blocks are in that endpoint's index and no other's; the load terms are equal), and
  conversations whose system prompts differ from their first bytes spread (their first turns are
  ties broken at random: 6 conversations on one endpoint of 4 has probability 4 / 4^6);
* ``prefix.mode: off``: the same policy sees no prefix and breaks every tie at random, so turns
  do not stick: of the 18 turn-to-turn transitions, at most 12 stay (13 or more staying at
  random, 1/4 each, has probability 3.4e-5), against 18 of 18 with the prefix;
* routerd's ``phasewise_prefix_match_blocks`` histogram counts one observation per decision with
  a prefix, and only those, and ``phasewise_prefix_index_blocks`` is positive exactly on the
  endpoints that served a conversation.
"""

from __future__ import annotations

import signal
from collections import Counter

import pytest

from routerd.tokens import chat_prompt_text
from stack_processes import Stack, client, metric_by, metric_sum, routerd_metrics, scrape, wait_until

MODEL = "llama-2-7b"
TIMEOUT_S = 60.0
CONVERSATIONS = 6
TURNS = 4
N_EMULATORS = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory, request):
    s = Stack(tmp_path_factory.mktemp("prefix-stack"), n=N_EMULATORS, sidecars=False,
              emulator_flags=("--fixed-timing", "0.002,0.001", "--default-max-tokens", "24"),
              config=_settings("llmd", "approximate"))
    s.start_for(request)
    s.reloads = 0
    return s


def _settings(policy: str, mode: str) -> dict:
    # tie_break_seed: the random candidate order is the same every run (the policies' own
    # generators are seeded too), so the runs are reproducible.
    return {"models": [MODEL], "policy": {"name": policy}, "prefix": {"mode": mode},
            "router": {"tie_break_seed": 7}, "reload": {"watch": False}}


def _reconfigure(s: Stack, policy: str, mode: str) -> None:
    s.write_config({**_settings(policy, mode), "endpoints": s.endpoint_entries()})
    s.routerd.signal(signal.SIGHUP)
    s.reloads += 1
    wait_until(lambda: metric_by(routerd_metrics(s), "phasewise_config_reloads_total", "result").get("ok", 0),
               lambda n: n >= s.reloads, TIMEOUT_S, f"routerd reloading to {policy}, prefix.mode {mode}")


def _served(s: Stack) -> dict[str, float]:
    """Requests each emulator completed, by its own counter."""
    return {name: metric_sum(scrape(url + "/metrics"), "vllm:request_success_total")
            for name, url in zip(s.names, s.emulator_urls)}


def _system_prompt(j: int, tag: str) -> str:
    # Distinct from the first bytes ("system: Conversation j ..."), then long enough (about 1.2 KB,
    # 300 tokens) that a turn's history spans many 16-token blocks.
    body = " ".join(f"rule {k}: answer conversation {j} politely and in full sentences." for k in range(20))
    return f"Conversation {j} ({tag}): {body}"


def _run_conversations(s: Stack, tag: str, sent: list | None = None) -> list[list[str]]:
    """Endpoint name of every turn of each conversation (interleaved turn by turn); ``sent``
    collects each conversation's prompts as routerd renders them (``chat_prompt_text``)."""
    histories = [[{"role": "system", "content": _system_prompt(j, tag)}] for j in range(CONVERSATIONS)]
    where: list[list[str]] = [[] for _ in range(CONVERSATIONS)]
    if sent is not None:
        sent[:] = [[] for _ in range(CONVERSATIONS)]
    with client(s, TIMEOUT_S) as c:
        for turn in range(TURNS):
            for j, messages in enumerate(histories):
                messages.append({"role": "user", "content": f"Question {turn} of conversation {j}: what next?"})
                before = _served(s)
                if sent is not None:
                    sent[j].append(chat_prompt_text(messages))
                r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24)
                after = wait_until(lambda: _served(s), lambda a: sum(a.values()) == sum(before.values()) + 1,
                                   TIMEOUT_S, "one more request completed by the emulators")
                (name,) = [n for n in s.names if after[n] == before[n] + 1]
                where[j].append(name)
                messages.append({"role": "assistant", "content": r.choices[0].message.content})
    return where


def _stays(where: list[list[str]]) -> int:
    return sum(a == b for turns in where for a, b in zip(turns, turns[1:]))


@pytest.mark.parametrize("policy", ["llmd", "phasewise"])
def test_conversations_stick_with_approximate_prefix_and_not_without(stack, policy):
    _reconfigure(stack, policy, "approximate")
    m0 = routerd_metrics(stack)
    sent: list[list[str]] = []
    where = _run_conversations(stack, f"{policy}-approximate", sent)
    m1 = routerd_metrics(stack)
    for j, turns in enumerate(where):
        assert len(set(turns)) == 1, f"{policy}: conversation {j} moved between endpoints: {turns}"
    firsts = [turns[0] for turns in where]
    assert len(set(firsts)) >= 2, f"{policy}: every conversation went to one endpoint: {firsts}"
    decisions = CONVERSATIONS * TURNS
    observed = (metric_sum(m1, "phasewise_prefix_match_blocks_count", source="approximate")
                - metric_sum(m0, "phasewise_prefix_match_blocks_count", source="approximate"))
    assert observed == decisions
    # Each turn resends the previous prompt whole and more, so on its endpoint it matches the
    # previous prompt's whole chunks of 256 bytes (4 blocks of 16 tokens at 4 bytes each; the
    # chunk that straddles its end was never indexed); first turns match nothing.
    matched = metric_sum(m1, "phasewise_prefix_match_blocks_sum") - metric_sum(m0, "phasewise_prefix_match_blocks_sum")
    assert matched == sum(len(p.encode()) // 256 * 4 for prompts in sent for p in prompts[:-1])
    assert matched >= CONVERSATIONS * (TURNS - 1) * 16  # the system prompt alone: 1.2 KB
    index = metric_by(m1, "phasewise_prefix_index_blocks", "endpoint")
    assert {n for n, v in index.items() if v > 0} == set(firsts), index

    _reconfigure(stack, policy, "off")
    where_off = _run_conversations(stack, f"{policy}-off")
    m2 = routerd_metrics(stack)
    stays = _stays(where_off)
    assert stays <= 12, f"{policy} with prefix.mode off: {stays} of 18 turns stayed: {where_off}"
    assert _stays(where) == CONVERSATIONS * (TURNS - 1)
    # No prefix, no observation; the reload built a fresh policy, whose indexes are empty.
    count = "phasewise_prefix_match_blocks_count"
    assert metric_sum(m2, count) == metric_sum(m1, count)
    assert sum(metric_by(m2, "phasewise_prefix_index_blocks", "endpoint").values()) == 0
    spread = Counter(t for turns in where_off for t in turns)
    assert len(spread) >= 2, spread
