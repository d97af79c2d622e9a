"""LLMRouterJob builders, result parsing and the result reporter (pure parts and files)."""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))
sys.path.insert(0, str(REPO / "tests"))

from phasewise_operator import jobs as J  # noqa: E402
from phasewise_operator import report as R  # noqa: E402
from phasewise_operator.builders import PoolRef  # noqa: E402
from phasewise_operator.settings import OperatorSettings  # noqa: E402
from phasewise_operator.spec import parse_job_spec, parse_pool_spec  # noqa: E402
from test_operator_builders import check_restricted  # noqa: E402

JOB = PoolRef("fit-1", "llm", "11111111-2222-4333-8444-555555555555")
POOL = PoolRef("chat", "llm", "0b5e3c1a-0000-4000-8000-000000000001")
OPS = OperatorSettings(routerd_image="example/routerd:1", trainer_image="example/routerd:1-rl",
                       operator_image="example/operator:1")
POOL_SPEC = parse_pool_spec({"model": {"name": "meta-llama/Llama-2-7b-hf", "servedModelName": "llama"},
                             "engine": {"replicas": 4}, "hardwareProfile": {"name": "llama2-7b-v100"}})


def test_profile_job():
    spec = parse_job_spec({"poolRef": {"name": "chat"}, "task": "profile", "profile": {"args": ["--quick"]}})
    objs = J.job_children(JOB, spec, POOL, POOL_SPEC, OPS, target_url="http://10.0.0.7:8000")
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [
        ("ServiceAccount", "fit-1-reporter"), ("Role", "fit-1-reporter"), ("RoleBinding", "fit-1-reporter"),
        ("Job", "fit-1")]
    for o in objs:
        assert o["metadata"]["ownerReferences"][0]["kind"] == "LLMRouterJob"
        assert o["metadata"]["ownerReferences"][0]["uid"] == JOB.uid
        assert o["metadata"]["labels"]["phasewise.io/job"] == "fit-1"
    job = objs[-1]
    pod = job["spec"]["template"]["spec"]
    (work,) = pod["initContainers"]
    (report,) = pod["containers"]
    assert work["image"] == "example/routerd:1"
    assert work["command"] == ["phasewise", "profile", "--endpoint", "http://10.0.0.7:8000", "--model", "llama",
                               "--base-profile", "/etc/phasewise/profile.yaml", "--output", "/results/profile.yaml",
                               "--quick"]
    # what phasewise profile's own parser makes of it
    from routerd.profiler.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(work["command"][1:])
    assert (args.endpoint, args.model, args.base_profile, args.output, args.quick) == (
        "http://10.0.0.7:8000", "llama", "/etc/phasewise/profile.yaml", "/results/profile.yaml", True)
    vol = next(v for v in pod["volumes"] if v["name"] == "profile")
    assert vol["configMap"]["name"] == "chat-routerd"
    assert report["image"] == "example/operator:1"
    assert report["command"] == ["python", "-m", "phasewise_operator.report"]
    assert report["args"] == ["--results", "/results", "--task", "profile", "--configmap", "fit-1-result"]
    env = {e["name"]: e.get("value") for e in report["env"]}
    assert env["PHASEWISE_OWNER_UID"] == JOB.uid and env["PHASEWISE_OWNER_NAME"] == "fit-1"
    assert pod["restartPolicy"] == "Never" and pod["serviceAccountName"] == "fit-1-reporter"
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["activeDeadlineSeconds"] == 7200
    check_restricted(pod, "fit-1")
    role = objs[1]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "update", "patch"],
         "resourceNames": ["fit-1-result"]}]


def test_train_job_command_is_what_phasewise_train_parses():
    from routerd.cli import _train_parser

    spec = parse_job_spec({"poolRef": {"name": "chat"}, "task": "train",
                           "train": {"episodes": 12, "rate": 7.5, "seed": 3, "variant": "baseline"}})
    job = J.batch_job(JOB, spec, POOL, POOL_SPEC, OPS, target_url=None)
    work = job["spec"]["template"]["spec"]["initContainers"][0]
    assert work["image"] == "example/routerd:1-rl"
    assert work["command"][:2] == ["phasewise", "train"]
    parser = argparse.ArgumentParser()
    _train_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(work["command"][1:])
    assert (args.instances, args.episodes, args.rate, args.seed, args.variant) == (4, 12, 7.5, 3, "baseline")
    assert args.profile == "/etc/phasewise/profile.yaml" and args.output == "/results/checkpoint" and args.quiet
    vol = next(v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "profile")
    assert vol["configMap"] == {"name": "chat-routerd", "items": [{"key": "profile.yaml", "path": "profile.yaml"}]}
    check_restricted(job["spec"]["template"]["spec"], "train")


def test_pick_target():
    eps = [{"name": "e-0", "url": "http://a:8000", "ready": False}, {"name": "e-1", "url": "http://b:8000", "ready": True}]
    assert J.pick_target(eps, None) == ("http://b:8000", "")
    assert J.pick_target(eps, "e-1") == ("http://b:8000", "")
    url, why = J.pick_target(eps, "e-0")
    assert url is None and "spec.profile.instance" in why
    assert J.pick_target([], None) == (None, "the pool has no ready instance yet")


def test_job_phase_and_failure_detail():
    assert J.job_phase(None)[0] == "Pending"
    assert J.job_phase({"status": {"active": 1}}) == ("Running", "")
    assert J.job_phase({"status": {"conditions": [{"type": "Complete", "status": "True"}]}}) == ("Succeeded", "")
    phase, msg = J.job_phase({"status": {"conditions": [
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "Job has reached the specified backoff limit"}]}})
    assert phase == "Failed" and msg == "batch Job failed: BackoffLimitExceeded: Job has reached the specified backoff limit"
    pods = [{"status": {"initContainerStatuses": [{"name": "work", "state": {"terminated": {
        "exitCode": 2, "message": "phasewise: error: --endpoint: connection refused", "finishedAt": "2026-11-30T01:00:00Z"}}}]}}]
    assert J.failure_detail(pods) == "container work exited 2: phasewise: error: --endpoint: connection refused"
    assert J.failure_detail([{"status": {"containerStatuses": [{"name": "report", "state": {"terminated": {"exitCode": 0}}}]}}]) == ""


def test_profile_result_becomes_an_inline_profile():
    fitted = {"name": "fitted", "grad1": 3.0e-4, "grad2": 3.1e-5, "overhead_s": 0.021, "prefill_per_token_s": 3.0e-4,
              "not_a_profile_term": 1}
    inline, fit = J.profile_from_result({"profile.yaml": yaml.safe_dump(fitted), "fit.json": '{"r2": 0.99}'},
                                        POOL, POOL_SPEC)
    assert inline["basedOn"] == "llama2-7b-v100"
    assert (inline["grad1"], inline["grad2"], inline["overheadS"], inline["prefillPerTokenS"]) == (3.0e-4, 3.1e-5, 0.021, 3.0e-4)
    assert inline["kvCapacityTokens"] == 30208  # not fitted: the pool's current value
    assert "notAProfileTerm" not in inline and fit == {"r2": 0.99}
    assert J.profile_pool_patch(inline) == {"spec": {"hardwareProfile": {"name": None, "inline": inline}}}
    # the patched pool resolves to a valid profile
    patched = POOL_SPEC.wire()
    patched["hardwareProfile"] = {"inline": inline}
    from phasewise_operator.spec import resolve_profile

    assert resolve_profile(parse_pool_spec(patched), pool_name="chat").overhead_s == 0.021


@pytest.mark.parametrize("data,error", [
    ({}, "no profile.yaml"),
    ({"profile.yaml": "a: [1"}, "not YAML"),
    ({"profile.yaml": "[1, 2]"}, "not a mapping"),
    ({"profile.yaml": "grad1: 1.0e-4\ngrad2: 1.0e-5\n"}, "lacks the fitted term overhead_s"),
    ({"profile.yaml": "grad1: -1.0\ngrad2: 1.0e-5\noverhead_s: 0.01\n"}, "grad1"),
    ({"profile.yaml": "grad1: 1.0e-4\ngrad2: 1.0e-5\noverhead_s: 0.01\nkv_capacity_tokens: 1000\n"}, "kvCapacityTokens"),
])
def test_bad_profile_results(data, error):
    with pytest.raises(J.ResultError) as e:
        J.profile_from_result(data, POOL, POOL_SPEC)
    assert error in str(e.value)


def _ckpt_cm(meta: dict | str, model: bytes | str = b"\x00weights"):
    return {"metadata": {"name": "train-1-result"},
            "binaryData": {"model.safetensors": model if isinstance(model, str) else base64.b64encode(model).decode()},
            "data": {"metadata.json": meta if isinstance(meta, str) else json.dumps(meta)}}


def test_checkpoint_result():
    meta = {"format": "phasewise-dqn/1", "num_instances": 4, "variant": "workload-guided",
            "evaluation": {"mean_e2e_vs_round_robin": -0.031}}
    ck = J.checkpoint_from_configmap(_ckpt_cm(meta))
    assert J.checkpoint_problem(ck, 4) is None
    assert "trained for 4 instances; spec.engine.replicas is 3" in J.checkpoint_problem(ck, 3)
    assert J.evaluation(ck) == {"variant": "workload-guided", "num_instances": 4, "mean_e2e_vs_round_robin": -0.031}
    saved = J.checkpoint_configmap(PoolRef("train-1", "llm", "u"), POOL, ck)
    assert saved["metadata"]["name"] == "train-1-checkpoint"
    assert saved["metadata"]["ownerReferences"][0]["kind"] == "LLMRouterPool"  # outlives the job
    assert saved["binaryData"] == {"model.safetensors": ck.model_b64}
    assert J.checkpoint_pool_patch("train-1-checkpoint") == {"spec": {"routing": {"checkpoint": {"configMap": "train-1-checkpoint"}}}}
    with pytest.raises(J.ResultError, match="no binaryData model.safetensors"):
        J.checkpoint_from_configmap({"metadata": {"name": "x"}, "data": {"metadata.json": "{}"}})
    with pytest.raises(J.ResultError, match="not base64"):
        J.checkpoint_from_configmap(_ckpt_cm({}, model="%%%"))
    with pytest.raises(J.ResultError, match="not JSON"):
        J.checkpoint_from_configmap(_ckpt_cm("{"))


def test_reporter_builds_the_result_configmap(tmp_path):
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "model.safetensors").write_bytes(b"\x01\x02weights")
    (tmp_path / "checkpoint" / "metadata.json").write_text('{"num_instances": 4}')
    cm = R.result_configmap("train", tmp_path, name="t-result", namespace="llm", owner_name="t", owner_uid="u1")
    assert base64.b64decode(cm["binaryData"]["model.safetensors"]) == b"\x01\x02weights"
    assert cm["data"] == {"metadata.json": '{"num_instances": 4}'}
    assert cm["metadata"]["ownerReferences"] == [{"apiVersion": "phasewise.io/v1alpha1", "kind": "LLMRouterJob",
                                                  "name": "t", "uid": "u1", "controller": True,
                                                  "blockOwnerDeletion": False}]
    # what the operator reads back is the same checkpoint
    assert J.checkpoint_from_configmap(cm).model_b64 == cm["binaryData"]["model.safetensors"]
    with pytest.raises(R.ReportError, match="wrote no profile"):
        R.result_configmap("profile", tmp_path, name="x", namespace="n", owner_name="o", owner_uid="u")
    (tmp_path / "profile.yaml").write_text("grad1: 1\n")
    cm = R.result_configmap("profile", tmp_path, name="x", namespace="n", owner_name="o", owner_uid="u")
    assert cm["data"] == {"profile.yaml": "grad1: 1\n"} and "binaryData" not in cm
    (tmp_path / "checkpoint" / "model.safetensors").write_bytes(b"\x00" * (R.MAX_BYTES + 1))
    with pytest.raises(R.ReportError, match="at most"):
        R.result_configmap("train", tmp_path, name="x", namespace="n", owner_name="o", owner_uid="u")


def test_reporter_main_fails_in_one_line(tmp_path, capsys):
    env = {"POD_NAMESPACE": "llm", "PHASEWISE_OWNER_NAME": "t", "PHASEWISE_OWNER_UID": "u"}
    assert R.main(["--results", str(tmp_path), "--task", "train", "--configmap", "t-result"], environ=env) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the trainer wrote no model.safetensors" in err
    assert R.main(["--results", str(tmp_path), "--task", "train", "--configmap", "x"], environ={}) == 2
    assert "POD_NAMESPACE is not set" in capsys.readouterr().err


def test_jobs_of_a_pool_with_engine_groups():
    """A profile job measures one instance with its group's model; a train job simulates every group's
    instances together (routerd routes over all of them)."""
    ps = parse_pool_spec({"engine": {"replicas": 2}, "engineGroups": [
        {"name": "a", "model": {"name": "org/a", "servedModelName": "a"}},
        {"name": "b", "model": {"name": "org/b"}, "replicas": 3}]})
    prof = parse_job_spec({"poolRef": {"name": "chat"}, "task": "profile"})
    cmd = J.work_command(prof, ps, target_url="http://10.0.0.7:8000", target_model="org/b")
    assert cmd[cmd.index("--model") + 1] == "org/b"
    cmd = J.work_command(prof, ps, target_url="http://10.0.0.7:8000")
    assert cmd[cmd.index("--model") + 1] == "a"  # unknown group: the first model
    train = parse_job_spec({"poolRef": {"name": "chat"}, "task": "train"})
    cmd = J.work_command(train, ps, target_url=None)
    assert cmd[cmd.index("--instances") + 1] == "5"
