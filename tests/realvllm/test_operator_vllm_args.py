"""The operator's vLLM arguments, read by vLLM 0.32's own ``vllm serve`` parser.

For a few pools (prefix off, approximate, precise with vLLM's and with a custom KV-event port and
topic, engine groups whose args give flags of their own, LoRA adapters), the rendered engine
Deployments' ``vllm serve`` arguments are parsed in the vLLM venv exactly as the ``vllm`` console
script does (``vllm/entrypoints/cli/main.py``: a ``FlexibleArgumentParser`` with the ``serve``
subcommand of ``vllm/entrypoints/cli/serve.py``, whose options ``make_arg_parser`` in
``vllm/entrypoints/launchers/cli_args.py`` adds), validated (``ServeSubcommand.validate``) and
turned into ``AsyncEngineArgs`` (``AsyncEngineArgs.from_cli_args``). The parsed values are then
compared with the pool spec and with the routerd settings the operator renders into the same
pool's ConfigMap (read by routerd's own ``load_settings``). No engine starts: only the venv and
the tiny model are needed (``EngineArgs`` resolves the model, so the pools serve the tiny
model's folder, a path as ``spec.model.name`` allows, and its adapters' folders).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest

from phasewise_operator import builders as B
from phasewise_operator.settings import OperatorSettings
from phasewise_operator.spec import check_pool, flag_uses, parse_pool_spec

POOL = B.PoolRef(name="chat", namespace="llm", uid="0b5e3c1a-0000-4000-8000-000000000001")
OPS = OperatorSettings(routerd_image="example/routerd:1", vllm_image="example/vllm:2")

# Runs in the vLLM venv: parse each argument list after "vllm serve" with vLLM's own parser.
PARSE = r'''
import dataclasses, io, json, logging, sys
from contextlib import redirect_stderr

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

class Keep(logging.Handler):
    def __init__(self):
        super().__init__()
        self.seen = []
    def emit(self, record):
        self.seen.append(record.getMessage())

def plain(v):
    if dataclasses.is_dataclass(v):
        return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    return v if v is None or isinstance(v, (bool, int, float, str)) else repr(v)

FIELDS = ("model_tag", "served_model_name", "host", "port", "enable_prompt_tokens_details", "kv_events_config",
          "block_size", "max_model_len", "enable_lora", "max_lora_rank", "lora_modules", "enforce_eager")
ENGINE = ("model", "served_model_name", "kv_events_config", "block_size", "max_model_len", "enable_lora")

keep = Keep()
logging.getLogger("vllm.utils.argparse_utils").addHandler(keep)
out = []
for args in json.load(open(sys.argv[1])):
    # As vllm/entrypoints/cli/main.py builds it, the serve subcommand only.
    parser = FlexibleArgumentParser(description="vLLM CLI")
    sub = parser.add_subparsers(required=False, dest="subparser")
    cmd = ServeSubcommand()
    cmd.subparser_init(sub).set_defaults(dispatch_function=cmd.cmd)
    keep.seen.clear()
    err = io.StringIO()
    try:
        with redirect_stderr(err):
            ns = parser.parse_args(["serve", *args])
        cmd.validate(ns)
        if ns.model_tag is not None:  # ServeSubcommand.cmd does this before building the engine args
            ns.model = ns.model_tag
        eng = AsyncEngineArgs.from_cli_args(ns)
    except (SystemExit, Exception) as e:
        out.append({"ok": False, "error": (err.getvalue() + " " + repr(e)).strip()})
        continue
    out.append({"ok": True, "warnings": list(keep.seen), "ns": {k: plain(getattr(ns, k)) for k in FIELDS},
                "engine": {k: plain(getattr(eng, k)) for k in ENGINE}})
json.dump(out, open(sys.argv[2], "w"))
'''

MODEL = "@MODEL@"
"""Replaced by the tiny model's folder."""
GPU = {
    "model": {"name": MODEL, "servedModelName": "llama-3.1-8b"},
    "engine": {"replicas": 2, "args": ["--max-model-len", "4096"], "resources": {"limits": {"nvidia.com/gpu": 1}}},
    "hardwareProfile": {"name": "llama3.1-8b-h100"},
    "routing": {"policy": "late_binding"},
}
HWM_CONFIG = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5600", "topic": "kv", "hwm": 5000}'
GROUPS = {
    "engine": {"replicas": 1, "port": 8100, "args": ["--max-model-len", "4096"],
               "resources": {"limits": {"nvidia.com/gpu": 1}}},
    "engineGroups": [
        # The engine's args: the operator's flags are added.
        {"name": "base", "model": {"name": MODEL, "servedModelName": "llama-3.1-8b"}},
        # Its own --enable-prompt-tokens-details (underscored), a --block-size and LoRA adapters.
        {"name": "lora", "model": {"name": MODEL, "servedModelName": "org/llama-lora"},
         "args": ["--enable_prompt_tokens_details", "--block-size", "16", "--enable-lora", "--max-lora-rank", "8",
                  "--lora-modules", "a1=@A1@", "a2=@A2@"]},
        # Its own --kv-events-config (agreeing with routerd, with a high-water mark of its own).
        {"name": "own-kv", "model": {"name": MODEL, "servedModelName": "llama-3.1-8b"},
         "args": ["--kv-events-config", HWM_CONFIG, "--enforce-eager"]},
        # The counts turned off on purpose.
        {"name": "no-details", "model": {"name": MODEL, "servedModelName": "llama-3.1-8b"},
         "args": ["--no-enable-prompt-tokens-details"]},
    ],
    "hardwareProfile": {"name": "llama3.1-8b-h100"},
    "routing": {"policy": "late_binding", "prefix": {"mode": "precise", "kvEvents": {"port": 5600, "topic": "kv"}}},
}


def _with_prefix(spec: dict, prefix: dict | None) -> dict:
    s = copy.deepcopy(spec)
    if prefix is not None:
        s["routing"]["prefix"] = prefix
    return s


POOLS = {
    "unset": GPU,
    "off": _with_prefix(GPU, {"mode": "off"}),
    "approximate": _with_prefix(GPU, {"mode": "approximate"}),
    "precise-default": _with_prefix(GPU, {"mode": "precise"}),
    "precise-custom": _with_prefix(GPU, {"mode": "precise", "kvEvents": {"port": 6001, "topic": "pool-a"}}),
    "groups": GROUPS,
}


def _render(spec: dict, paths: dict[str, str]) -> tuple[dict[str, list[str]], dict]:
    """{engine Deployment name: vllm args} and routerd's ConfigMap of ``spec``, ``@NAME@`` replaced by ``paths``."""
    text = json.dumps(spec)
    for key, path in paths.items():
        text = text.replace(f"@{key}@", path)
    ps = parse_pool_spec(json.loads(text))
    check_pool(ps)
    kids = B.pool_children(POOL, ps, OPS)
    deps = {o["metadata"]["name"]: o for o in kids if o["kind"] == "Deployment"
            and o["metadata"]["labels"][B.LABEL_COMPONENT] == "engine"}
    args = {}
    for name, dep in deps.items():
        (vllm,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"]
        assert vllm["command"] == ["vllm", "serve"]
        args[name] = vllm["args"]
    cm = next(o for o in kids if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "chat-routerd")
    return args, cm


def _vllm_parse(python: Path, arg_lists: list[list[str]], tmp_path: Path) -> list[dict]:
    script, src, dst = tmp_path / "parse.py", tmp_path / "in.json", tmp_path / "out.json"
    script.write_text(PARSE)
    src.write_text(json.dumps(arg_lists))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([str(python), str(script), str(src), str(dst)], capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return json.loads(dst.read_text())


@pytest.fixture(scope="module")
def parsed(vllm_python, tiny_model, tmp_path_factory):
    """{(pool, Deployment): vLLM's parse}, the rendered args, routerd's settings, and control cases."""
    from routerd.daemon.config import load_settings

    tmp = tmp_path_factory.mktemp("vllm-args")
    paths = {"MODEL": str(tiny_model.model), "A1": str(tiny_model.adapters["a1"]),
             "A2": str(tiny_model.adapters["a2"])}
    rendered, settings = {}, {}
    for pool, spec in POOLS.items():
        args, cm = _render(spec, paths)
        for dep, a in args.items():
            rendered[(pool, dep)] = a
        f = tmp / f"{pool}.yaml"
        f.write_text(cm["data"]["routerd.yaml"])
        settings[pool] = load_settings(f, environ={})
    keys = list(rendered)
    base = rendered[("precise-default", "chat-engine")]
    controls = {
        # The parser does refuse what it does not know (this harness reports it, not passes it).
        "bogus": [*base, "--not-a-vllm-flag"],
        # Why check_pool refuses dotted --kv-events-config keys: they replace the whole JSON value.
        "dotted": [*base, "--kv-events-config.hwm", "10"],
        # Every spelling flag_uses recognizes is the same option to vLLM.
        "underscore": [paths["MODEL"], "--enable_prompt_tokens_details", "--kv_events_config", '{"topic":"u"}'],
        "inline": [paths["MODEL"], "--kv-events-config={\"topic\":\"i\"}"],
        "negated": [paths["MODEL"], "--enable-prompt-tokens-details", "--no_enable_prompt_tokens_details"],
    }
    results = _vllm_parse(vllm_python, [rendered[k] for k in keys] + list(controls.values()), tmp)
    out = dict(zip(keys, results[:len(keys)]))
    return {"vllm": out, "args": rendered, "settings": settings, "paths": paths,
            "controls": dict(zip(controls, results[len(keys):]))}


def _ok(parsed: dict, pool: str, dep: str) -> dict:
    r = parsed["vllm"][(pool, dep)]
    assert r["ok"], (pool, dep, r.get("error"))
    # No flag given twice (vLLM's parser warns "Found duplicate keys" and keeps the last).
    assert r["warnings"] == [], (pool, dep, r["warnings"])
    return r


@pytest.mark.parametrize("pool", ["unset", "off", "approximate"])
def test_without_precise_mode_vllm_reads_the_model_port_and_token_details(parsed, pool):
    r = _ok(parsed, pool, "chat-engine")
    ns, eng = r["ns"], r["engine"]
    assert ns["model_tag"] == eng["model"] == parsed["paths"]["MODEL"]
    assert ns["served_model_name"] == ["llama-3.1-8b"] and eng["served_model_name"] == ["llama-3.1-8b"]
    assert (ns["host"], ns["port"]) == ("0.0.0.0", 8000)
    assert ns["enable_prompt_tokens_details"] is True
    assert ns["kv_events_config"] is None and eng["kv_events_config"] is None
    # The engine chooses its block size (16 on most GPU backends, 128 on the CPU build).
    assert ns["block_size"] is None and eng["block_size"] is None
    assert ns["max_model_len"] == eng["max_model_len"] == 4096
    assert parsed["settings"][pool].models == ["llama-3.1-8b"]


@pytest.mark.parametrize("pool, port, topic", [("precise-default", 5557, ""), ("precise-custom", 6001, "pool-a")])
def test_precise_mode_publishes_where_routerd_subscribes(parsed, pool, port, topic):
    r = _ok(parsed, pool, "chat-engine")
    kv = r["engine"]["kv_events_config"]
    assert kv == r["ns"]["kv_events_config"]
    assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
    assert (kv["endpoint"], kv["topic"]) == (f"tcp://*:{port}", topic)
    # What routerd reads (its own settings model, from the rendered ConfigMap) is the same.
    s = parsed["settings"][pool]
    assert s.prefix.mode == "precise"
    assert kv["endpoint"] == f"tcp://*:{s.prefix.kv_events.port}" and kv["topic"] == s.prefix.kv_events.topic
    assert s.kubernetes.kv_events_port_name == "kv-events"
    # Nothing pins a block size: neither vLLM's args nor routerd's prefix settings.
    assert r["ns"]["block_size"] is None and s.prefix.model_fields_set.isdisjoint({"block_size"})
    assert r["ns"]["enable_prompt_tokens_details"] is True
    assert (r["ns"]["port"], r["ns"]["served_model_name"]) == (8000, ["llama-3.1-8b"])


def test_groups_with_their_own_flags(parsed):
    s = parsed["settings"]["groups"]
    want_endpoint, want_topic = f"tcp://*:{s.prefix.kv_events.port}", s.prefix.kv_events.topic
    assert (want_endpoint, want_topic) == ("tcp://*:5600", "kv")
    assert s.models == ["llama-3.1-8b", "org/llama-lora"]
    seen = {}
    for g in ("base", "lora", "own-kv", "no-details"):
        r = _ok(parsed, "groups", f"chat-engine-{g}")
        ns = r["ns"]
        assert ns["port"] == 8100 and ns["host"] == "0.0.0.0"
        # The engine's args reach only the group without args of its own (they replace, not merge).
        assert ns["max_model_len"] == (4096 if g == "base" else None), g
        kv = r["engine"]["kv_events_config"]
        assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq", g
        assert (kv["endpoint"], kv["topic"]) == (want_endpoint, want_topic), g
        seen[g] = ns
        # Each of the operator's flags is given once, the user's copy where the user gave one.
        args = parsed["args"][("groups", f"chat-engine-{g}")]
        assert len(flag_uses(args, "--kv-events-config")) == 1
        assert len(flag_uses(args, "--enable-prompt-tokens-details")) == 1
    assert seen["base"]["enable_prompt_tokens_details"] is True and seen["base"]["block_size"] is None
    lora = seen["lora"]
    assert lora["served_model_name"] == ["org/llama-lora"] and lora["enable_prompt_tokens_details"] is True
    assert lora["block_size"] == 16  # the user's own, passed on
    assert lora["enable_lora"] is True and lora["max_lora_rank"] == 8
    assert [m["name"] for m in lora["lora_modules"]] == ["a1", "a2"]
    assert [m["path"] for m in lora["lora_modules"]] == [parsed["paths"]["A1"], parsed["paths"]["A2"]]
    # The user's own KV-event config stands, high-water mark included.
    own = parsed["vllm"][("groups", "chat-engine-own-kv")]["engine"]["kv_events_config"]
    assert own["hwm"] == 5000 and seen["own-kv"]["enforce_eager"] is True
    assert seen["own-kv"]["enable_prompt_tokens_details"] is True
    assert seen["no-details"]["enable_prompt_tokens_details"] is False


def test_controls(parsed):
    c = parsed["controls"]
    assert not c["bogus"]["ok"] and "unrecognized arguments: --not-a-vllm-flag" in c["bogus"]["error"]
    # A dotted key after the operator's JSON: events off, vLLM's default endpoint. check_pool refuses it.
    dotted = c["dotted"]
    assert dotted["ok"] and dotted["ns"]["kv_events_config"]["hwm"] == 10
    assert dotted["ns"]["kv_events_config"]["enable_kv_cache_events"] is False
    assert dotted["ns"]["kv_events_config"]["endpoint"] == "tcp://*:5557"
    assert c["underscore"]["ns"]["enable_prompt_tokens_details"] is True
    assert c["underscore"]["ns"]["kv_events_config"]["topic"] == "u"
    assert c["inline"]["ns"]["kv_events_config"]["topic"] == "i"
    assert c["negated"]["ns"]["enable_prompt_tokens_details"] is False
    for name in ("underscore", "inline", "negated"):
        assert c[name]["ok"] and c[name]["warnings"] == [], (name, c[name])
    assert len(flag_uses(["--enable_prompt_tokens_details"], "--enable-prompt-tokens-details")) == 1
