"""The Helm chart without helm: values against values.schema.json, versions, and RBAC = what the operator does."""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "phasewise"
sys.path.insert(0, str(REPO / "operator"))

from phasewise_operator import builders, jobs  # noqa: E402
from phasewise_operator.settings import OPERATOR_VERSION, OperatorSettings  # noqa: E402
from phasewise_operator.spec import parse_job_spec, parse_pool_spec  # noqa: E402

jsonschema = pytest.importorskip("jsonschema")

VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = yaml.safe_load((CHART / "values.schema.json").read_text())


def _errors(values) -> list[str]:
    v = jsonschema.Draft7Validator(SCHEMA)
    return ["/".join(map(str, e.absolute_path)) + ": " + e.message for e in v.iter_errors(values)]


def test_default_values_match_the_schema():
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    assert _errors(VALUES) == []


@pytest.mark.parametrize("path,value,where", [
    (("operator", "replicas"), -1, "operator/replicas"),
    (("operator", "logLevel"), "loud", "operator/logLevel"),
    (("operator", "watchNamespaces"), ["Not_A_Namespace"], "operator/watchNamespaces/0"),
    (("operator", "resyncSeconds"), 0.5, "operator/resyncSeconds"),
    (("images", "pullPolicy"), "Sometimes", "images/pullPolicy"),
    (("operator", "image", "repository"), "", "operator/image/repository"),
    (("examplePool", "name"), "Bad_Name", "examplePool/name"),
    (("operator", "unknownKey"), 1, "operator: Additional properties"),
])
def test_bad_values_are_rejected(path, value, where):
    values = copy.deepcopy(VALUES)
    node = values
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    errs = _errors(values)
    assert any(e.startswith(where) for e in errs), errs


def test_versions_agree():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    pyproject = (REPO / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)
    assert chart["appVersion"] == OPERATOR_VERSION == version
    assert OperatorSettings().routerd_image == f"phasewise/routerd:{version}"
    assert VALUES["images"]["vllm"] == OperatorSettings().vllm_image


def test_example_pool_defaults_are_valid_names():
    from phasewise_operator.gen_crds import DEFAULT_PREDICTOR, predictor_names, profile_names

    assert VALUES["examplePool"]["profile"] in profile_names()
    assert VALUES["examplePool"]["policy"] == ""  # the operator's default for the pool's shape
    assert VALUES["examplePool"]["predictor"] == DEFAULT_PREDICTOR and DEFAULT_PREDICTOR in predictor_names()


# ---------------------------------------------------------------- RBAC

def _operator_rules() -> list[dict]:
    text = (CHART / "templates" / "_helpers.tpl").read_text()
    block = re.search(r'\{\{- define "phasewise.operatorRules" -\}\}\n(.*?)\{\{- end -\}\}', text, re.S).group(1)
    return yaml.safe_load(block)


def _allowed(rules, group: str, resource: str, verb: str, name: str | None = None) -> bool:
    for r in rules:
        if group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]:
            if not r.get("resourceNames") or name in r["resourceNames"]:
                return True
    return False


#: Every API call the operator makes, as (group, resource, verb): kube.py's verbs per kind
#: (apply = create + patch, merge_patch = patch, patch_status = patch on status) and kopf's
#: own (watch its resources and the children it listens to, annotate its resources, post Events).
OPERATOR_CALLS = {
    ("phasewise.io", "llmrouterpools", v) for v in ("get", "list", "watch", "patch")
} | {
    ("phasewise.io", "llmrouterjobs", v) for v in ("get", "list", "watch", "patch")
} | {
    ("phasewise.io", "llmrouterpools/status", "patch"), ("phasewise.io", "llmrouterjobs/status", "patch"),
    ("phasewise.io", "llmrouterpools/status", "get"), ("phasewise.io", "llmrouterjobs/status", "get"),
    ("phasewise.io", "llmrouterpools/finalizers", "update"), ("phasewise.io", "llmrouterjobs/finalizers", "update"),
    ("", "configmaps", "get"), ("", "configmaps", "create"), ("", "configmaps", "patch"),
    ("", "services", "get"), ("", "services", "create"), ("", "services", "patch"),
    ("", "serviceaccounts", "get"), ("", "serviceaccounts", "create"), ("", "serviceaccounts", "patch"),
    ("", "pods", "get"), ("", "pods", "list"),
    ("", "events", "create"), ("", "events", "patch"),
    ("apps", "deployments", "get"), ("apps", "deployments", "list"), ("apps", "deployments", "watch"),
    ("apps", "deployments", "create"), ("apps", "deployments", "patch"),
    ("apps", "deployments", "delete"),  # the Deployment of a removed engine group
    ("batch", "jobs", "get"), ("batch", "jobs", "list"), ("batch", "jobs", "watch"), ("batch", "jobs", "create"),
    ("batch", "jobs", "patch"),
    ("discovery.k8s.io", "endpointslices", "get"), ("discovery.k8s.io", "endpointslices", "list"),
    ("discovery.k8s.io", "endpointslices", "watch"),
    ("rbac.authorization.k8s.io", "roles", "get"), ("rbac.authorization.k8s.io", "roles", "create"),
    ("rbac.authorization.k8s.io", "roles", "patch"),
    ("rbac.authorization.k8s.io", "rolebindings", "get"), ("rbac.authorization.k8s.io", "rolebindings", "create"),
    ("rbac.authorization.k8s.io", "rolebindings", "patch"),
    # spec.gateway and podDisruptionBudget: optional children are applied, read back for ownership and
    # deleted when the spec drops them; the InferencePool is watched for its parents' status.
    ("", "services", "delete"), ("", "configmaps", "delete"),
    ("", "services", "list"),  # a mixed-GPU pool's per-group engine Services, pruned by label
    ("policy", "poddisruptionbudgets", "get"), ("policy", "poddisruptionbudgets", "list"),
    ("policy", "poddisruptionbudgets", "create"), ("policy", "poddisruptionbudgets", "patch"),
    ("policy", "poddisruptionbudgets", "delete"),
    ("inference.networking.k8s.io", "inferencepools", "get"), ("inference.networking.k8s.io", "inferencepools", "list"),
    ("inference.networking.k8s.io", "inferencepools", "watch"),
    ("inference.networking.k8s.io", "inferencepools", "create"),
    ("inference.networking.k8s.io", "inferencepools", "patch"),
    ("inference.networking.k8s.io", "inferencepools", "delete"),
    ("inference.networking.k8s.io", "inferencepools/status", "get"),
}


def _granted(rules) -> set[tuple[str, str, str]]:
    return {(g, res, v) for r in rules for g in r["apiGroups"] for res in r["resources"] for v in r["verbs"]}


def test_operator_rbac_is_exactly_what_it_does():
    """Least privilege: the chart grants the calls the operator makes, plus configmaps update
    (held so it may grant it to job reporters: RBAC forbids granting what one lacks), nothing else."""
    granted = _granted(_operator_rules())
    assert OPERATOR_CALLS <= granted, sorted(OPERATOR_CALLS - granted)
    assert granted - OPERATOR_CALLS == {("", "configmaps", "update")}
    assert not any(r.get("resourceNames") for r in _operator_rules())
    assert all("*" not in r["verbs"] and "*" not in r["resources"] for r in _operator_rules())


def test_every_kind_the_operator_writes_is_granted():
    """Kinds in kube.RESOURCES that reconcile applies are creatable and patchable."""
    rules = _operator_rules()
    pool = builders.PoolRef("p", "ns", "u")
    ps = parse_pool_spec({"model": {"name": "m"}, "emulated": True})
    objs = builders.pool_children(pool, ps, OperatorSettings())
    # Every optional child too: picker, InferencePool, budgets (standalone Envoy's ConfigMap is a ConfigMap).
    gw = parse_pool_spec({"model": {"name": "m"}, "emulated": True,
                          "engine": {"podDisruptionBudget": {"maxUnavailable": 1}},
                          "routerd": {"podDisruptionBudget": {"maxUnavailable": 1}},
                          "gateway": {"inferencePool": {"enabled": True},
                                      "picker": {"enabled": True, "podDisruptionBudget": {"maxUnavailable": 1}}}})
    optional = builders.pool_children(pool, gw, OperatorSettings())
    assert {o["kind"] for o in optional} - {o["kind"] for o in objs} == {"InferencePool", "PodDisruptionBudget"}
    objs += optional
    js = parse_job_spec({"poolRef": {"name": "p"}, "task": "profile"})
    objs += jobs.job_children(builders.PoolRef("j", "ns", "u2"), js, pool, ps, OperatorSettings(), target_url="http://x:1")
    from phasewise_operator.kube import RESOURCES

    for obj in objs:
        group = obj["apiVersion"].rpartition("/")[0]
        plural = RESOURCES[(obj["apiVersion"], obj["kind"])]
        for verb in ("create", "patch", "get"):
            assert _allowed(rules, group, plural, verb), (obj["kind"], verb)


def test_operator_holds_what_its_roles_grant():
    """RBAC escalation check: the operator can create the routerd and reporter Roles only if it holds their rules."""
    rules = _operator_rules()
    pool = builders.PoolRef("p", "ns", "u")
    created = [o for o in builders.routerd_rbac(pool) + jobs.reporter_rbac(builders.PoolRef("j", "ns", "u"), "p")
               if o["kind"] == "Role"]
    assert len(created) == 2
    for role in created:
        for r in role["rules"]:
            for g in r["apiGroups"]:
                for res in r["resources"]:
                    for v in r["verbs"]:
                        assert _allowed(rules, g, res, v), (role["metadata"]["name"], g, res, v)


def test_peering_crds_and_templates_exist():
    crds = list(yaml.safe_load_all((CHART / "crds" / "kopf-peerings.yaml").read_text()))
    assert {c["metadata"]["name"] for c in crds} == {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}
    for name in ("deployment.yaml", "rbac.yaml", "serviceaccount.yaml", "peering.yaml", "example-pool.yaml",
                 "NOTES.txt", "crds/llmrouterpools.yaml", "crds/llmrouterjobs.yaml"):
        assert (CHART / "templates" / name).is_file(), name


def test_example_pool_engine_groups_values():
    """examplePool.engineGroups: off by default (the single model renders as before); each entry a
    valid group name, a model and optional replicas, the limits of spec.engineGroups."""
    from phasewise_operator.gen_crds import GROUP_NAME_MAX, MAX_ENGINE_GROUPS

    assert VALUES["examplePool"]["engineGroups"] == []
    values = copy.deepcopy(VALUES)
    values["examplePool"]["engineGroups"] = [{"name": "chat", "model": "llama-2-7b"},
                                             {"name": "code", "model": "codellama", "replicas": 1}]
    assert _errors(values) == []
    item = SCHEMA["properties"]["examplePool"]["properties"]["engineGroups"]
    assert item["maxItems"] == MAX_ENGINE_GROUPS and item["items"]["properties"]["name"]["maxLength"] == GROUP_NAME_MAX
    for bad, where in (({"name": "Chat", "model": "m"}, "examplePool/engineGroups/0/name"),
                       ({"name": "g" * 21, "model": "m"}, "examplePool/engineGroups/0/name"),
                       ({"name": "a"}, "examplePool/engineGroups/0: 'model' is a required property"),
                       ({"name": "a", "model": "m", "replicas": -1}, "examplePool/engineGroups/0/replicas"),
                       ({"name": "a", "model": "m", "image": "x"}, "examplePool/engineGroups/0: Additional")):
        values["examplePool"]["engineGroups"] = [bad]
        errs = _errors(values)
        assert any(e.startswith(where) for e in errs), (bad, errs)


def test_example_pool_prefix_values_mirror_the_crd():
    """examplePool.prefix is the pool's spec.routing.prefix: empty by default (routerd's defaults), the
    CRD's fields with the same types, enums and limits, so a value the chart takes the API server takes."""
    from phasewise_operator.gen_crds import pool_crd

    assert VALUES["examplePool"]["prefix"] == {}
    chart = SCHEMA["properties"]["examplePool"]["properties"]["prefix"]
    crd = pool_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "routing"]["properties"]["prefix"]

    def same(c: dict, k: dict, path: str) -> None:
        assert set(c["properties"]) == set(k["properties"]), path
        assert c["additionalProperties"] is False, path
        for name, cn in c["properties"].items():
            kn = k["properties"][name]
            assert cn["type"] == kn["type"], f"{path}.{name}"
            if kn["type"] == "object":
                same(cn, kn, f"{path}.{name}")
                continue
            for key in ("enum", "maximum", "maxLength"):
                assert cn.get(key) == kn.get(key), f"{path}.{name}.{key}"
            # draft-07 (chart) and OpenAPI v3.0 (CRD) spell an exclusive minimum differently
            if kn.get("exclusiveMinimum"):
                assert (cn.get("exclusiveMinimum"), cn.get("minimum")) == (kn["minimum"], None), f"{path}.{name}"
            else:
                assert (cn.get("exclusiveMinimum"), cn.get("minimum")) == (None, kn.get("minimum")), f"{path}.{name}"

    same(chart, crd, "prefix")
    values = copy.deepcopy(VALUES)
    values["examplePool"]["prefix"] = {"mode": "precise", "blockSize": 16, "kvEvents": {"port": 5600,
                                                                                        "staleAfterSeconds": 2.5}}
    assert _errors(values) == []
    for bad, where in (({"mode": False}, "examplePool/prefix/mode"),  # unquoted off
                       ({"mode": "exact"}, "examplePool/prefix/mode"),
                       ({"blockSize": 0}, "examplePool/prefix/blockSize"),
                       ({"kvEvents": {"port": 70000}}, "examplePool/prefix/kvEvents/port"),
                       ({"kvEvents": {"staleAfterSeconds": 0}}, "examplePool/prefix/kvEvents/staleAfterSeconds"),
                       ({"blocksize": 16}, "examplePool/prefix: Additional")):
        values["examplePool"]["prefix"] = bad
        errs = _errors(values)
        assert any(e.startswith(where) for e in errs), (bad, errs)


def test_gpu_example_and_new_values_match_the_schema():
    example = yaml.safe_load((CHART / "examples" / "llama-3.1-8b-gpu.yaml").read_text())
    merged = copy.deepcopy(VALUES)
    for key, value in example.items():
        merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
    assert _errors(merged) == []
    assert merged["examplePool"]["profile"] in __import__("phasewise_operator.gen_crds").gen_crds.profile_names()
    assert VALUES["serviceMonitor"]["enabled"] is False and VALUES["podDisruptionBudget"]["enabled"] is False
    assert VALUES["images"]["envoy"] == OperatorSettings().envoy_image == "envoyproxy/envoy:v1.40.0"
    for path, value, where in ((("serviceMonitor", "components"), ["vllm"], "serviceMonitor/components/0"),
                               (("examplePool", "hfToken", "secretName"), "Bad_Name", "examplePool/hfToken/secretName"),
                               (("examplePool", "engine"), {"replicas": 3}, "examplePool/engine"),
                               (("podDisruptionBudget", "maxUnavailable"), "half", "podDisruptionBudget/maxUnavailable")):
        values = copy.deepcopy(VALUES)
        node = values
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        assert any(e.startswith(where) for e in _errors(values)), (path, _errors(values))


def _with(path: tuple[str, ...], value) -> dict:
    values = copy.deepcopy(VALUES)
    node = values
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return values


GOOD_GATEWAYS = [
    {},
    {"inferencePool": {"enabled": True, "targetPortNumber": 8000, "appProtocol": "kubernetes.io/h2c",
                       "failureMode": "FailOpen"},
     "picker": {"enabled": True, "replicas": 2, "resources": {"limits": {"memory": "1Gi"}},
                "podDisruptionBudget": {"maxUnavailable": "25%"}}},
    {"picker": {"enabled": True, "mode": "efficient",
                "envoy": {"enabled": True, "port": 8088, "image": "envoyproxy/envoy:v1.40.0"}}},
    {"picker": {"enabled": False, "envoy": {"enabled": False, "port": 9000}}},
]


@pytest.mark.parametrize("gateway", GOOD_GATEWAYS)
def test_example_pool_gateway_values_the_crd_takes_pass(gateway):
    values = _with(("examplePool", "gateway"), gateway)
    assert _errors(values) == []
    spec = parse_pool_spec({"model": {"name": "m"}, "gateway": gateway})  # and the operator takes them too
    assert spec.gateway is not None


BAD_GATEWAYS = [
    # what the CRD's CEL rules refuse, refused by helm before the post-install hook applies the pool
    ({"inferencePool": {"enabled": True}}, "examplePool/gateway: 'picker' is a required property"),
    ({"inferencePool": {"enabled": True}, "picker": {"enabled": False}}, "examplePool/gateway/picker/enabled"),
    ({"picker": {"enabled": True, "envoy": {"enabled": True, "port": 9002}}}, "examplePool/gateway/picker/envoy/port"),
    ({"picker": {"enabled": True, "envoy": {"enabled": True, "port": 9003}}}, "examplePool/gateway/picker/envoy/port"),
    ({"picker": {"enabled": True, "envoy": {"enabled": True, "port": 9090}}}, "examplePool/gateway/picker/envoy/port"),
    ({"picker": {"enabled": True, "envoy": {"enabled": True, "port": 9901}}}, "examplePool/gateway/picker/envoy/port"),
    ({"picker": {"enabled": True, "mode": "efficient"}}, "examplePool/gateway/picker: 'envoy' is a required property"),
    ({"picker": {"enabled": True, "mode": "efficient", "envoy": {"enabled": False}}},
     "examplePool/gateway/picker/envoy/enabled"),
    ({"picker": {"envoy": {"enabled": True}}}, "examplePool/gateway/picker: 'enabled' is a required property"),
    ({"picker": {"enabled": True}, "inferencePool": {"targetPortNumber": 50051}},
     "examplePool/gateway/inferencePool/targetPortNumber"),
    # types, enums, ranges
    ({"inferencePool": {"enabled": "yes"}}, "examplePool/gateway/inferencePool/enabled"),
    ({"inferencePool": {"targetPortNumber": 0}}, "examplePool/gateway/inferencePool/targetPortNumber"),
    ({"inferencePool": {"targetPortNumber": 65536}}, "examplePool/gateway/inferencePool/targetPortNumber"),
    ({"inferencePool": {"appProtocol": "grpc"}}, "examplePool/gateway/inferencePool/appProtocol"),
    ({"inferencePool": {"failureMode": "FailSometimes"}}, "examplePool/gateway/inferencePool/failureMode"),
    ({"picker": {"replicas": -1}}, "examplePool/gateway/picker/replicas"),
    ({"picker": {"replicas": 101}}, "examplePool/gateway/picker/replicas"),  # the CRD's maximum
    ({"picker": {"mode": "half-duplex"}}, "examplePool/gateway/picker/mode"),
    ({"picker": {"podDisruptionBudget": {}}}, "examplePool/gateway/picker/podDisruptionBudget"),
    ({"picker": {"podDisruptionBudget": {"maxUnavailable": "half"}}},
     "examplePool/gateway/picker/podDisruptionBudget/maxUnavailable"),
    ({"picker": {"envoy": {"port": 70000}}}, "examplePool/gateway/picker/envoy/port"),
    ({"picker": {"envoy": {"image": ""}}}, "examplePool/gateway/picker/envoy/image"),
    ({"picker": {"envoy": {"prot": 8081}}}, "examplePool/gateway/picker/envoy: Additional properties"),
    ({"picker": {"enabeld": True}}, "examplePool/gateway/picker: Additional properties"),
]


@pytest.mark.parametrize("gateway,where", BAD_GATEWAYS, ids=[f"{i}" for i in range(len(BAD_GATEWAYS))])
def test_bad_example_pool_gateway_values_are_rejected_naming_the_field(gateway, where):
    errs = _errors(_with(("examplePool", "gateway"), gateway))
    assert any(e.startswith(where) for e in errs), errs
    # the operator refuses the same spec, except what only the CRD's schema checks (its maximum and
    # minLength; unknown fields, which the API server prunes and the chart refuses as typos)
    from phasewise_operator.spec import SpecError

    crd_only = ({"picker": {"replicas": 101}}, {"picker": {"envoy": {"image": ""}}},
                {"picker": {"envoy": {"prot": 8081}}}, {"picker": {"enabeld": True}})
    if gateway not in crd_only:
        with pytest.raises(SpecError):
            parse_pool_spec({"model": {"name": "m"}, "gateway": gateway})


def test_example_pool_gateway_schema_mirrors_the_crd():
    """examplePool.gateway is the pool's spec.gateway: the CRD's fields with the same types, enums and limits."""
    from phasewise_operator.gen_crds import ENVOY_FORBIDDEN_PORTS, pool_crd

    chart = SCHEMA["properties"]["examplePool"]["properties"]["gateway"]
    crd = pool_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "gateway"]

    def same(c: dict, k: dict, path: str) -> None:
        assert set(c["properties"]) == set(k["properties"]), path
        assert c["additionalProperties"] is False, path
        for name, cn in c["properties"].items():
            kn = k["properties"][name]
            if "anyOf" in kn:  # int-or-string budgets
                assert "anyOf" in cn, f"{path}.{name}"
                continue
            assert cn["type"] == kn["type"], f"{path}.{name}"
            if kn["type"] == "object" and "properties" in kn and name != "resources":
                same(cn, kn, f"{path}.{name}")
                continue
            for key in ("enum", "minimum", "maximum", "minLength", "maxLength"):
                assert cn.get(key) == kn.get(key), f"{path}.{name}.{key}"

    same(chart, crd, "gateway")
    port = chart["properties"]["picker"]["properties"]["envoy"]["properties"]["port"]
    assert port["not"] == {"enum": list(ENVOY_FORBIDDEN_PORTS)} == {"enum": [9002, 9003, 9090, 9901]}


@pytest.mark.parametrize("pdb,where", [
    ({"enabled": True, "maxUnavailable": None}, "podDisruptionBudget/maxUnavailable"),
    ({"enabled": True, "maxUnavailable": ""}, "podDisruptionBudget/maxUnavailable"),
    ({"enabled": True}, "podDisruptionBudget: 'maxUnavailable' is a required property"),  # helm's --set ...=null
])
def test_enabled_operator_budget_needs_a_max_unavailable(pdb, where):
    errs = _errors(_with(("podDisruptionBudget",), pdb))
    assert any(e.startswith(where) for e in errs), errs
    assert _errors(_with(("podDisruptionBudget",), {"enabled": False})) == []
    assert _errors(_with(("podDisruptionBudget",), {"enabled": True, "maxUnavailable": 0})) == []
    assert _errors(_with(("podDisruptionBudget",), {"enabled": True, "maxUnavailable": "50%"})) == []
