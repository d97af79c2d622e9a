"""docs/kubernetes.md's manifests are what the operator accepts and builds: every YAML block of
the guide parses as the operator parses it, and the objects it promises exist with the names
and ports the guide uses (the NodePort, the picker's Envoy port, the job's checkpoint)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))

from phasewise_operator import builders as B  # noqa: E402
from phasewise_operator.settings import OperatorSettings  # noqa: E402
from phasewise_operator.spec import check_pool, parse_job_spec, parse_pool_spec  # noqa: E402

GUIDE = REPO / "docs" / "kubernetes.md"


def _manifests() -> dict[str, dict]:
    """The guide's heredoc manifests by kind."""
    text = GUIDE.read_text()
    out = {}
    for block in re.findall(r"<<'YAML'\n(.*?)\nYAML", text, flags=re.S):
        doc = yaml.safe_load(block)
        out[doc["kind"]] = doc
    return out


def test_the_guides_pool_and_job_parse_and_build_what_it_says():
    docs = _manifests()
    assert set(docs) == {"LLMRouterPool", "LLMRouterJob"}
    pool = docs["LLMRouterPool"]
    ps = parse_pool_spec(pool["spec"])
    check_pool(ps)
    ref = B.PoolRef(name=pool["metadata"]["name"], namespace="phasewise",
                    uid="0b5e3c1a-0000-4000-8000-000000000002", generation=1)
    children = {(o["kind"], o["metadata"]["name"]): o
                for o in B.pool_children(ref, ps, OperatorSettings(routerd_image="phasewise/routerd:0.1.0"))}
    # Step 5: routerd on NodePort 30080 (kind-config.yaml maps it), Envoy's port 8081 on chat-epp.
    svc = children[("Service", "chat-routerd")]
    assert svc["spec"]["type"] == "NodePort"
    assert [p["nodePort"] for p in svc["spec"]["ports"] if p["name"] == "http"] == [30080]
    assert "hostPort: 30080" in (REPO / "kind-config.yaml").read_text()
    epp = children[("Service", "chat-epp")]
    assert {p["name"]: p["port"] for p in epp["spec"]["ports"]}["http"] == 8081
    assert ("Deployment", "chat-engine") in children and ("Deployment", "chat-epp") in children
    assert not any(kind == "InferencePool" for kind, _ in children)  # enabled: false in step 4

    job = parse_job_spec(docs["LLMRouterJob"]["spec"])
    assert job.task == "train" and job.pool_ref.name == pool["metadata"]["name"]


def test_the_guides_images_are_the_charts_defaults():
    values = yaml.safe_load((REPO / "charts" / "phasewise" / "values.yaml").read_text())
    chart = yaml.safe_load((REPO / "charts" / "phasewise" / "Chart.yaml").read_text())
    text = GUIDE.read_text()
    version = chart["appVersion"]
    assert values["images"]["routerd"]["repository"] == "phasewise/routerd"
    assert values["images"]["trainer"]["repository"] == "phasewise/routerd"  # tag <appVersion>-rl
    assert f"VERSION={version}" in text
    for image in ("phasewise/routerd:$VERSION ", "phasewise/routerd:$VERSION-rl", "phasewise/operator:$VERSION"):
        assert image in text
    assert values["images"]["vllm"] in text and values["images"]["envoy"] in text
    assert "--build-arg EXTRAS=rl" in (REPO / "docker" / "routerd.Dockerfile").read_text()
