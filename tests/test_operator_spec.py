"""Spec parsing and the checks the schema cannot make: each error names the field; operator settings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))

from phasewise_operator import settings as OS  # noqa: E402
from phasewise_operator.spec import SpecError, check_pool, parse_job_spec, parse_pool_spec, profile_label  # noqa: E402

M = {"model": {"name": "m"}}


@pytest.mark.parametrize("spec,field,words", [
    ({"engine": {"replicas": -1}}, "spec.engine.replicas", "greater than or equal to 0"),
    ({"engine": {"tolerations": [{"operator": "Sometimes"}]}}, "spec.engine.tolerations[0].operator", "'Exists'"),
    ({"hardwareProfile": {"name": "a", "inline": {"grad1": 1, "grad2": 1, "overheadS": 0, "kvCapacityTokens": 16}}},
     "spec.hardwareProfile", "exactly one"),
    ({"routing": {"queueLimit": 0}}, "spec.routing.queueLimit", "greater than or equal to 1"),
    ({"routerd": {"service": {"type": "ExternalName"}}}, "spec.routerd.service.type", "'ClusterIP'"),
    ({"routing": {"prefix": {"mode": "exact"}}}, "spec.routing.prefix.mode", "'approximate'"),
    ({"routing": {"prefix": {"blockSize": 0}}}, "spec.routing.prefix.blockSize", "greater than or equal to 1"),
    ({"routing": {"prefix": {"kvEvents": {"staleAfterSeconds": -1}}}},
     "spec.routing.prefix.kvEvents.staleAfterSeconds", "greater than 0"),
])
def test_parse_errors_name_the_camelcase_field(spec, field, words):
    with pytest.raises(SpecError) as e:
        parse_pool_spec({**M, **spec})
    assert e.value.field == field and words in e.value.message
    assert str(e.value).startswith(field + ": ")


def test_missing_spec_and_model():
    with pytest.raises(SpecError, match="^spec: missing"):
        parse_pool_spec(None)
    with pytest.raises(SpecError, match=r"^spec.model: set spec.model \(one model\) or spec.engineGroups"):
        parse_pool_spec({})


G2 = {"engine": {"replicas": 2, "args": ["--enforce-eager"], "nodeSelector": {"gpu": "a100"},
                 "env": [{"name": "HF_TOKEN", "value": "t"}], "resources": {"limits": {"nvidia.com/gpu": 1}},
                 "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
      "engineGroups": [
          {"name": "llama", "model": {"name": "meta-llama/Llama-2-7b-hf", "servedModelName": "llama-2-7b"}},
          {"name": "llama-h100", "model": {"name": "meta-llama/Llama-2-7b-hf", "servedModelName": "llama-2-7b"},
           "replicas": 5, "args": [], "nodeSelector": {"gpu": "h100"}, "env": [{"name": "X", "value": "1"}],
           "resources": {"limits": {"nvidia.com/gpu": 2}}, "tolerations": []},
          {"name": "code", "model": {"name": "codellama/CodeLlama-7b-hf"}, "replicas": 0}]}


def test_engine_groups_inherit_unset_fields_from_the_engine():
    ps = parse_pool_spec(G2)
    check_pool(ps)
    a, b, c = ps.groups()
    assert ps.multi_model and ps.model is None
    # Unset: the pool's engine value.
    assert (a.name, a.index, a.replicas, a.args, a.node_selector) == ("llama", 0, 2, ["--enforce-eager"], {"gpu": "a100"})
    assert [e.name for e in a.env] == ["HF_TOKEN"] and a.resources.limits == {"nvidia.com/gpu": 1}
    assert [t.key for t in a.tolerations] == ["nvidia.com/gpu"]
    # Set, even to an empty list: replaces (no merge).
    assert (b.replicas, b.args, b.node_selector, b.tolerations) == (5, [], {"gpu": "h100"}, [])
    assert [e.name for e in b.env] == ["X"] and b.resources.limits == {"nvidia.com/gpu": 2}
    assert (c.replicas, c.model.served, c.field("replicas")) == (0, "codellama/CodeLlama-7b-hf",
                                                                 "spec.engineGroups[2].replicas")
    # Two groups of one model: listed once, in spec order.
    assert ps.served_models() == ["llama-2-7b", "codellama/CodeLlama-7b-hf"]
    assert ps.total_replicas() == 2 + 5 + 0


def test_the_single_model_form_is_one_unnamed_group():
    ps = parse_pool_spec({**M, "engine": {"replicas": 4}})
    (g,) = ps.groups()
    assert (g.name, g.index, g.replicas, g.model.served) == ("", None, 4, "m")
    assert not ps.multi_model and ps.served_models() == ["m"] and ps.total_replicas() == 4
    assert (g.field("replicas"), g.field("model")) == ("spec.engine.replicas", "spec.model")


def _groups(*names, **extra):
    return {"engineGroups": [{"name": n, "model": {"name": f"m-{i}"}, **extra} for i, n in enumerate(names)]}


@pytest.mark.parametrize("spec,field,words", [
    (_groups("a", "b", "a"), "spec.engineGroups[2].name", "duplicate group name 'a'"),
    ({**M, **_groups("a")}, "spec.engineGroups", "set spec.model or spec.engineGroups, not both"),
    ({"engineGroups": []}, "spec.engineGroups", "needs at least one group"),
    (_groups("a", "Chat"), "spec.engineGroups[1].name", "should match pattern"),
    (_groups("a" * 21), "spec.engineGroups[0].name", "at most 20 characters"),
    (_groups("x", "b-routerd"), "spec.engineGroups[1].name", "must not contain the word engine, routerd or epp"),
    (_groups("engine"), "spec.engineGroups[0].name", "must not contain the word engine, routerd or epp"),
    (_groups("engine-b"), "spec.engineGroups[0].name", "must not contain the word engine, routerd or epp"),
    # group epp's <a>-engine-epp would be pool a-engine's picker Service
    (_groups("epp"), "spec.engineGroups[0].name", "must not contain the word engine, routerd or epp"),
    ({"engineGroups": [{"name": "a"}]}, "spec.engineGroups[0].model", "Field required"),
    ({"engineGroups": [{"name": "a", "model": {"name": ""}}]}, "spec.engineGroups[0].model.name", "at least 1"),
    (_groups("a", replicas=-1), "spec.engineGroups[0].replicas", "greater than or equal to 0"),
    (_groups("a", tolerations=[{"operator": "Sometimes"}]), "spec.engineGroups[0].tolerations[0].operator",
     "'Exists'"),
])
def test_engine_group_parse_errors_name_the_field(spec, field, words):
    with pytest.raises(SpecError) as e:
        parse_pool_spec(spec)
    assert e.value.field == field, e.value
    assert words in e.value.message, e.value


def test_engine_group_names_that_only_look_reserved_are_fine():
    ps = parse_pool_spec(_groups("engines", "routerd2", "my-engineer"))
    assert [g.name for g in ps.groups()] == ["engines", "routerd2", "my-engineer"]


@pytest.mark.parametrize("group,field,words", [
    ({"resources": {"requests": {"nvidia.com/gpu": 1}}}, "spec.engineGroups[1].resources", "must not request"),
    ({"args": ["--enforce-eager"]}, "spec.engineGroups[1].args", "emulated pool must not"),
])
def test_emulated_groups_are_checked_like_the_engine(group, field, words):
    spec = {"emulated": True, "engineGroups": [{"name": "a", "model": {"name": "m"}},
                                               {"name": "b", "model": {"name": "n"}, **group}]}
    ps = parse_pool_spec(spec)
    with pytest.raises(SpecError) as e:
        check_pool(ps)
    assert e.value.field == field and words in e.value.message, e.value


@pytest.mark.parametrize("spec,field,words", [
    ({"routing": {"policy": "fastest"}}, "spec.routing.policy", "unknown policy 'fastest'; valid: round_robin"),
    ({"routing": {"policy": "oracle"}}, "spec.routing.policy", "oracle policy runs only in the simulator"),
    ({"routing": {"policy": "late_binding", "params": {"reserve_fraction": 1.5}}},
     "spec.routing.params.reserve_fraction", "less than 1"),
    ({"routing": {"policy": "late_binding", "params": {"speed": 2}}}, "spec.routing.params.speed", "reserve_fraction"),
    ({"routing": {"policy": "dqn"}}, "spec.routing.checkpoint", "needs a checkpoint"),
    ({"routing": {"policy": "dqn", "checkpoint": {"configMap": "c"}, "params": {"checkpoint": "/x"}}},
     "spec.routing.params.checkpoint", "routing.checkpoint.configMap"),
    ({"routing": {"policy": "learned_linear", "params": {"checkpoint": "/x"}}},
     "spec.routing.params.checkpoint", "shipped checkpoint here: default, public-mix, azure-conv; got '/x'"),
    ({"hardwareProfile": {"name": "h100-dream"}}, "spec.hardwareProfile.name", "unknown profile 'h100-dream'"),
    ({"hardwareProfile": {"inline": {"basedOn": "nope", "grad1": 1e-4, "grad2": 1e-5, "overheadS": 0,
                                     "kvCapacityTokens": 8192}}},
     "spec.hardwareProfile.inline.basedOn", "unknown profile 'nope'"),
    ({"hardwareProfile": {"inline": {"grad1": 1e-4, "grad2": 1e-5, "overheadS": 0, "kvCapacityTokens": 8200}}},
     "spec.hardwareProfile.inline.kvCapacityTokens", "not a multiple of blockSize=16"),
    ({"predictor": {"name": "oracle-bucket"}}, "spec.predictor.name",
     "unknown predictor 'oracle-bucket'; valid: default, none, majority, task-prior, length-only, length+task"),
    ({"emulated": True, "engine": {"resources": {"requests": {"nvidia.com/gpu": 1}}}},
     "spec.engine.resources", "must not request nvidia.com/gpu"),
    ({"emulated": True, "engine": {"args": ["--enforce-eager"]}}, "spec.engine.args", "emulated pool must not"),
    ({"engine": {"port": 9000}, "sidecar": {"port": 9000}}, "spec.sidecar.port", "must differ"),
])
def test_checks_beyond_the_schema_name_the_field(spec, field, words):
    ps = parse_pool_spec({**M, **spec})
    with pytest.raises(SpecError) as e:
        check_pool(ps)
    assert e.value.field == field, e.value
    assert words in e.value.message, e.value


def test_good_specs_pass_and_label_their_profile():
    ps = parse_pool_spec({**M, "routing": {"policy": "dqn", "checkpoint": {"configMap": "c"},
                                           "params": {"allow_hold": False}}})
    check_pool(ps)
    # An expected engine block size other than the profile's (vLLM's CPU build: 128): routerd keys
    # each engine's blocks in the size it reports; the profile's 16 only counts KV capacity.
    check_pool(parse_pool_spec({**M, "routing": {"prefix": {"mode": "precise", "blockSize": 128}}}))
    assert profile_label(ps) == "llama2-7b-v100"
    check_pool(parse_pool_spec({**M, "routing": {"policy": "learned_linear", "params": {"checkpoint": "azure-conv"}}}))
    ps = parse_pool_spec({**M, "hardwareProfile": {"inline": {"basedOn": "llama2-7b-a100", "grad1": 5e-5,
                                                              "grad2": 3.3e-5, "overheadS": 0.01,
                                                              "kvCapacityTokens": 118784}}})
    check_pool(ps)
    assert profile_label(ps) == "inline(llama2-7b-a100)"
    assert ps.model.served == "m"


def test_the_predictor_defaults_to_the_shipped_model_and_accepts_none_and_the_baselines():
    from routerd.predictor.assign import BASELINE_NAMES, DEFAULT_PREDICTOR

    ps = parse_pool_spec(M)
    assert ps.predictor is not None and ps.predictor.name == DEFAULT_PREDICTOR == "default"
    assert ps.predictor.persistent_volume_claim is None
    check_pool(ps)
    for name in ("default", "none", *BASELINE_NAMES):
        ps = parse_pool_spec({**M, "predictor": {"name": name}})
        check_pool(ps)
        assert ps.predictor.name == name
    with pytest.raises(SpecError) as e:  # a name and a volume: one or the other
        parse_pool_spec({**M, "predictor": {"name": "none", "persistentVolumeClaim": {"claimName": "c"}}})
    assert e.value.field == "spec.predictor"


def test_job_spec():
    js = parse_job_spec({"poolRef": {"name": "p"}, "task": "train"})
    assert js.train_task.episodes == 30 and js.apply is True and js.profile_task.args == []
    with pytest.raises(SpecError) as e:
        parse_job_spec({"poolRef": {"name": "p"}, "task": "bench"})
    assert e.value.field == "spec.task"


def test_settings_from_env():
    s = OS.from_env({"PHASEWISE_NAMESPACES": "a, b,", "PHASEWISE_ROUTERD_IMAGE": "r:1",
                     "PHASEWISE_RESYNC_SECONDS": "60", "PHASEWISE_PEERING_MODE": "mandatory"})
    assert s.namespaces == ("a", "b") and not s.clusterwide
    assert s.routerd_image == "r:1" and s.resync_seconds == 60.0 and s.peering_mode == "mandatory"
    assert OS.from_env({}).clusterwide and OS.from_env({}).peering_priority == 0
    with pytest.raises(OS.SettingsError, match=r"^PHASEWISE_RESYNC_SECONDS='0.5': .*greater than or equal to 1"):
        OS.from_env({"PHASEWISE_RESYNC_SECONDS": "0.5"})
    with pytest.raises(OS.SettingsError, match="PHASEWISE_PEERING_MODE"):
        OS.from_env({"PHASEWISE_PEERING_MODE": "leader"})


def test_peering_priorities_differ_per_replica():
    """kopf pauses every operator that shares the highest priority: replicas must get distinct ones."""
    names = [f"phasewise-operator-7d9f8c6b5-{s}" for s in ("x2k4p", "q9z7m", "b8n3v", "l0w1e")]
    prios = [OS.from_env({"POD_NAME": n}).peering_priority for n in names]
    assert len(set(prios)) == len(prios) and all(1 <= p < 2**31 for p in prios)
    assert OS.from_env({"POD_NAME": names[0], "PHASEWISE_PEERING_PRIORITY": "7"}).peering_priority == 7
