"""The CRDs in crds/: generated from routerd's registries, structural, and validating what they should.

The structural part (types, enums, minimums, patterns, required fields, defaults) is
checked here with a JSON-schema validator; the CEL rules need a real API server
(tests/k8s/test_operator_api.py).
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))

from phasewise_operator import gen_crds  # noqa: E402
from phasewise_operator.spec import InlineProfile, JobSpec, PoolSpec  # noqa: E402

jsonschema = pytest.importorskip("jsonschema")


def _load(name: str) -> dict:
    text = (REPO / "crds" / name).read_text()
    return yaml.safe_load(text)


POOL = _load("llmrouterpools.yaml")
JOB = _load("llmrouterjobs.yaml")


def _root(crd: dict) -> dict:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _validator(crd: dict):
    return jsonschema.Draft4Validator(_root(crd))


def _errors(crd: dict, obj: dict) -> list[str]:
    return sorted("/".join(str(p) for p in e.absolute_path) + ": " + e.message
                  for e in _validator(crd).iter_errors(obj))


def _pool(spec: dict) -> dict:
    return {"apiVersion": "phasewise.io/v1alpha1", "kind": "LLMRouterPool", "metadata": {"name": "p"}, "spec": spec}


# ---------------------------------------------------------------- generated, in sync

def test_generated_files_are_current(tmp_path):
    """crds/ and the chart's copies are exactly what gen_crds writes now (run it after a registry change)."""
    for path, text in gen_crds.targets(REPO).items():
        assert path.read_text() == text, f"{path} is stale: run python -m phasewise_operator.gen_crds"
    assert gen_crds.main(["--check", "--root", str(REPO)]) == 0
    # --check reports a missing file as stale, and writing creates it.
    assert gen_crds.main(["--check", "--root", str(tmp_path)]) == 1
    assert gen_crds.main(["--root", str(tmp_path)]) == 0
    assert (tmp_path / "crds" / "llmrouterpools.yaml").read_text() == (REPO / "crds" / "llmrouterpools.yaml").read_text()


def test_enums_equal_routerd_registries():
    from routerd.policies.registry import POLICIES
    from routerd.predictor.assign import BASELINE_NAMES, DEFAULT_PREDICTOR
    from routerd.profiles import profile_names
    from routerd.rl.reward import REWARD_VARIANTS

    spec = _root(POOL)["properties"]["spec"]["properties"]
    policies = spec["routing"]["properties"]["policy"]["enum"]
    assert policies == [n for n, c in POLICIES.items() if not c.oracle]
    assert "oracle" not in policies and "decode_balancer" not in policies and "dqn" in policies
    assert spec["hardwareProfile"]["properties"]["name"]["enum"] == profile_names()
    assert spec["hardwareProfile"]["properties"]["inline"]["properties"]["basedOn"]["enum"] == profile_names()
    assert spec["predictor"]["properties"]["name"]["enum"] == ["default", "none", *BASELINE_NAMES]
    assert gen_crds.DEFAULT_PREDICTOR == DEFAULT_PREDICTOR  # the operator's default is routerd's
    assert spec["predictor"]["default"] == {"name": DEFAULT_PREDICTOR}
    jspec = _root(JOB)["properties"]["spec"]["properties"]
    assert jspec["train"]["properties"]["variant"]["enum"] == list(REWARD_VARIANTS)
    assert jspec["task"]["enum"] == ["profile", "train"]


# ---------------------------------------------------------------- structural schema rules

def _walk(node: dict, path: str):
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from _walk(child, f"{path}.{name}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}.*")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")


@pytest.mark.parametrize("crd", [POOL, JOB], ids=["pool", "job"])
def test_schema_is_structural(crd):
    """The apiextensions structural-schema rules: a type everywhere, no refs, no additionalProperties
    beside properties, metadata left to the server; anyOf only for int-or-string."""
    for path, node in _walk(_root(crd), ""):
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        elif not node.get("x-kubernetes-preserve-unknown-fields"):
            assert node.get("type") in ("object", "array", "string", "integer", "number", "boolean"), path
        assert "$ref" not in node and "definitions" not in node, path
        assert not ("properties" in node and "additionalProperties" in node), path
        assert node.get("additionalProperties") is not False, path
        if node.get("type") == "array":
            assert isinstance(node.get("items"), dict), path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string"), f"{path}: anyOf only for int-or-string"
        for key in node:
            assert key in _ALLOWED_KEYS, f"{path}: {key} is not an OpenAPI v3 keyword the API server accepts"
    root = _root(crd)
    meta = root["properties"]["metadata"]
    assert meta["type"] == "object" and set(meta["properties"]) == {"name"}  # the only restriction allowed
    assert set(meta["properties"]["name"]) <= {"type", "maxLength", "pattern", "description"}
    assert root["required"] == ["spec"]


_ALLOWED_KEYS = {
    "type", "description", "properties", "required", "items", "additionalProperties", "enum", "default", "format",
    "minimum", "maximum", "exclusiveMinimum", "minLength", "maxLength", "pattern", "minItems", "maxItems",
    "maxProperties",
    "anyOf", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-validations",
    "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
}


@pytest.mark.parametrize("crd", [POOL, JOB], ids=["pool", "job"])
def test_defaults_validate_against_their_own_schema(crd):
    for path, node in _walk(_root(crd), ""):
        if "default" in node:
            errs = list(jsonschema.Draft4Validator(node).iter_errors(node["default"]))
            assert not errs, f"{path}: default {node['default']!r}: {errs[0].message}"


@pytest.mark.parametrize("crd", [POOL, JOB], ids=["pool", "job"])
def test_cel_rules_name_existing_fields(crd):
    for path, node in _walk(_root(crd), ""):
        for rule in node.get("x-kubernetes-validations") or []:
            assert rule["rule"] and rule["message"], path
            fp = rule.get("fieldPath")
            if fp is None:
                continue
            assert fp.startswith("."), f"{path}: {fp}"
            if fp == ".metadata.name":
                continue
            target = node
            for part in fp[1:].split("."):
                assert part in (target.get("properties") or {}), f"{path}: fieldPath {fp} does not exist"
                target = target["properties"][part]
            # every field a rule reads with has(self.x...) exists too
            for ref in re.findall(r"self\.([a-zA-Z.]+)", rule["rule"]):
                t = node
                for part in ref.split("."):
                    if part in ("metadata", "name", "size", "matches") or t.get("type") == "array":
                        break  # past an array come CEL macros (all, exists) over its items
                    assert part in (t.get("properties") or {}), f"{path}: rule reads missing {ref}"
                    t = t["properties"][part]


def _path_exists(root: dict, json_path: str) -> bool:
    node = root
    for part in re.sub(r"\[\?\(.*?\)\]", "[]", json_path).lstrip(".").split("."):
        part = part.removesuffix("[]")
        if part == "metadata":
            return True
        if node.get("type") == "array":
            node = node["items"]
        if part not in (node.get("properties") or {}):
            return False
        node = node["properties"][part]
    return True


@pytest.mark.parametrize("crd", [POOL, JOB], ids=["pool", "job"])
def test_printer_columns_and_scale_paths_exist(crd):
    version = crd["spec"]["versions"][0]
    for col in version["additionalPrinterColumns"]:
        assert _path_exists(_root(crd), col["jsonPath"]), col
    scale = version["subresources"].get("scale")
    if scale:
        root = _root(crd)
        assert root["properties"]["spec"]["properties"]["engine"]["properties"]["replicas"]["type"] == "integer"
        for key in ("specReplicasPath", "statusReplicasPath", "labelSelectorPath"):
            assert _path_exists(root, scale[key]), key
    assert version["subresources"]["status"] == {}


# ---------------------------------------------------------------- schema <-> pydantic model

def _schema_fields(node: dict) -> set[str]:
    return set((node.get("properties") or {}))


def _model_fields(model) -> set[str]:
    return {info.alias or name for name, info in model.model_fields.items()}


def _pairs():
    spec = _root(POOL)["properties"]["spec"]
    yield "pool", spec, PoolSpec
    from phasewise_operator import spec as S

    props = spec["properties"]
    yield "model", props["model"], S.ModelSpec
    yield "engineGroups[]", props["engineGroups"]["items"], S.EngineGroupSpec
    yield "engineGroups[].model", props["engineGroups"]["items"]["properties"]["model"], S.ModelSpec
    yield "engineGroups[].env[]", props["engineGroups"]["items"]["properties"]["env"]["items"], S.EnvVar
    yield "engine", props["engine"], S.EngineSpec
    yield "engine.env[]", props["engine"]["properties"]["env"]["items"], S.EnvVar
    yield "engine.tolerations[]", props["engine"]["properties"]["tolerations"]["items"], S.Toleration
    yield "engine.resources", props["engine"]["properties"]["resources"], S.Resources
    yield "sidecar", props["sidecar"], S.SidecarSpec
    yield "hardwareProfile", props["hardwareProfile"], S.HardwareProfileRef
    yield "hardwareProfile.inline", props["hardwareProfile"]["properties"]["inline"], InlineProfile
    yield "routing", props["routing"], S.RoutingSpec
    yield "routing.checkpoint", props["routing"]["properties"]["checkpoint"], S.CheckpointRef
    yield "routing.prefix", props["routing"]["properties"]["prefix"], S.PrefixSpec
    yield "routing.prefix.kvEvents", props["routing"]["properties"]["prefix"]["properties"]["kvEvents"], S.KvEventsSpec
    yield "predictor", props["predictor"], S.PredictorSpec
    yield "predictor.pvc", props["predictor"]["properties"]["persistentVolumeClaim"], S.PredictorVolume
    yield "routerd", props["routerd"], S.RouterdSpec
    yield "routerd.service", props["routerd"]["properties"]["service"], S.ServiceSpec
    yield "routerd.podDisruptionBudget", props["routerd"]["properties"]["podDisruptionBudget"], S.DisruptionBudget
    yield "engine.podDisruptionBudget", props["engine"]["properties"]["podDisruptionBudget"], S.DisruptionBudget
    yield "engine.topologySpreadConstraints[]", props["engine"]["properties"]["topologySpreadConstraints"]["items"], \
        S.TopologySpread
    gw = props["gateway"]
    yield "gateway", gw, S.GatewaySpec
    yield "gateway.inferencePool", gw["properties"]["inferencePool"], S.InferencePoolSpec
    yield "gateway.picker", gw["properties"]["picker"], S.PickerSpec
    yield "gateway.picker.envoy", gw["properties"]["picker"]["properties"]["envoy"], S.EnvoySpec
    jspec = _root(JOB)["properties"]["spec"]
    yield "job", jspec, JobSpec
    yield "job.profile", jspec["properties"]["profile"], S.ProfileTask
    yield "job.train", jspec["properties"]["train"], S.TrainTask


@pytest.mark.parametrize("name,node,model", list(_pairs()), ids=[p[0] for p in _pairs()])
def test_schema_and_model_have_the_same_fields(name, node, model):
    assert _schema_fields(node) == _model_fields(model)


def _apply_defaults(node: dict, value):
    """The API server's structural defaulting: defaults of absent fields, recursively in present objects."""
    if not isinstance(value, dict) or node.get("type") != "object":
        return value
    out = dict(value)
    for name, child in (node.get("properties") or {}).items():
        if name not in out and "default" in child:
            out[name] = copy.deepcopy(child["default"])
        if name in out:
            out[name] = _apply_defaults(child, out[name])
    return out


def _subset(small, big, path=""):
    if isinstance(small, dict):
        for k, v in small.items():
            assert k in big, f"{path}.{k} missing in the model's dump"
            _subset(v, big[k], f"{path}.{k}")
    else:
        assert small == big, f"{path}: schema default {small!r} != model default {big!r}"


def test_schema_defaults_equal_model_defaults():
    """Every default the API server fills in is the default the operator's model assumes."""
    spec_schema = _root(POOL)["properties"]["spec"]
    defaulted = _apply_defaults(spec_schema, {"model": {"name": "m"}})
    assert defaulted["hardwareProfile"] == {"name": "llama2-7b-v100"}
    assert "policy" not in defaulted["routing"]  # the operator picks by the pool's shape
    assert PoolSpec.model_validate({"model": {"name": "m"}}).routing_policy() == "late_binding"
    assert defaulted["engine"]["replicas"] == 1 and defaulted["engine"]["port"] == 8000
    assert defaulted["predictor"] == {"name": "default"}  # unset: routerd's shipped model
    model_dump = PoolSpec.model_validate({"model": {"name": "m"}}).model_dump(by_alias=True)
    _subset(defaulted, model_dump)
    job_schema = _root(JOB)["properties"]["spec"]
    jd = _apply_defaults(job_schema, {"poolRef": {"name": "p"}, "task": "train", "train": {}})
    _subset(jd, JobSpec.model_validate({"poolRef": {"name": "p"}, "task": "train", "train": {}}).model_dump(by_alias=True))


# ---------------------------------------------------------------- samples

VALID_POOLS = {
    "minimal": {"model": {"name": "meta-llama/Llama-2-7b-hf"}},
    "gpu": {"model": {"name": "meta-llama/Llama-2-7b-hf", "servedModelName": "llama-2-7b"},
            "engine": {"replicas": 4, "args": ["--max-model-len", "4096"],
                       "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "32Gi"}},
                       "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
                       "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
            "hardwareProfile": {"name": "llama2-7b-a100"},
            "routing": {"policy": "late_binding", "params": {"reserve_fraction": 0.1, "max_waiting": 1}},
            "routerd": {"replicas": 2, "service": {"type": "LoadBalancer", "port": 8080}}},
    "emulated-inline": {"model": {"name": "m"}, "emulated": True,
                        "hardwareProfile": {"inline": {"grad1": 3.2e-4, "grad2": 3.3e-5, "overheadS": 0.019,
                                                       "kvCapacityTokens": 30208, "basedOn": "llama2-7b-v100"}}},
    "dqn": {"model": {"name": "m"}, "routing": {"policy": "dqn", "checkpoint": {"configMap": "train-1-checkpoint"}}},
    "predictor": {"model": {"name": "m"}, "predictor": {"persistentVolumeClaim": {"claimName": "pred", "path": "v1"}}},
    "predictor off": {"model": {"name": "m"}, "predictor": {"name": "none"}},
    "predictor baseline": {"model": {"name": "m"}, "predictor": {"name": "task-prior"}},
    "prefix precise": {"model": {"name": "m"}, "routing": {"prefix": {
        "mode": "precise", "blockSize": 16, "chunkBlocks": 4, "maxPromptTokens": 131072,
        "indexCapacityBlocks": 262144, "tokenizer": "bytes",
        "kvEvents": {"port": 5557, "topic": "", "staleAfterSeconds": 10, "maxBlocks": 1000000}}}},
    "prefix off": {"model": {"name": "m"}, "routing": {"prefix": {"mode": "off"}}},
    "prefix empty": {"model": {"name": "m"}, "routing": {"prefix": {}}},
    "engine groups": {"engineGroups": [
        {"name": "chat", "model": {"name": "meta-llama/Llama-2-7b-hf", "servedModelName": "llama-2-7b"}},
        {"name": "chat-h100", "model": {"name": "meta-llama/Llama-2-7b-hf", "servedModelName": "llama-2-7b"},
         "replicas": 2, "nodeSelector": {"gpu": "h100"}, "resources": {"limits": {"nvidia.com/gpu": 1}},
         "args": ["--max-model-len", "4096"], "env": [{"name": "X", "value": "1"}],
         "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
        {"name": "code", "model": {"name": "codellama/CodeLlama-7b-hf"}, "replicas": 0}],
        "engine": {"replicas": 3, "resources": {"limits": {"nvidia.com/gpu": 1}}}},
    "gateway": {"model": {"name": "m"}, "gateway": {
        "inferencePool": {"enabled": True, "targetPortNumber": 8000, "appProtocol": "kubernetes.io/h2c",
                          "failureMode": "FailOpen"},
        "picker": {"enabled": True, "replicas": 2, "mode": "efficient", "podDisruptionBudget": {"maxUnavailable": 1},
                   "envoy": {"enabled": True, "image": "envoyproxy/envoy:v1.40.0", "port": 8081}}}},
    "placement and budgets": {"model": {"name": "m"}, "engine": {
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway", "minDomains": 2}],
        "podDisruptionBudget": {"maxUnavailable": "25%"}},
        "routerd": {"podDisruptionBudget": {"maxUnavailable": 1}}},
}

INVALID_POOLS = {
    "negative replicas": ({"model": {"name": "m"}, "engine": {"replicas": -1}}, "spec/engine/replicas"),
    "unknown policy": ({"model": {"name": "m"}, "routing": {"policy": "fastest"}}, "spec/routing/policy"),
    "oracle policy": ({"model": {"name": "m"}, "routing": {"policy": "oracle"}}, "spec/routing/policy"),
    "unknown profile": ({"model": {"name": "m"}, "hardwareProfile": {"name": "h100-dream"}}, "spec/hardwareProfile/name"),
    "group without a model": ({"engineGroups": [{"name": "a"}]}, "'model' is a required property"),
    "no groups": ({"engineGroups": []}, "spec/engineGroups"),
    "group name not a label": ({"engineGroups": [{"name": "Chat_1", "model": {"name": "m"}}]},
                               "spec/engineGroups/0/name"),
    "group name too long": ({"engineGroups": [{"name": "g" * 21, "model": {"name": "m"}}]},
                            "spec/engineGroups/0/name"),
    "negative group replicas": ({"engineGroups": [{"name": "a", "model": {"name": "m"}, "replicas": -1}]},
                                "spec/engineGroups/0/replicas"),
    "empty model name": ({"model": {"name": ""}}, "spec/model/name"),
    "zero grad1": ({"model": {"name": "m"}, "hardwareProfile": {"inline": {"grad1": 0, "grad2": 1e-5, "overheadS": 0,
                                                                           "kvCapacityTokens": 16}}},
                   "spec/hardwareProfile/inline/grad1"),
    "inline without kv": ({"model": {"name": "m"}, "hardwareProfile": {"inline": {"grad1": 1e-4, "grad2": 1e-5,
                                                                                  "overheadS": 0}}},
                          "'kvCapacityTokens' is a required property"),
    "bad quantity": ({"model": {"name": "m"}, "engine": {"resources": {"limits": {"memory": "lots"}}}},
                     "spec/engine/resources/limits/memory"),
    "port out of range": ({"model": {"name": "m"}, "routerd": {"service": {"port": 70000}}},
                          "spec/routerd/service/port"),
    "queue limit zero": ({"model": {"name": "m"}, "routing": {"queueLimit": 0}}, "spec/routing/queueLimit"),
    "service type": ({"model": {"name": "m"}, "routerd": {"service": {"type": "ExternalName"}}},
                     "spec/routerd/service/type"),
    "unknown predictor": ({"model": {"name": "m"}, "predictor": {"name": "oracle-bucket"}}, "spec/predictor/name"),
    "unknown prefix mode": ({"model": {"name": "m"}, "routing": {"prefix": {"mode": "exact"}}},
                            "spec/routing/prefix/mode"),
    # YAML's unquoted off is false: refused as a non-string, naming the field.
    "unquoted off": ({"model": {"name": "m"}, "routing": {"prefix": {"mode": False}}}, "spec/routing/prefix/mode"),
    "zero block size": ({"model": {"name": "m"}, "routing": {"prefix": {"blockSize": 0}}},
                        "spec/routing/prefix/blockSize"),
    "zero chunk blocks": ({"model": {"name": "m"}, "routing": {"prefix": {"chunkBlocks": 0}}},
                          "spec/routing/prefix/chunkBlocks"),
    "zero prompt tokens": ({"model": {"name": "m"}, "routing": {"prefix": {"maxPromptTokens": 0}}},
                           "spec/routing/prefix/maxPromptTokens"),
    "zero index capacity": ({"model": {"name": "m"}, "routing": {"prefix": {"indexCapacityBlocks": 0}}},
                            "spec/routing/prefix/indexCapacityBlocks"),
    "kv port out of range": ({"model": {"name": "m"}, "routing": {"prefix": {"kvEvents": {"port": 65536}}}},
                             "spec/routing/prefix/kvEvents/port"),
    "zero stale after": ({"model": {"name": "m"}, "routing": {"prefix": {"kvEvents": {"staleAfterSeconds": 0}}}},
                         "spec/routing/prefix/kvEvents/staleAfterSeconds"),
    "zero kv max blocks": ({"model": {"name": "m"}, "routing": {"prefix": {"kvEvents": {"maxBlocks": 0}}}},
                           "spec/routing/prefix/kvEvents/maxBlocks"),

    "unknown failure mode": ({"model": {"name": "m"}, "gateway": {"inferencePool": {"failureMode": "Maybe"}}},
                             "spec/gateway/inferencePool/failureMode"),
    "unknown picker mode": ({"model": {"name": "m"}, "gateway": {"picker": {"mode": "half-duplex"}}},
                            "spec/gateway/picker/mode"),
    "target port out of range": ({"model": {"name": "m"}, "gateway": {"inferencePool": {"targetPortNumber": 0}}},
                                 "spec/gateway/inferencePool/targetPortNumber"),
    "budget not a count": ({"model": {"name": "m"}, "engine": {"podDisruptionBudget": {"maxUnavailable": "half"}}},
                           "spec/engine/podDisruptionBudget/maxUnavailable"),
    "spread without key": ({"model": {"name": "m"}, "engine": {"topologySpreadConstraints": [
        {"maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule"}]}}, "'topologyKey' is a required property"),
}


def test_group_rules_are_cel_with_the_operators_patterns():
    """What JSON schema cannot say about engine groups is CEL (run by tests/k8s/test_operator_api.py); the
    operator's own parse uses the same constants, so the two cannot drift."""
    spec = _root(POOL)["properties"]["spec"]
    rules = [r["rule"] for r in spec["x-kubernetes-validations"]]
    assert "has(self.model) != has(self.engineGroups)" in rules
    assert "required" not in spec  # model is no longer required on its own
    groups = spec["properties"]["engineGroups"]
    assert groups["x-kubernetes-list-map-keys"] == ["name"]  # the API server refuses duplicate names
    assert (groups["minItems"], groups["maxItems"]) == (1, gen_crds.MAX_ENGINE_GROUPS)
    name = groups["items"]["properties"]["name"]
    assert name["maxLength"] == gen_crds.GROUP_NAME_MAX == 20 and name["pattern"] == gen_crds.GROUP_NAME_PATTERN
    (rule,) = name["x-kubernetes-validations"]
    assert gen_crds.GROUP_NAME_RESERVED in rule["rule"]
    # No override has a default: an unset one means "the pool's spec.engine value".
    for field, node in groups["items"]["properties"].items():
        assert "default" not in node, field
    overrides = set(groups["items"]["properties"]) - {"name", "model", "hardwareProfile"}
    assert overrides <= set(spec["properties"]["engine"]["properties"])
    # A group's own profile is the pool's hardwareProfile field, without its default.
    own = groups["items"]["properties"]["hardwareProfile"]
    assert own["properties"] == spec["properties"]["hardwareProfile"]["properties"]


def test_names_too_long_for_the_children_are_rejected():
    ok = _pool({"model": {"name": "m"}})
    ok["metadata"]["name"] = "p" * 55
    assert _errors(POOL, ok) == []
    for bad in ("p" * 56, "9lives", "Chat"):
        ok["metadata"]["name"] = bad
        assert any(e.startswith("metadata/name") for e in _errors(POOL, ok)), bad


@pytest.mark.parametrize("name", list(VALID_POOLS))
def test_valid_pools_pass_the_schema_and_the_model(name):
    spec = VALID_POOLS[name]
    assert _errors(POOL, _pool(spec)) == []
    assert _errors(POOL, _pool(_apply_defaults(_root(POOL)["properties"]["spec"], spec))) == []
    PoolSpec.model_validate(spec)


@pytest.mark.parametrize("name", list(INVALID_POOLS))
def test_invalid_pools_are_rejected_naming_the_field(name):
    spec, where = INVALID_POOLS[name]
    errs = _errors(POOL, _pool(spec))
    assert errs, f"{name} passed the schema"
    assert any(where in e for e in errs), errs


def test_jobs_schema():
    ok = {"apiVersion": "phasewise.io/v1alpha1", "kind": "LLMRouterJob", "metadata": {"name": "j"},
          "spec": {"poolRef": {"name": "p"}, "task": "train", "train": {"episodes": 5}}}
    assert _errors(JOB, ok) == []
    bad = copy.deepcopy(ok)
    bad["spec"]["task"] = "benchmark"
    assert any("spec/task" in e for e in _errors(JOB, bad))
    bad = copy.deepcopy(ok)
    bad["spec"]["train"]["episodes"] = 0
    assert any("spec/train/episodes" in e for e in _errors(JOB, bad))
    bad = copy.deepcopy(ok)
    del bad["spec"]["poolRef"]
    assert any("'poolRef' is a required property" in e for e in _errors(JOB, bad))


def test_status_schema_accepts_what_the_operator_writes():
    """A status as reconcile writes it (conditions, endpoints, active*) validates against the schema."""
    from phasewise_operator import status

    st = status.pool_status(engine=None, routerd=None, slices=[], problem=status.Problem("InvalidSpec", "x"),
                            generation=3, now="2026-11-30T01:00:00Z")
    st.update(activePolicy="late_binding", activeProfile="llama2-7b-v100", activeCheckpoint="",
              configHash="0123456789abcdef", routerURL="http://p-routerd.ns.svc", selector="a=b")
    obj = _pool({"model": {"name": "m"}})
    obj["status"] = st
    assert _errors(POOL, obj) == []


def test_status_schema_accepts_the_engine_groups_status():
    from phasewise_operator import status

    d = {"metadata": {"generation": 1}, "spec": {"replicas": 2},
         "status": {"observedGeneration": 1, "replicas": 2, "readyReplicas": 1, "updatedReplicas": 2,
                    "availableReplicas": 1}}
    st = status.pool_status(routerd=d, slices=[], problem=None, generation=1, now="2026-11-30T01:00:00Z",
                            groups=[status.GroupObserved("a", "m", "p-engine-a", d),
                                    status.GroupObserved("b", "n", "p-engine-b", None, 3)])
    assert [g["desiredReplicas"] for g in st["engineGroups"]] == [2, 3]
    obj = _pool({"engineGroups": [{"name": "a", "model": {"name": "m"}}, {"name": "b", "model": {"name": "n"}}]})
    obj["status"] = st
    assert _errors(POOL, obj) == []
    assert set(st["engineGroups"][1]) == set(_root(POOL)["properties"]["status"]["properties"]["engineGroups"]
                                             ["items"]["properties"])


def test_prefix_settings_have_no_defaults_and_a_cel_port_rule():
    """spec.routing.prefix has no default anywhere (unset = routerd's own default, one place), the
    mode enum is the operator's, and the KV-events port rule is CEL at spec level (run by
    tests/k8s/test_operator_api.py)."""
    spec = _root(POOL)["properties"]["spec"]
    prefix = spec["properties"]["routing"]["properties"]["prefix"]
    for path, node in _walk(prefix, "prefix"):
        assert "default" not in node, path
    assert prefix["properties"]["mode"]["enum"] == list(gen_crds.PREFIX_MODES) == ["off", "approximate", "precise"]
    defaulted = _apply_defaults(spec, {"model": {"name": "m"}})
    assert "prefix" not in defaulted["routing"]
    assert PoolSpec.model_validate({"model": {"name": "m"}}).routing.prefix is None
    (rule,) = [r for r in spec["x-kubernetes-validations"] if "kvEvents" in r["rule"]]
    assert rule["fieldPath"] == ".routing.prefix.kvEvents.port"
    assert f": {gen_crds.DEFAULT_KV_EVENTS_PORT})" in rule["rule"]  # the unset port is vLLM's


def test_envoy_port_cel_rule_refuses_envoys_admin_port():
    """Envoy's admin listener is 127.0.0.1:9901 in the picker's pod (routerd's build_envoy_config default):
    an envoy.port of 9901 could not bind, so the CEL rule refuses it beside the picker's own ports (run by
    tests/k8s/test_operator_gateway.py)."""
    envoy = _root(POOL)["properties"]["spec"]["properties"]["gateway"]["properties"]["picker"]["properties"]["envoy"]
    (rule,) = envoy["x-kubernetes-validations"]
    assert rule["rule"] == "!has(self.port) || !(self.port in [9002, 9003, 9090, 9901])"
    assert rule["fieldPath"] == ".port"
    assert "admin port 9901" in rule["message"]
    from routerd.epp import envoy_config
    import inspect
    assert inspect.signature(envoy_config.build_envoy_config).parameters["admin_port"].default == \
        gen_crds.ENVOY_ADMIN_PORT
