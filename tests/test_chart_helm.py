"""The Helm chart rendered by a real helm (built by tools/k8s/build.sh): lint, template, values errors.

Installing, upgrading and uninstalling against an API server is in tests/k8s/test_operator_chart.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "phasewise"
sys.path.insert(0, str(REPO / "operator"))
sys.path.insert(0, str(REPO / "tests"))

from test_operator_builders import check_restricted  # noqa: E402


def _helm() -> Path:
    from k8s.harness import bin_dir

    helm = bin_dir() / "helm"
    if not os.access(helm, os.X_OK):
        if os.environ.get("PHASEWISE_K8S_REQUIRED"):
            pytest.fail(f"PHASEWISE_K8S_REQUIRED is set but {helm} is not built", pytrace=False)
        pytest.skip(f"helm not built in {helm.parent} (tools/k8s/build.sh)")
    return helm


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "HELM_CACHE_HOME": "/tmp/phasewise-helm/cache", "HELM_CONFIG_HOME": "/tmp/phasewise-helm/config",
           "HELM_DATA_HOME": "/tmp/phasewise-helm/data"}
    r = subprocess.run([str(_helm()), *args], capture_output=True, text=True, timeout=120, env=env)
    if check and r.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{r.stderr}")
    return r


def render(*sets: str, namespace: str = "phasewise") -> list[dict]:
    args = ["template", "phasewise", str(CHART), "--namespace", namespace]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def test_lint():
    r = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in r.stdout, r.stdout


def test_default_render():
    docs = render()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterKopfPeering", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                     "CustomResourceDefinition", "Deployment", "ServiceAccount"]
    crds = {d["metadata"]["name"]: d for d in by_kind(docs, "CustomResourceDefinition")}
    assert set(crds) == {"llmrouterpools.phasewise.io", "llmrouterjobs.phasewise.io"}
    for name, crd in crds.items():
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        plain = yaml.safe_load((REPO / "crds" / name.replace(".phasewise.io", ".yaml")).read_text())
        assert crd["spec"] == plain["spec"]  # the chart installs exactly crds/
    (dep,) = by_kind(docs, "Deployment")
    assert dep["metadata"]["name"] == "phasewise-operator" and dep["metadata"]["namespace"] == "phasewise"
    pod = dep["spec"]["template"]["spec"]
    check_restricted(pod, "operator")
    (c,) = pod["containers"]
    assert c["image"] == "phasewise/operator:0.1.0" and c["command"] == ["python", "-m", "phasewise_operator"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    from phasewise_operator.settings import from_env

    s = from_env({k: v for k, v in env.items() if v is not None})
    assert s.clusterwide and s.routerd_image == "phasewise/routerd:0.1.0" and s.trainer_image == "phasewise/routerd:0.1.0-rl"
    assert s.operator_image == c["image"] and s.peering_mode == "mandatory" and s.peering == "phasewise"
    (peer,) = by_kind(docs, "ClusterKopfPeering")
    assert peer["metadata"]["name"] == "phasewise" and peer["metadata"]["annotations"]["helm.sh/hook"] == "pre-install"
    (crb,) = by_kind(docs, "ClusterRoleBinding")
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": "phasewise", "namespace": "phasewise"}]
    (cr,) = by_kind(docs, "ClusterRole")
    assert {"apiGroups": ["kopf.dev"], "resources": ["clusterkopfpeerings"],
            "verbs": ["get", "list", "watch", "patch"]} in cr["rules"]


def test_namespaced_render_has_nothing_cluster_wide_but_crds():
    docs = render("operator.watchNamespaces={team-a,team-b}", "crds.install=false")
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    assert not by_kind(docs, "CustomResourceDefinition")
    roles = by_kind(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(p["metadata"]["namespace"] for p in by_kind(docs, "KopfPeering")) == ["team-a", "team-b"]
    (dep,) = by_kind(docs, "Deployment")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PHASEWISE_NAMESPACES"] == "team-a,team-b"


def test_example_pool_is_a_valid_emulated_pool():
    docs = render("examplePool.enabled=true")
    (pool,) = by_kind(docs, "LLMRouterPool")
    assert pool["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    from phasewise_operator.spec import check_pool, parse_pool_spec

    spec = parse_pool_spec(pool["spec"])
    check_pool(spec)
    assert spec.emulated and spec.engine.replicas == 2
    assert pool["spec"]["predictor"] == {"name": "default"}  # the shipped length model
    (off,) = by_kind(render("examplePool.enabled=true", "examplePool.predictor=none"), "LLMRouterPool")
    assert off["spec"]["predictor"] == {"name": "none"}
    jsonschema = pytest.importorskip("jsonschema")
    crd = yaml.safe_load((REPO / "crds" / "llmrouterpools.yaml").read_text())
    jsonschema.Draft4Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]).validate(pool)


def test_example_pool_with_engine_groups():
    sets = ["examplePool.enabled=true", "examplePool.engineGroups[0].name=chat",
            "examplePool.engineGroups[0].model=llama-2-7b", "examplePool.engineGroups[1].name=code",
            "examplePool.engineGroups[1].model=codellama-7b", "examplePool.engineGroups[1].replicas=1"]
    (pool,) = by_kind(render(*sets), "LLMRouterPool")
    assert "model" not in pool["spec"]
    assert pool["spec"]["engineGroups"] == [{"name": "chat", "model": {"name": "llama-2-7b"}},
                                            {"name": "code", "model": {"name": "codellama-7b"}, "replicas": 1}]
    from phasewise_operator.spec import check_pool, parse_pool_spec

    spec = parse_pool_spec(pool["spec"])
    check_pool(spec)
    assert [(g.name, g.replicas) for g in spec.groups()] == [("chat", 2), ("code", 1)]  # 2: examplePool.replicas
    assert spec.served_models() == ["llama-2-7b", "codellama-7b"]
    jsonschema = pytest.importorskip("jsonschema")
    crd = yaml.safe_load((REPO / "crds" / "llmrouterpools.yaml").read_text())
    jsonschema.Draft4Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]).validate(pool)
    # Without engineGroups the pool is the single-model one, as before.
    (single,) = by_kind(render("examplePool.enabled=true"), "LLMRouterPool")
    assert single["spec"]["model"] == {"name": "llama-2-7b"} and "engineGroups" not in single["spec"]
    r = helm("template", "x", str(CHART), "--set", "examplePool.engineGroups[0].name=Bad_Name",
             "--set", "examplePool.engineGroups[0].model=m", check=False)
    assert r.returncode != 0 and "engineGroups" in r.stderr, r.stderr
    # "Several models instead of model": an emptied model beside the groups renders the same pool;
    # without groups an empty model is refused, naming it.
    (blank,) = by_kind(render(*sets, "examplePool.model="), "LLMRouterPool")
    assert blank["spec"] == pool["spec"]
    r = helm("template", "x", str(CHART), "--set", "examplePool.enabled=true", "--set", "examplePool.model=",
             check=False)
    assert r.returncode != 0 and "/examplePool/model" in r.stderr and "minLength" in r.stderr, r.stderr


def test_example_pool_with_a_mixed_gpu_group():
    # examplePool.engineGroups[].profile: the group's own hardwareProfile (one model, two GPU types).
    sets = ["examplePool.enabled=true", "examplePool.profile=llama3.1-8b-h100",
            "examplePool.engineGroups[0].name=h100", "examplePool.engineGroups[0].model=llama-3.1-8b",
            "examplePool.engineGroups[1].name=a100", "examplePool.engineGroups[1].model=llama-3.1-8b",
            "examplePool.engineGroups[1].profile=llama3.1-8b-a100"]
    (pool,) = by_kind(render(*sets), "LLMRouterPool")
    assert pool["spec"]["engineGroups"] == [
        {"name": "h100", "model": {"name": "llama-3.1-8b"}},
        {"name": "a100", "model": {"name": "llama-3.1-8b"}, "hardwareProfile": {"name": "llama3.1-8b-a100"}}]
    from phasewise_operator.spec import check_pool, parse_pool_spec

    spec = parse_pool_spec(pool["spec"])
    check_pool(spec)
    assert spec.mixed_profiles and spec.routing_policy() == "predicted_latency"
    jsonschema = pytest.importorskip("jsonschema")
    crd = yaml.safe_load((REPO / "crds" / "llmrouterpools.yaml").read_text())
    jsonschema.Draft4Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]).validate(pool)


def test_example_pool_prefix_is_its_spec_routing_prefix():
    # Unset: no prefix block, routerd's defaults.
    (plain,) = by_kind(render("examplePool.enabled=true"), "LLMRouterPool")
    assert "routing" not in plain["spec"]  # no policy either: the operator's default for the pool
    (named,) = by_kind(render("examplePool.enabled=true", "examplePool.policy=llmd"), "LLMRouterPool")
    assert named["spec"]["routing"] == {"policy": "llmd"}
    (pool,) = by_kind(render("examplePool.enabled=true", "examplePool.prefix.mode=precise",
                             "examplePool.prefix.blockSize=16", "examplePool.prefix.kvEvents.port=5600",
                             "examplePool.prefix.kvEvents.topic=kv"), "LLMRouterPool")
    assert pool["spec"]["routing"] == {"prefix": {
        "mode": "precise", "blockSize": 16, "kvEvents": {"port": 5600, "topic": "kv"}}}
    jsonschema = pytest.importorskip("jsonschema")
    crd = yaml.safe_load((REPO / "crds" / "llmrouterpools.yaml").read_text())
    jsonschema.Draft4Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]).validate(pool)
    from phasewise_operator import builders as B
    from phasewise_operator.settings import OperatorSettings
    from phasewise_operator.spec import check_pool, parse_pool_spec

    spec = parse_pool_spec(pool["spec"])
    check_pool(spec)
    ref = B.PoolRef(name="phasewise-example", namespace="phasewise", uid="u")
    emu = B.emulator_container(spec, OperatorSettings())
    assert emu["args"][-2:] == ["--kv-events-config", '{"enable_kv_cache_events":true,"publisher":"zmq",'
                                '"endpoint":"tcp://*:5600","topic":"kv"}']
    assert [p["name"] for p in B.engine_service(ref, spec)["spec"]["ports"]] == ["http", "state", "kv-events"]
    # "off" reaches the pool as the string, not YAML's boolean.
    (off,) = by_kind(render("examplePool.enabled=true", "examplePool.prefix.mode=off"), "LLMRouterPool")
    assert off["spec"]["routing"]["prefix"] == {"mode": "off"}
    r = helm("template", "x", str(CHART), "--set", "examplePool.prefix.mode=exact", check=False)
    assert r.returncode != 0 and "prefix" in r.stderr and "mode" in r.stderr, r.stderr


def test_bad_values_fail_with_a_message():
    r = helm("template", "x", str(CHART), "--set", "operator.replicas=-1", check=False)
    assert r.returncode != 0 and "operator.replicas" in r.stderr.replace("/", "."), r.stderr
    r = helm("template", "x", str(CHART), "--set", "operator.replicas=2", "--set", "peering.enabled=false",
             check=False)
    assert r.returncode != 0 and "needs peering.enabled" in r.stderr, r.stderr
    r = helm("template", "x", str(CHART), "--set", "operator.logLevel=loud", check=False)
    assert r.returncode != 0 and "logLevel" in r.stderr, r.stderr


GPU_EXAMPLE = CHART / "examples" / "llama-3.1-8b-gpu.yaml"


def render_values(values: Path, *sets: str) -> list[dict]:
    args = ["template", "phasewise", str(CHART), "--namespace", "llm", "-f", str(values)]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def test_gpu_example_is_a_vllm_pool_on_one_gpu_per_replica():
    """examples/llama-3.1-8b-gpu.yaml: the pool it renders passes the CRD schema and the operator's checks,
    and the operator turns it into GPU engine pods with the token, tolerations, placement and budgets."""
    (pool,) = by_kind(render_values(GPU_EXAMPLE), "LLMRouterPool")
    from phasewise_operator import builders as B
    from phasewise_operator.settings import OperatorSettings
    from phasewise_operator.spec import check_pool, parse_pool_spec

    spec = parse_pool_spec(pool["spec"])
    check_pool(spec)
    assert not spec.emulated and spec.model.name == "meta-llama/Llama-3.1-8B-Instruct"
    assert spec.hardware_profile.name == "llama3.1-8b-h100"
    jsonschema = pytest.importorskip("jsonschema")
    crd = yaml.safe_load((REPO / "crds" / "llmrouterpools.yaml").read_text())
    jsonschema.Draft4Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]).validate(pool)

    ref = B.PoolRef(pool["metadata"]["name"], "llm", "uid-1")
    kids = {(o["kind"], o["metadata"]["name"]): o for o in B.pool_children(ref, spec, OperatorSettings())}
    dep = kids[("Deployment", "llama-3-1-8b-engine")]
    pod = dep["spec"]["template"]["spec"]
    vllm = pod["containers"][0]
    assert vllm["name"] == "vllm" and vllm["command"] == ["vllm", "serve"]
    assert vllm["args"][:3] == ["meta-llama/Llama-3.1-8B-Instruct", "--served-model-name", "llama-3.1-8b-instruct"]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in vllm["env"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "podAntiAffinity" in pod["affinity"] and pod["topologySpreadConstraints"][0]["maxSkew"] == 1
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert vllm["startupProbe"]["failureThreshold"] * vllm["startupProbe"]["periodSeconds"] == 1800
    assert vllm["readinessProbe"]["httpGet"]["path"] == "/health"
    check_restricted(pod, "gpu engine")
    assert {k for k in kids if k[0] == "PodDisruptionBudget"} == {
        ("PodDisruptionBudget", "llama-3-1-8b-engine"), ("PodDisruptionBudget", "llama-3-1-8b-routerd"),
        ("PodDisruptionBudget", "llama-3-1-8b-epp")}
    assert kids[("InferencePool", "llama-3-1-8b")]["spec"]["endpointPickerRef"]["name"] == "llama-3-1-8b-epp"


def test_hf_token_secret_is_appended_to_the_engine_env():
    sets = ["examplePool.enabled=true", "examplePool.hfToken.secretName=hf", "examplePool.hfToken.key=tok",
            "examplePool.engine.env[0].name=X", "examplePool.engine.env[0].value=one"]
    (pool,) = by_kind(render(*sets), "LLMRouterPool")
    assert pool["spec"]["engine"]["env"] == [{"name": "X", "value": "one"},
                                            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf",
                                                                                               "key": "tok"}}}]
    (plain,) = by_kind(render("examplePool.enabled=true"), "LLMRouterPool")
    assert plain["spec"]["engine"] == {"replicas": 2}  # nothing set: the pool is what it was


def test_service_monitor_and_operator_budget_are_off_by_default_and_render_when_asked():
    docs = render()
    assert not by_kind(docs, "ServiceMonitor") and not by_kind(docs, "PodDisruptionBudget")
    docs = render("serviceMonitor.enabled=true", "serviceMonitor.labels.release=prom", "podDisruptionBudget.enabled=true",
                  "operator.replicas=2")
    (sm,) = by_kind(docs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["namespaceSelector"] == {"any": True}
    assert sm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "phasewise-operator",
                                                     "app.kubernetes.io/part-of": "phasewise"}
    assert sm["spec"]["selector"]["matchExpressions"][0]["values"] == ["routerd", "epp", "engine"]
    assert [(e["port"], e["path"]) for e in sm["spec"]["endpoints"]] == [("http", "/metrics"), ("metrics", "/metrics")]
    # The ports it scrapes are the ones the operator's Services name.
    from phasewise_operator import builders as B
    from phasewise_operator.settings import OperatorSettings
    from phasewise_operator.spec import parse_pool_spec

    spec = parse_pool_spec({"model": {"name": "m"}, "gateway": {"picker": {"enabled": True}}})
    ref = B.PoolRef("p", "ns", "u")
    services = [o for o in B.pool_children(ref, spec, OperatorSettings()) if o["kind"] == "Service"]
    for svc in services:
        component = svc["metadata"]["labels"]["app.kubernetes.io/component"]
        assert component in sm["spec"]["selector"]["matchExpressions"][0]["values"]
        assert {p["name"] for p in svc["spec"]["ports"]} & {"http", "metrics"}, component
    (pdb,) = by_kind(docs, "PodDisruptionBudget")
    (dep,) = by_kind(docs, "Deployment")
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    namespaced = render("serviceMonitor.enabled=true", "operator.watchNamespaces={a,b}")
    (sm,) = by_kind(namespaced, "ServiceMonitor")
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}


@pytest.mark.parametrize("sets,field", [
    (("examplePool.gateway.inferencePool.enabled=true",), "examplePool.gateway"),  # missing property 'picker'
    (("examplePool.gateway.inferencePool.enabled=true", "examplePool.gateway.picker.enabled=false"),
     "examplePool.gateway.picker.enabled"),
    (("examplePool.gateway.picker.enabled=true", "examplePool.gateway.picker.envoy.enabled=true",
      "examplePool.gateway.picker.envoy.port=9002"), "examplePool.gateway.picker.envoy.port"),
    (("examplePool.gateway.picker.enabled=true", "examplePool.gateway.picker.envoy.enabled=true",
      "examplePool.gateway.picker.envoy.port=9901"), "examplePool.gateway.picker.envoy.port"),
    (("examplePool.gateway.picker.enabled=true", "examplePool.gateway.picker.mode=efficient"),
     "examplePool.gateway.picker"),  # missing property 'envoy'
    (("examplePool.gateway.inferencePool.appProtocol=grpc",), "examplePool.gateway.inferencePool.appProtocol"),
    (("examplePool.gateway.picker.replicas=-1",), "examplePool.gateway.picker.replicas"),
])
def test_bad_example_pool_gateway_fails_helm_template_naming_the_field(sets, field):
    """What the CRD would refuse only when the post-install hook applies the pool, helm refuses up front."""
    args = ["template", "x", str(CHART), "--set", "examplePool.enabled=true"]
    for s in sets:
        args += ["--set", s]
    r = helm(*args, check=False)
    assert r.returncode != 0, r.stdout
    assert f"'/{field.replace('.', '/')}'" in r.stderr, r.stderr


def test_example_pool_gateway_renders_as_its_spec_gateway():
    docs = render("examplePool.enabled=true", "examplePool.gateway.inferencePool.enabled=true",
                  "examplePool.gateway.picker.enabled=true", "examplePool.gateway.picker.mode=efficient",
                  "examplePool.gateway.picker.envoy.enabled=true", "examplePool.gateway.picker.envoy.port=8088")
    (pool,) = by_kind(docs, "LLMRouterPool")
    assert pool["spec"]["gateway"] == {"inferencePool": {"enabled": True},
                                       "picker": {"enabled": True, "mode": "efficient",
                                                  "envoy": {"enabled": True, "port": 8088}}}
    from phasewise_operator.spec import parse_pool_spec

    assert parse_pool_spec(pool["spec"]).envoy


def test_operator_budget_without_max_unavailable_fails_instead_of_rendering_an_empty_one():
    r = helm("template", "x", str(CHART), "--set", "podDisruptionBudget.enabled=true",
             "--set", "podDisruptionBudget.maxUnavailable=null", check=False)
    assert r.returncode != 0, r.stdout
    assert "maxUnavailable" in r.stderr, r.stderr
    r = helm("template", "x", str(CHART), "--set", "podDisruptionBudget.enabled=true",
             "--set-string", "podDisruptionBudget.maxUnavailable=", check=False)
    assert r.returncode != 0 and "/podDisruptionBudget/maxUnavailable" in r.stderr, r.stderr
    (pdb,) = by_kind(render("podDisruptionBudget.enabled=true", "podDisruptionBudget.maxUnavailable=25%"),
                     "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == "25%"
    (pdb,) = by_kind(render("podDisruptionBudget.enabled=true"), "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1


def test_the_kubernetes_guides_registry_overrides_reach_every_image():
    # docs/kubernetes.md step 8: the --set line that points every Phasewise image at a registry.
    import re

    text = (REPO / "docs" / "kubernetes.md").read_text()
    (sets,) = re.findall(r"--set\s+(images\.routerd\.repository=\S+?)`", text.replace("\n", " "))
    values = dict(kv.split("=", 1) for kv in sets.split(","))
    assert set(values) == {"images.routerd.repository", "images.trainer.repository", "operator.image.repository"}
    docs = render_values(GPU_EXAMPLE, sets)
    (op,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("operator")]
    container = op["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert container["image"].startswith("REG/operator:")
    assert env["PHASEWISE_ROUTERD_IMAGE"].startswith("REG/routerd:")
    assert env["PHASEWISE_TRAINER_IMAGE"].startswith("REG/routerd:") and env["PHASEWISE_TRAINER_IMAGE"].endswith("-rl")
