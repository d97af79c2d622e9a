"""routerd's approximate prefix mode: the ``prefix`` settings, each request's prefix identity, the
policies' indexes (bound, forgotten and renumbered with the endpoint table) and the prefix metrics.

Expected blocks come from :mod:`routerd.prefix.text` called on the bytes a request should hash
(an independent path from the daemon's: no cutting, no request parsing); the bound is checked
as an invariant over streams of unique prompts.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest

from conftest import policy_params, toy_profile
from daemon_fakes import FakeBackend, openai_client, sample, start_daemon
from routerd.daemon import cli
from routerd.daemon.app import Daemon
from routerd.daemon.config import PolicyConfig, PrefixConfig, RouterConfig, Settings, load_settings
from routerd.errors import ConfigError
from routerd.daemon.discovery import DiscoveredEndpoint
from routerd.daemon.endpointslices import endpoints_from_slices
from routerd.daemon.metrics import Metrics
from routerd.daemon.prefix import EngineKeyed, PrefixIdentity, PrefixInput, build_prefix_identity, kv_events_address
from routerd.prefix.tokenize import ByteTokenizer
from routerd.daemon.proxy import prompt_of
from routerd.daemon.router import Router, build_routing_policy, prefix_indexes
from routerd.errors import ConfigError
from routerd.policies.registry import POLICIES
from routerd.prefix.text import byte_token_array, text_prefix_blocks, token_prefix_blocks
from routerd.tokens import chat_prompt_text

CACHE_AWARE = {"llmd", "sglang_cache_aware", "dynamo_kv", "lmetric", "phasewise"}


# -- settings ----------------------------------------------------------------------------


def test_prefix_defaults_yaml_environment_and_flag(tmp_path):
    s = load_settings(None, environ={})
    p = s.prefix
    assert (p.mode, p.block_size, p.chunk_blocks, p.max_prompt_tokens, p.index_capacity_blocks, p.tokenizer) == \
        ("approximate", None, 4, 131_072, 262_144, "")
    assert (p.kv_events.port, p.kv_events.topic, p.kv_events.stale_after_s, p.kv_events.max_blocks) == \
        (5557, "", 10.0, 262_144)
    assert s.kubernetes.kv_events_port_name == "kv-events"
    f = tmp_path / "r.yaml"
    f.write_text("prefix: {mode: precise, tokenizer: bytes, kv_events: {port: 5601, topic: kv}}\n"
                 "endpoints: [{name: a, url: 'http://10.0.0.1:8000', kv_events: 'tcp://10.0.0.1:5602'}]\n")
    s = load_settings(f, environ={"PHASEWISE_PREFIX__CHUNK_BLOCKS": "2"})
    assert (s.prefix.mode, s.prefix.tokenizer, s.prefix.chunk_blocks, s.prefix.kv_events.port) == \
        ("precise", "bytes", 2, 5601)
    assert s.endpoints[0].kv_events == "tcp://10.0.0.1:5602"
    args = _args("--prefix-mode", "off")
    o, flags = cli.overrides_from_args(args)
    assert load_settings(f, environ={}, overrides=o, override_flags=flags).prefix.mode == "off"
    o, flags = cli.overrides_from_args(_args("--prefix-tokenizer", "tok.json"))
    assert load_settings(f, environ={}, overrides=o, override_flags=flags).prefix.tokenizer == "tok.json"
    o, flags = cli.overrides_from_args(_args("--prefix-tokenizer", " bytes"))
    with pytest.raises(ConfigError, match="--prefix-tokenizer"):
        load_settings(f, environ={}, overrides=o, override_flags=flags)


def _args(*argv):
    import argparse

    p = argparse.ArgumentParser()
    cli.add_parser(p.add_subparsers(dest="command"))
    return p.parse_args(["serve", *argv])


@pytest.mark.parametrize("text, expected", [
    ("prefix: {mode: exact}\n", "prefix.mode: Input should be 'off', 'approximate' or 'precise'"),
    ("prefix: {chunk_blocks: 0}\n", "prefix.chunk_blocks: Input should be greater than or equal to 1"),
    ("prefix: {index_capacity_blocks: 0}\n",
     "prefix.index_capacity_blocks: Input should be greater than or equal to 1"),
    ("prefix: {kv_events: {port: 0}}\n", "prefix.kv_events.port: Input should be greater than or equal to 1"),
    ("prefix: {kv_events: {stale_after_s: 0}}\n", "prefix.kv_events.stale_after_s: Input should be greater than 0"),
    ("prefix: {tokenizer: ' bytes'}\n", "prefix.tokenizer: must not start or end with white space, got ' bytes'"),
    ("prefix: {blocksize: 16}\n", "prefix.blocksize: Extra inputs are not permitted"),
    ("endpoints: [{name: a, url: 'http://h:1', kv_events: 'tcp://*:5557'}]\n",
     "endpoints[0].kv_events: needs the instance's host (IPv6 in brackets), not '*': 'tcp://*:5557'"),
    ("endpoints: [{name: a, url: 'http://h:1', kv_events: 'h:5557'}]\n",
     "endpoints[0].kv_events: must be tcp://host:port or ipc://path, got 'h:5557'"),
    ("endpoints: [{name: a, url: 'http://h:1', kv_events: 'tcp://h:99999'}]\n",
     "endpoints[0].kv_events: must be tcp://host:port with a port in 1-65535, got 'tcp://h:99999'"),
])
def test_prefix_errors_name_the_field(tmp_path, text, expected):
    f = tmp_path / "r.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_settings(f, environ={})
    assert str(e.value) == f"config {f}: {expected}"


def test_accepted_kv_event_addresses():
    for ok in ("tcp://10.0.0.7:5557", "tcp://[fd00::7]:5557", "tcp://vllm-0.svc:1", "ipc:///tmp/kv.sock", ""):
        assert Settings.model_validate({"endpoints": [{"name": "a", "url": "http://h:1", "kv_events": ok}]})


def test_prefix_block_size_is_what_the_engines_are_expected_to_report_not_the_profiles():
    # Engines report their own block size (vLLM's CPU build: 128); the configured one is only what
    # is expected of them. Prompts are keyed in the profile's block size, what the policies count in.
    d = Daemon(Settings.model_validate({"prefix": {"block_size": 128}, "profile": "llama2-7b-v100"}))
    assert d.prefix.block_size == 16
    assert Daemon(Settings.model_validate({"prefix": {"block_size": 16}})).prefix.block_size == 16


def test_kv_event_addresses_resolve_from_the_url_or_the_slice():
    assert kv_events_address("10.0.0.7", None, 5557) == "tcp://10.0.0.7:5557"
    assert kv_events_address("fd00::7", None, 5557) == "tcp://[fd00::7]:5557"
    assert kv_events_address("10.0.0.7", "tcp://10.0.0.9:1", 5557) == "tcp://10.0.0.9:1"
    assert kv_events_address("10.0.0.7", "", 5557) is None
    s = Settings.model_validate({"prefix": {"kv_events": {"port": 5601}}, "endpoints": [
        {"name": "a", "url": "http://10.0.0.1:8000"}, {"name": "b", "url": "http://10.0.0.2:8000", "kv_events": ""},
        {"name": "c", "url": "http://10.0.0.3:8000", "kv_events": "tcp://10.0.0.3:7000"}]})
    d = Daemon(s)
    d._apply_all_endpoints()
    assert [ep.kv_events for ep in d.router.endpoints] == ["tcp://10.0.0.1:5601", None, "tcp://10.0.0.3:7000"]
    slices = [{"metadata": {"name": "s"}, "addressType": "IPv4",
               "ports": [{"name": "http", "port": 8000}, {"name": "kv-events", "port": 5557}],
               "endpoints": [{"addresses": ["10.0.0.8"], "targetRef": {"name": "p"}}]}]
    assert endpoints_from_slices(slices)[0].kv_events == "tcp://10.0.0.8:5557"
    slices[0]["ports"] = [{"name": "http", "port": 8000}]
    assert endpoints_from_slices(slices)[0].kv_events is None  # the daemon dials the pod at prefix.kv_events.port


# -- the prefix identity of a request ----------------------------------------------------


def ident(**kw):
    return PrefixIdentity(PrefixConfig(**kw), 16)


def test_text_blocks_are_the_first_chunks_of_the_utf8_bytes():
    text = "system: be brief\nuser: " + "héllo wörld " * 300  # non-ASCII: 2 bytes per é, ö
    got = ident().blocks_for(text)
    assert got == text_prefix_blocks(text.encode(), 16, chunk_blocks=4)
    assert got.num_blocks == len(text.encode()) // 256 * 4 and got.extents[0][1] == 4
    assert ident(chunk_blocks=1).blocks_for(text) == text_prefix_blocks(text.encode(), 16)
    assert ident(mode="off").blocks_for(text) is None and ident().blocks_for(None) is None
    assert ident().blocks_for("short").num_blocks == 0  # no whole chunk


def test_only_the_first_max_prompt_tokens_are_hashed():
    big = "é" * 600_000  # 1.2 MB of UTF-8
    cut = ident(max_prompt_tokens=1000).blocks_for(big)
    # 1000 tokens = 62 blocks of 16 -> 15 whole chunks of 4 blocks (256 bytes each) = 3,840 bytes.
    assert cut.num_blocks == 60
    assert cut == text_prefix_blocks(big.encode()[:3840], 16, chunk_blocks=4)
    whole = ident().blocks_for(big)
    assert whole.num_blocks == 131_072 // 16 and whole.extents[:15] == cut.extents
    # Token ids are cut the same way: 1000 tokens -> 62 blocks.
    ids = list(range(50_000))
    assert ident(max_prompt_tokens=1000).blocks_for(ids) == EngineKeyed(*_fields(token_prefix_blocks(ids[:992], 16)))


def test_invalid_utf8_and_bad_token_ids_never_raise():
    lone = "abc\ud800" * 100  # a lone surrogate: encoded with errors="replace"
    assert ident().blocks_for(lone) == text_prefix_blocks(lone.encode("utf-8", "replace"), 16, chunk_blocks=4)
    assert ident().blocks_for([1, -5, 3] * 20) is None
    assert ident().blocks_for([2**40] * 20) is None


def _fields(p):
    return p.extents, p.num_blocks, p.tail


def test_precise_mode_with_the_byte_tokenizer_hashes_token_blocks(caplog, tmp_path):
    text = "user: " + "x" * 1000
    with caplog.at_level(logging.WARNING, logger="routerd.prefix"):
        p = build_prefix_identity(PrefixConfig(mode="precise", tokenizer="bytes"), 16, "toy")
    assert isinstance(p.tokenizer, ByteTokenizer) and p.identity == "tokens" and p.source == "precise"
    got = p.blocks_for(text)
    assert got == EngineKeyed(*_fields(token_prefix_blocks(byte_token_array(text), 16)))
    # The emulator renders chat as routerd does: chat prompts get engine keys too.
    assert isinstance(p.blocks_for(text, chat=True), EngineKeyed)
    assert caplog.records == []  # nothing to say: the KV events are read
    # Text identities (approximate mode, or precise without a tokenizer) never carry engine keys.
    assert not isinstance(ident().blocks_for(text), EngineKeyed)
    with caplog.at_level(logging.WARNING, logger="routerd.prefix"):
        q = build_prefix_identity(PrefixConfig(mode="precise"), 16, "toy")
        build_prefix_identity(PrefixConfig(mode="precise"), 16, "toy", say=False)  # a reload that changed nothing
        missing = build_prefix_identity(PrefixConfig(mode="precise", tokenizer=str(tmp_path / "nope.json")), 16,
                                        "toy")
    assert q.tokenizer is None and q.source == "approximate" and q.blocks_for(text) == ident().blocks_for(text)
    assert missing.tokenizer is None and missing.source == "approximate"
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "no tokenizer configured" in said[0] and "nope.json does not exist" in said[1]


def test_precise_mode_with_a_bare_tokenizer_json_keys_completions_not_chat(caplog, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate("user: system: hello world again and".split())}}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    p = build_prefix_identity(PrefixConfig(mode="precise", tokenizer=str(path)), 4, "toy", say=False)
    text = "hello world again and " * 8  # 32 words: 8 blocks of 4
    got = p.blocks_for(text)
    want = EngineKeyed(*_fields(token_prefix_blocks(tok.encode(text).ids, 4)))
    assert isinstance(got, EngineKeyed) and got == want and got.num_blocks == 8
    problems = []
    p.on_problem = problems.append
    msgs = [{"role": "user", "content": text}]
    with caplog.at_level(logging.WARNING, logger="routerd.prefix"):
        chat = p.blocks_for(PrefixInput(messages=msgs, chat_text="user: " + text))
        p.blocks_for(PrefixInput(messages=msgs, chat_text="user: " + text))
    # No chat template beside a bare tokenizer.json: chat is matched approximately, said once,
    # counted every time.
    assert not isinstance(chat, EngineKeyed) and chat == text_prefix_blocks("user: " + text, 4, chunk_blocks=4)
    assert problems == ["chat_template", "chat_template"]
    assert not caplog.records  # said once, when the tokenizer loaded:
    with caplog.at_level(logging.WARNING, logger="routerd.prefix"):
        build_prefix_identity(PrefixConfig(mode="precise", tokenizer=str(path)), 4, "toy")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "has no chat template" in said[0] and "prefix.tokenizer" in said[0] and \
        "chat requests are matched against the approximate index" in said[0]


def test_no_events_is_said_only_once_a_request_there_waited_for_them(caplog):
    # An idle engine publishes nothing and is not misconfigured (found by a fresh-user pass: every
    # healthy idle engine got the "check --kv-events-config" warning). The warning waits until a
    # request sent there has had stale_after_s to bring its events; the fallback is counted always.
    from types import SimpleNamespace

    from routerd.prefix.engine_index import EngineBlockIndex

    now = [0.0]
    idx = EngineBlockIndex(16, stale_after_s=10.0, clock=lambda: now[0])
    m = Metrics()
    d = SimpleNamespace(metrics=m, _fallback_said=set(), _kv_subs={"e0": (("tcp://127.0.0.1:5599",), idx)},
                        settings=Settings.model_validate({"prefix": {"mode": "precise"}}))
    with caplog.at_level(logging.WARNING, logger="routerd.daemon.app"):
        now[0] = 60.0
        Daemon._prefix_fallback(d, "e0", "no_events")  # idle a minute: nothing to say
        idx.note_dispatch(4)
        now[0] = 65.0
        Daemon._prefix_fallback(d, "e0", "no_events")  # 5 s after a request: not yet
        assert caplog.records == []
        now[0] = 70.0
        Daemon._prefix_fallback(d, "e0", "no_events")
        Daemon._prefix_fallback(d, "e0", "no_events")  # once
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "e0's KV-event index (tcp://127.0.0.1:5599)" in said[0] and "--kv-events-config" in said[0]
    assert m.registry.get_sample_value("phasewise_prefix_fallbacks_total",
                                       {"endpoint": "e0", "reason": "no_events"}) == 4


def test_an_unquoted_yaml_off_is_mode_off(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("prefix: {mode: off}\n")  # YAML 1.1: off is false
    assert load_settings(f, environ={}).prefix.mode == "off"
    assert PrefixConfig(mode=False).mode == "off"
    with pytest.raises(ValueError):
        PrefixConfig(mode=True)


def test_what_each_request_form_hashes():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    # "system: be brief\nuser: hi" is 25 bytes: 7 tokens at 4 bytes each, rounded up.
    body = {"messages": msgs}
    assert prompt_of("chat", body) == (7, chat_prompt_text(msgs), PrefixInput(
        messages=msgs, request=body, chat_text=chat_prompt_text(msgs)))
    assert prompt_of("completions", {"prompt": "abcdefgh"}) == (2, "abcdefgh", PrefixInput("abcdefgh"))
    assert prompt_of("completions", {"prompt": ["abcd", "efgh"], "model": "m", "cache_salt": "s"}) == \
        (2, "abcd\nefgh", PrefixInput("abcd", model="m", cache_salt="s"))
    assert prompt_of("completions", {"prompt": [1, 2, 3], "cache_salt": ""}) == (3, None, PrefixInput([1, 2, 3]))
    assert prompt_of("completions", {"prompt": [[1, 2], [3]]}) == (3, None, PrefixInput([1, 2]))


# -- which policies read a prefix ---------------------------------------------------------


def test_the_cache_aware_policies_are_those_with_a_prefix_index():
    prof = toy_profile()
    found = set()
    for name, cls in POLICIES.items():
        if cls.oracle:
            continue
        pol = build_routing_policy(PolicyConfig(name=name, params=policy_params(name, 4) or {}), prof, 4)
        if prefix_indexes(pol):
            found.add(name)
    assert found == CACHE_AWARE


# -- the indexes in the router ----------------------------------------------------------


def make_router(policy, n=4, capacity=None, models=None):
    # 10,000 KV blocks per instance: the policies that size their index by the instance's blocks
    # (llmd's autoTune, lmetric) ask for more than the bounds the tests set.
    prof = toy_profile(kv_capacity_tokens=160_000)
    pol = build_routing_policy(PolicyConfig(name=policy), prof, n)
    r = Router(profile=prof, policy=pol, policy_name=policy, metrics=Metrics(), config=RouterConfig(tie_break_seed=1),
               state_max_age_s=2.0)
    r.configure_prefix(capacity)
    r.set_endpoints([DiscoveredEndpoint(f"e{i}", f"http://127.0.0.1:{9000 + i}",
                                        models=() if models is None else (models[i % len(models)],))
                     for i in range(n)])
    return r


def route(r, text, model=None, tokens=None):
    q = r.new_request(tokens or max(1, len(text) // 4), None, model=model,
                      prefix=ident(chunk_blocks=1).blocks_for(text))
    ep = r.try_dispatch_now(q)
    r.finish(q)
    return ep


def value(r, name, **labels):
    v = r.metrics.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


@pytest.mark.parametrize("policy", sorted(CACHE_AWARE))
def test_a_stream_of_unique_prompts_never_grows_an_index_past_its_bound(policy):
    r = make_router(policy, capacity=300)
    (ix,) = prefix_indexes(r.policy)
    peak = 0
    for k in range(400):
        route(r, f"{k:06d} unique prompt " + "y" * (64 * 20))  # 20 blocks of 64 bytes, distinct from block 0
        for ep in r.endpoints:
            size = ix.size(ep.index)
            assert size <= 300, (policy, k, ep.name, size)
            if k % 50 == 0:  # (a scrape collects the whole registry)
                assert value(r, "phasewise_prefix_index_blocks", endpoint=ep.name) == size
            peak = max(peak, size)
    assert peak >= 300 - 20  # the bound is reached: it is what limits the index
    assert value(r, "phasewise_prefix_match_blocks_count", source="approximate") == 400


def test_index_updates_wait_for_the_next_loop_turn_not_the_decision():
    # routerd leaves each decision's index insert (PrefixIndex.defer_updates) to the next
    # event-loop turn, off the request's path; a decision before that turn applies it first, so
    # it sees the index as without deferral; the match metric is the decision's own.
    async def main():
        r = make_router("llmd", capacity=300)
        (ix,) = prefix_indexes(r.policy)
        assert ix.defer_updates
        for k in range(100):  # 20 blocks each, about 25 per endpoint: every index at its bound
            route(r, f"{k:06d} unique prompt " + "y" * (64 * 20))
            await asyncio.sleep(0)
        assert not ix.due and all(ix._inst[ep.index].size == 300 for ep in r.endpoints)
        text = "a shared head " + "z" * (64 * 20)
        p = ident(chunk_blocks=1).blocks_for(text)
        assert p.num_blocks == 20
        ep = route(r, text)
        assert ix.due and ix._inst[ep.index].blocks.get(p.extents[0][0]) is None  # not yet stored
        assert ix.last_insert == (ep.index, 0, 20)
        ep2 = route(r, text + " and more" + "w" * (64 * 2))  # no loop turn in between: applied first
        assert ix.last_insert[0] == ep2.index
        if ep2 is ep:
            assert ix.last_insert[1] == 20  # the first insert was there for this decision
        await asyncio.sleep(0)
        assert not ix.due and all(ix._inst[e.index].size == 300 for e in r.endpoints)
        assert ix.match(ep.index, p) == 20
        assert value(r, "phasewise_prefix_match_blocks_count", source="approximate") == 102
        # One timed update per loop turn that had inserts to apply: 100 + the last one.
        assert value(r, "phasewise_prefix_index_update_seconds_count") == 101

    asyncio.run(main())


def test_each_model_policy_gets_the_bound():
    r = make_router("llmd", capacity=50, models=["a", "b"])
    route(r, "p" * 64 * 80, model="a")
    route(r, "q" * 64 * 80, model="b")
    pa, pb = r._model_policies["a"], r._model_policies["b"]
    assert {pa.index.hard_limit, pb.index.hard_limit} == {50}
    sizes = [sum(ix.size(ep.index) for ix in (pa.index, pb.index)) for ep in r.endpoints]
    assert sorted(sizes) == [0, 0, 50, 50]
    r.configure_prefix(20)  # a reload lowering the bound evicts now
    assert sum(pa.index.size(i) + pb.index.size(i) for i in range(4)) == 40


def test_removed_endpoints_are_forgotten_and_the_rest_renumbered():
    r = make_router("llmd", n=3)
    ix = r.policy.index
    texts = {}
    for k in range(30):  # until every endpoint holds some prompt
        t = f"{k:04d} conversation " + "z" * 640
        texts.setdefault(route(r, t).name, t)
        if len(texts) == 3:
            break
    assert sorted(texts) == ["e0", "e1", "e2"]
    held = {n: ix.match(r.by_name[n].index, ident(chunk_blocks=1).blocks_for(texts[n])) for n in texts}
    assert all(v > 0 for v in held.values())
    r.set_endpoints([DiscoveredEndpoint(n, f"http://127.0.0.1:{9000 + i}") for i, n in enumerate(["e0", "e1", "e2"])
                     if n != "e1"])
    assert [(ep.name, ep.index) for ep in r.endpoints] == [("e0", 0), ("e2", 1)]
    assert ix.match(1, ident(chunk_blocks=1).blocks_for(texts["e2"])) == held["e2"]  # e2's entries moved with it
    assert ix.match(1, ident(chunk_blocks=1).blocks_for(texts["e1"])) == 0
    r.set_endpoints([DiscoveredEndpoint("e0", "http://127.0.0.1:9000"),
                     DiscoveredEndpoint("e2", "http://127.0.0.1:9002"),
                     DiscoveredEndpoint("e3", "http://127.0.0.1:9003")])
    assert r.by_name["e3"].index == 2 and ix.size(2) == 0  # the new endpoint at e2's old number starts empty
    assert value(r, "phasewise_prefix_index_blocks", endpoint="e1") == 0 and \
        r.metrics.registry.get_sample_value("phasewise_prefix_index_blocks", {"endpoint": "e1"}) is None
    # Same name, another server: nothing it was sent applies to the new one.
    r.set_endpoints([DiscoveredEndpoint("e0", "http://127.0.0.1:9100"),
                     DiscoveredEndpoint("e2", "http://127.0.0.1:9002"),
                     DiscoveredEndpoint("e3", "http://127.0.0.1:9003")])
    assert ix.size(0) == 0
    assert ix.match(1, ident(chunk_blocks=1).blocks_for(texts["e2"])) == held["e2"]


def test_match_metric_is_what_the_index_held_before_the_decision():
    r = make_router("llmd")
    text = "shared system prompt " * 40  # 840 bytes: 13 blocks of 64
    first = route(r, text)
    second = route(r, text + " and a question")
    assert second is first
    assert value(r, "phasewise_prefix_match_blocks_count", source="approximate") == 2
    assert value(r, "phasewise_prefix_match_blocks_sum", source="approximate") == 0 + 13
    assert value(r, "phasewise_prefix_match_blocks_bucket", source="approximate", le="0.0") == 1
    route(r, "no prefix", tokens=3)  # less than a block: nothing inserted, nothing observed
    assert value(r, "phasewise_prefix_match_blocks_count", source="approximate") == 2


def test_prefix_fallback_series_go_with_their_endpoint():
    m = Metrics()
    m.endpoint("a", lambda: 0.0)
    m.count_prefix_fallback("a", "stale")
    m.count_prefix_fallback("a", "stale")
    m.count_prefix_fallback("b", "malformed")
    assert m.registry.get_sample_value("phasewise_prefix_fallbacks_total", {"endpoint": "a", "reason": "stale"}) == 2
    m.remove_endpoint("a")
    assert m.registry.get_sample_value("phasewise_prefix_fallbacks_total", {"endpoint": "a", "reason": "stale"}) is None
    assert m.registry.get_sample_value("phasewise_prefix_fallbacks_total",
                                       {"endpoint": "b", "reason": "malformed"}) == 1


# -- the daemon end to end (in process) --------------------------------------------------


def test_requests_carry_their_prefix_only_for_a_policy_that_reads_it():
    async def main():
        backends = [FakeBackend(f"b{i}", default_tokens=2) for i in range(3)]
        for b in backends:
            await b.start()
        d = await start_daemon(backends, policy={"name": "llmd"}, router={"tie_break_seed": 3}, predictor="none")
        try:
            seen = []
            orig = d.router.new_request

            def spy(*a, **kw):
                r = orig(*a, **kw)
                seen.append(r.features.prefix)
                return r

            d.router.new_request = spy
            history = [{"role": "system", "content": "You answer in one word. " * 30}]
            async with openai_client(d) as c:
                for turn in range(4):
                    history.append({"role": "user", "content": f"question {turn}"})
                    r = await c.chat.completions.create(model="m", messages=history, max_tokens=2)
                    history.append({"role": "assistant", "content": r.choices[0].message.content})
                got = [b.started for b in backends]
                assert sorted(got) == [0, 0, 4], got  # every turn on one backend
                await c.completions.create(model="m", prompt=[5] * 40, max_tokens=2)
            assert seen[0] == ident().blocks_for(chat_prompt_text(history[:2]))
            assert seen[-1] == EngineKeyed(*_fields(token_prefix_blocks([5] * 40, 16)))
            assert sample(d, "phasewise_prefix_prompt_blocks_count") == 5
            assert sample(d, "phasewise_prefix_match_blocks_count", source="approximate") == 5
            # Round robin keeps no index: nothing is hashed.
            await d.reload(Settings.model_validate({**d.settings.model_dump(), "policy": {"name": "round_robin"}}))
            seen.clear()
            async with openai_client(d) as c:
                await c.completions.create(model="m", prompt="x" * 2000, max_tokens=2)
            assert seen == [None] and sample(d, "phasewise_prefix_prompt_blocks_count") == 5
        finally:
            await d.stop()
            for b in backends:
                await b.stop()
    asyncio.run(main())


def test_grpc_route_with_prompt_text_has_a_prefix_and_without_it_none():
    import grpc

    from routerd.api.v1 import router_pb2, router_pb2_grpc

    async def main():
        d = await start_daemon(endpoints=[{"name": "e0", "url": "http://127.0.0.1:9"},
                                          {"name": "e1", "url": "http://127.0.0.1:10"}],
                               policy={"name": "llmd"}, predictor="none")
        seen = []
        orig = d.router.new_request

        def spy(*a, **kw):
            seen.append(kw.get("prefix"))
            return orig(*a, **kw)

        d.router.new_request = spy
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{d.grpc_port}") as ch:
                stub = router_pb2_grpc.RouterServiceStub(ch)
                text = "t" * 1000
                a = await stub.Route(router_pb2.RouteRequest(request_id="a", model="m", prompt=text))
                b = await stub.Route(router_pb2.RouteRequest(request_id="b", model="m", prompt=text + "more"))
                c = await stub.Route(router_pb2.RouteRequest(request_id="c", model="m", prompt_tokens=250))
            assert seen[0] == ident().blocks_for(text) and seen[2] is None
            # b's prompt extends a's, so it follows a (the match outweighs a's 250 tokens of KV there);
            # c carries no text: no prefix, routed on load.
            assert a.instance == b.instance
            assert c.decision == router_pb2.RouteResponse.DISPATCH
        finally:
            await d.stop()
    asyncio.run(main())


def test_a_reload_keeps_what_an_unchanged_policy_learned():
    async def main():
        backends = [FakeBackend(f"b{i}", default_tokens=1) for i in range(2)]
        for b in backends:
            await b.start()
        d = await start_daemon(backends, policy={"name": "sglang_cache_aware"}, predictor="none")
        try:
            async with openai_client(d) as c:
                await c.completions.create(model="m", prompt="p" * 3000, max_tokens=1)
            live, ix = d.router.policy, d.router.policy.index
            held = sum(ix.size(i) for i in range(2))
            assert held == 3000 // 256 * 4  # 11 chunks of 256 bytes, 4 blocks each
            base = d.settings.model_dump()
            assert await d.reload(Settings.model_validate({**base, "upstream": {"connect_timeout_s": 2.0}}))
            assert d.router.policy is live and sum(ix.size(i) for i in range(2)) == held
            # Another chunk size: the learned keys mean nothing now, so a fresh policy.
            assert await d.reload(Settings.model_validate({**base, "prefix": {"chunk_blocks": 2}}))
            assert d.router.policy is not live and sum(d.router.policy.index.size(i) for i in range(2)) == 0
        finally:
            await d.stop()
            for b in backends:
                await b.stop()
    asyncio.run(main())


# -- precise mode with a model folder: chat templates, salts, other block sizes --------------------


def _model_folder(tmp_path):
    """A word-level tokenizer with a BOS post-processor and a chat template, as a model folder."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, processors

    words = "<s> </s> <|user|> <|assistant|> hello world again and".split()
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    template = ("{{ bos_token }} {% for m in messages %}<|{{ m.role }}|> {{ m.content }} </s> {% endfor %}"
                "{% if add_generation_prompt %}<|assistant|> {% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "chat_template": template}))
    return tok


def test_precise_chat_is_rendered_with_the_folders_template_and_salted(tmp_path):
    tok = _model_folder(tmp_path)
    p = build_prefix_identity(PrefixConfig(mode="precise", tokenizer=str(tmp_path)), 4, "toy")
    assert p.chat_keyed
    text = "hello world again and " * 4
    msgs = [{"role": "user", "content": text}]
    got = p.blocks_for(PrefixInput(messages=msgs, request={}, chat_text="user: " + text))
    # By hand: <s> <|user|> 16 words </s> <|assistant|>, no second BOS (chat adds no special tokens).
    ids = tok.encode("<s> <|user|> " + text + " </s> <|assistant|> ", add_special_tokens=False).ids
    assert ids[:2] == [1, 3] and ids.count(1) == 1 and len(ids) == 20
    assert isinstance(got, EngineKeyed) and _fields(got) == _fields(token_prefix_blocks(ids, 4))
    assert got.prompt_tokens == 20  # the whole prompt was tokenized: its exact length
    # A completions prompt gets the BOS the post-processor adds.
    comp = p.blocks_for(PrefixInput(text))
    assert comp.ids.tolist() == tok.encode(text).ids and comp.ids[0] == 1
    # An adapter's or a salted request's blocks are salted as vLLM salts them; plain ones are not.
    from routerd.prefix.text import request_extra_keys

    p.lora_of = lambda model: model if model == "a1" else None
    plain = p.blocks_for(PrefixInput(text, model="base"))
    assert _fields(plain) == _fields(comp)
    for model, salt in (("a1", None), (None, "s1"), ("a1", "s1")):
        b = p.blocks_for(PrefixInput(text, model=model, cache_salt=salt))
        want = token_prefix_blocks(comp.ids, 4, extra_keys=request_extra_keys(model, salt, comp.num_blocks))
        assert _fields(b) == _fields(want) and b.extents[0] != plain.extents[0]
        # Keyed in an engine's block size of 8, with the same salts.
        assert _fields(b.at(8)) == _fields(token_prefix_blocks(comp.ids, 8, extra_keys=request_extra_keys(
            model, salt, len(comp.ids) // 8)))
    # Approximate identities (no tokenizer) never let salted and plain requests meet either.
    a = PrefixIdentity(PrefixConfig(mode="approximate", chunk_blocks=1), 4)
    a.lora_of = p.lora_of
    t = "x" * 64
    assert a.blocks_for(PrefixInput(t, cache_salt="s1")).extents[0] != a.blocks_for(PrefixInput(t)).extents[0]
    assert a.blocks_for(PrefixInput(t, model="a1")).extents[0] != a.blocks_for(PrefixInput(t)).extents[0]
    assert a.blocks_for(PrefixInput(t, model="base")) == a.blocks_for(PrefixInput(t))


def test_a_template_that_fails_or_an_image_falls_back_to_the_approximate_index(tmp_path):
    _model_folder(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no system messages') if "
                                                  "messages[0].role == 'system' else messages[0].content }}")
    p = build_prefix_identity(PrefixConfig(mode="precise", tokenizer=str(tmp_path)), 4, "toy")
    problems = []
    p.on_problem = problems.append
    ok = p.blocks_for(PrefixInput(messages=[{"role": "user", "content": "hello " * 8}], chat_text="x"))
    assert isinstance(ok, EngineKeyed)
    bad = p.blocks_for(PrefixInput(messages=[{"role": "system", "content": "s"}], chat_text="system: s" * 30))
    img = p.blocks_for(PrefixInput(messages=[{"role": "user", "content": [{"type": "image_url"}]}],
                                   chat_text="user: " * 30))
    assert not isinstance(bad, EngineKeyed) and not isinstance(img, EngineKeyed)
    assert bad == text_prefix_blocks("system: s" * 30, 4, chunk_blocks=4)
    assert problems == ["chat_render", "chat_unsupported"]


def test_an_engine_with_another_block_size_answers_in_the_views_blocks():
    from routerd.daemon.state import EndpointState
    from routerd.prefix.engine_index import EngineBlockIndex
    from routerd.prefix.kv_wire import BlockStored, EventBatch

    ep = EndpointState(0, "e", "http://h:1", None, True, toy_profile(block_size=4))
    idx = EngineBlockIndex(None, stale_after_s=None)
    ep.engine_index = idx
    ids = list(range(100, 140))  # 40 tokens: 10 blocks of 4, 5 of 8
    idx.apply(EventBatch(1.0, [], 0), 0)
    idx.apply(EventBatch(2.0, [BlockStored([1, 2, 3], None, ids[:24], 8)], 0), 1)  # 3 engine blocks of 8
    p = PrefixIdentity(PrefixConfig(mode="precise"), 4, ByteTokenizer()).blocks_for(PrefixInput(ids))
    assert p.num_blocks == 10 and idx.block_size == 8
    assert ep.engine_cached_blocks(p) == 6  # 24 tokens = 6 blocks of the profile's 4
    assert ep.engine_match(p) == 24
    assert ep.engine_cached_blocks(text_prefix_blocks("x" * 80, 4)) is None  # text chunks never match


def test_routed_answers_name_the_endpoint_and_the_cached_tokens_and_a_reset_forgets():
    async def main():
        backends = [FakeBackend(f"b{i}", default_tokens=2) for i in range(2)]
        for b in backends:
            await b.start()
        d = await start_daemon(backends, policy={"name": "llmd"}, predictor="none",
                               prefix={"chunk_blocks": 1})
        try:
            prompt = "a" * 64 * 10 + " and a question"  # 10 whole blocks of 16 tokens (64 bytes each)
            async with openai_client(d) as c:
                first = await c.completions.with_raw_response.create(model="m", prompt=prompt, max_tokens=2)
                again = await c.completions.with_raw_response.create(model="m", prompt=prompt + "?", max_tokens=2)
                streamed = await c.completions.with_raw_response.create(model="m", prompt=prompt, max_tokens=2,
                                                                        stream=True)
                async for _ in streamed.parse():
                    pass
            where = first.headers["x-phasewise-endpoint"]
            assert where in ("b0", "b1") and first.headers["x-phasewise-cached-tokens"] == "0"
            # The policy's approximate index believes the 10 blocks cached where the first went.
            assert again.headers["x-phasewise-endpoint"] == where
            assert again.headers["x-phasewise-cached-tokens"] == str(10 * 16)
            assert streamed.headers["x-phasewise-cached-tokens"] == str(10 * 16)
            # A reset through routerd reaches every endpoint; each that answered 200 is forgotten.
            backends[1].reset_status = 404  # an engine without VLLM_SERVER_DEV_MODE
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{d.http_port}/reset_prefix_cache") as r:
                    assert r.status == 502 and await r.json() == {"success": False,
                                                                  "endpoints": {"b0": 200, "b1": 404}}
            assert [b.resets for b in backends] == [1, 1]
            async with openai_client(d) as c:
                after = await c.completions.with_raw_response.create(model="m", prompt=prompt, max_tokens=2)
            want = "0" if where == "b0" else str(10 * 16)
            assert after.headers["x-phasewise-cached-tokens"] == want
            assert sample(d, "phasewise_prefix_engine_cache_lost_total", endpoint="b0", cause="cleared") == 1
        finally:
            await d.stop()
            for b in backends:
                await b.stop()

    asyncio.run(main())


def test_without_prefix_scoring_only_the_endpoint_is_named():
    async def main():
        b = await FakeBackend("solo", default_tokens=2).start()
        d = await start_daemon([b], policy={"name": "round_robin"}, predictor="none")
        try:
            async with openai_client(d) as c:
                r = await c.completions.with_raw_response.create(model="m", prompt="x" * 200, max_tokens=2)
            assert r.headers["x-phasewise-endpoint"] == "solo" and "x-phasewise-cached-tokens" not in r.headers
        finally:
            await d.stop()
            await b.stop()

    asyncio.run(main())


def test_blocks_dispatched_but_not_yet_reported_count_as_cached_until_their_events_are_due():
    from routerd.daemon.state import EndpointState
    from routerd.prefix.engine_index import EngineBlockIndex
    from routerd.prefix.kv_wire import BlockStored, EventBatch

    now = [100.0]
    ep = EndpointState(0, "e", "http://h:1", None, True, toy_profile(block_size=4))
    ep.clock = lambda: now[0]
    idx = ep.engine_index = EngineBlockIndex(None, stale_after_s=None)
    idx.apply(EventBatch(1.0, [], 0), 0)  # a fresh engine: exact, empty
    ids = list(range(1, 33))  # 8 blocks of 4
    p = PrefixIdentity(PrefixConfig(mode="precise"), 4, ByteTokenizer()).blocks_for(PrefixInput(ids))
    assert ep.engine_cached_blocks(p) == 0
    keys = [k for k, _ in p.extents]
    ep.note_pending(keys[:6])  # a request with the first 6 blocks was dispatched here
    assert ep.engine_cached_blocks(p) == 6 and ep.engine_match(p) == 24
    # Its events arrive for 3 blocks (the rest still pending): still 6.
    idx.apply(EventBatch(2.0, [BlockStored([11, 12, 13], None, ids[:12], 4)], 0), 1)
    assert ep.engine_cached_blocks(p) == 6
    # It ended: the pending blocks count only for the grace, then the engine index alone speaks.
    ep.end_pending(keys[:6])
    now[0] += EndpointState.PENDING_GRACE_S - 0.1
    assert ep.engine_cached_blocks(p) == 6
    now[0] += 0.2
    assert ep.engine_cached_blocks(p) == 3
    # A pending run counts only as the continuation of what the engine holds, never past a gap.
    ep.note_pending(keys[4:8])
    assert ep.engine_cached_blocks(p) == 3
    # The bound: the oldest keys go first.
    ep.note_pending(list(range(10**6, 10**6 + EndpointState.PENDING_MAX_KEYS + 5)))
    assert len(ep.pending) == EndpointState.PENDING_MAX_KEYS and keys[4] not in ep.pending


def test_a_burst_on_one_prefix_stays_on_one_engine_before_its_events_come():
    """Precise mode, both engine indexes answering (fresh, empty) and no event ever arriving: the
    requests after the first, sent while it runs, go where it went (its blocks are pending there)
    instead of being spread on load."""
    from routerd.prefix.engine_index import EngineBlockIndex
    from routerd.prefix.kv_wire import EventBatch

    async def main():
        backends = [FakeBackend(f"b{i}", default_tokens=2, token_s=0.05) for i in range(2)]
        for b in backends:
            await b.start()
        d = await start_daemon(backends, policy={"name": "llmd"}, predictor="none", router={"tie_break_seed": 1},
                               prefix={"mode": "precise", "tokenizer": "bytes"})
        try:
            for ep in d.router.endpoints:
                ep.engine_index = EngineBlockIndex(None, stale_after_s=None)
                ep.engine_index.apply(EventBatch(1.0, [], 0), 0)
                ep.engine_index._learn_block_size(16)
            prompt = "s" * 64 * 8 + " question"
            async with openai_client(d) as c:
                rs = await asyncio.gather(*(c.completions.with_raw_response.create(
                    model="m", prompt=prompt + str(i), max_tokens=2) for i in range(6)))
            where = {r.headers["x-phasewise-endpoint"] for r in rs}
            assert len(where) == 1, where
            assert sorted(int(r.headers["x-phasewise-cached-tokens"]) for r in rs) == [0] + [8 * 16] * 5
        finally:
            await d.stop()
            for b in backends:
                await b.stop()

    asyncio.run(main())
