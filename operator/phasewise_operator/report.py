"""``python -m phasewise_operator.report``: the result reporter of an LLMRouterJob's pod.

Runs after the ``work`` init container and copies its output from ``--results`` into
the ConfigMap ``--configmap`` (created, or replaced on a retry), owned by the
LLMRouterJob named by ``PHASEWISE_OWNER_NAME``/``PHASEWISE_OWNER_UID`` so it is
deleted with the job. Exit status 2 with a one-line message (the pod's termination
message) when an expected file is missing.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
from pathlib import Path
from typing import Any, Mapping

from phasewise_operator.gen_crds import API_VERSION
from phasewise_operator.jobs import RESULT_FIT, RESULT_METADATA, RESULT_MODEL, RESULT_PROFILE

MAX_BYTES = 1_000_000
"""A ConfigMap holds at most 1 MiB; leave room for metadata."""


class ReportError(Exception):
    """A missing or oversized result file (the message names it)."""


def result_configmap(task: str, results: Path, *, name: str, namespace: str, owner_name: str,
                     owner_uid: str) -> dict[str, Any]:
    """The result ConfigMap for the files under ``results``.

    Raises:
        ReportError: a required file is missing, or the files exceed :data:`MAX_BYTES`.
    """
    data: dict[str, str] = {}
    binary: dict[str, str] = {}
    if task == "profile":
        prof = results / RESULT_PROFILE
        if not prof.is_file():
            raise ReportError(f"{prof}: the profiler wrote no profile")
        data[RESULT_PROFILE] = prof.read_text(encoding="utf-8")
        if (results / RESULT_FIT).is_file():
            data[RESULT_FIT] = (results / RESULT_FIT).read_text(encoding="utf-8")
    elif task == "train":
        ckpt = results / "checkpoint"
        for f in (RESULT_MODEL, RESULT_METADATA):
            if not (ckpt / f).is_file():
                raise ReportError(f"{ckpt / f}: the trainer wrote no {f}")
        binary[RESULT_MODEL] = base64.b64encode((ckpt / RESULT_MODEL).read_bytes()).decode()
        data[RESULT_METADATA] = (ckpt / RESULT_METADATA).read_text(encoding="utf-8")
    else:
        raise ReportError(f"--task {task!r}: expected profile or train")
    size = sum(len(v) for v in data.values()) + sum(len(v) * 3 // 4 for v in binary.values())
    if size > MAX_BYTES:
        raise ReportError(f"results are {size} bytes; a ConfigMap holds at most {MAX_BYTES}")
    cm: dict[str, Any] = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": "phasewise-operator",
                                "app.kubernetes.io/component": "job-result", "phasewise.io/job": owner_name},
                     "ownerReferences": [{"apiVersion": API_VERSION, "kind": "LLMRouterJob", "name": owner_name,
                                          "uid": owner_uid, "controller": True, "blockOwnerDeletion": False}]},
        "data": data,
    }
    if binary:
        cm["binaryData"] = binary
    return cm


def write(kube, cm: Mapping[str, Any]) -> None:
    """Create the result ConfigMap, or replace the one an earlier attempt of the pod wrote.

    Raises:
        ApiError: the API server refused (e.g. 403 outside the reporter's Role).
    """
    from phasewise_operator.kube import ApiError, path

    try:
        kube.create(cm)
    except ApiError as e:
        if e.status != 409:
            raise
        meta = cm["metadata"]
        kube.request("PUT", path("v1", "ConfigMap", meta["namespace"], meta["name"]), body=dict(cm))


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Write the result ConfigMap; 0 on success, 2 with a one-line message otherwise."""
    env = os.environ if environ is None else environ
    p = argparse.ArgumentParser(prog="phasewise_operator.report", description=__doc__.splitlines()[0])
    p.add_argument("--results", required=True, help="folder the work container wrote")
    p.add_argument("--task", required=True, choices=("profile", "train"))
    p.add_argument("--configmap", required=True, help="name of the result ConfigMap")
    args = p.parse_args(argv)
    try:
        namespace, owner, uid = env["POD_NAMESPACE"], env["PHASEWISE_OWNER_NAME"], env["PHASEWISE_OWNER_UID"]
    except KeyError as e:
        print(f"report: error: environment variable {e.args[0]} is not set", file=sys.stderr)
        return 2
    try:
        cm = result_configmap(args.task, Path(args.results), name=args.configmap, namespace=namespace,
                              owner_name=owner, owner_uid=uid)
    except ReportError as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2
    from phasewise_operator.kube import ApiError, Kube

    kube = Kube.from_environment(field_manager="phasewise-job-reporter")
    try:
        write(kube, cm)
    except ApiError as e:
        print(f"report: error: writing ConfigMap {args.configmap}: {e}", file=sys.stderr)
        return 2
    finally:
        kube.close()
    print(f"report: wrote ConfigMap {namespace}/{args.configmap}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
