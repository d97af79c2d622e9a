"""Shared fixtures: small hand-checkable profiles."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from routerd.profiles import HardwareProfile

# tools/leak_trace.py: an unclosed socket's ResourceWarning (an error here) names the test and
# the stack that created the socket, so a chance leak in CI points at its source (issue 19).
pytest_plugins = ("leak_trace", "realvllm_fixtures")


def toy_profile(**overrides) -> HardwareProfile:
    """A profile with round numbers so latencies can be computed by hand."""
    base = dict(
        name="toy",
        overhead_s=0.01,
        prefill_per_token_s=0.001,
        prefill_attn_s=0.0,
        decode_per_seq_s=0.002,
        decode_per_ctx_token_s=0.0001,
        kv_capacity_tokens=1024,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        chunked_prefill=False,
        max_model_len=64,
        grad1=3.2e-4,
        grad2=3.3e-5,
        decode_token_time_s=0.02,
    )
    base.update(overrides)
    return HardwareProfile(**base)


@pytest.fixture
def toy():
    return toy_profile


_CHECKPOINTS: dict[int, str] = {}


def policy_params(name: str, num_instances: int) -> dict | None:
    """Default parameters for building ``name`` in tests.

    ``dqn`` needs a checkpoint for the right instance count; tests use a seeded random
    network (its choices are arbitrary but valid and deterministic).
    """
    if name != "dqn":
        return None
    if num_instances not in _CHECKPOINTS:
        import tempfile

        import numpy as np

        from routerd.policies.dqn.checkpoint import save_checkpoint
        from routerd.policies.dqn.features import obs_dim

        rng = np.random.default_rng(num_instances)
        d, a, h = obs_dim(num_instances), num_instances + 1, 16
        w = {"l1.weight": rng.normal(size=(h, d)), "l1.bias": rng.normal(size=h),
             "l2.weight": rng.normal(size=(h, h)), "l2.bias": rng.normal(size=h),
             "l3.weight": rng.normal(size=(a, h)), "l3.bias": rng.normal(size=a)}
        path = tempfile.mkdtemp(prefix=f"pw-dqn-m{num_instances}-")
        save_checkpoint(path, w, {"variant": "baseline", "num_instances": num_instances})
        _CHECKPOINTS[num_instances] = path
    return {"checkpoint": _CHECKPOINTS[num_instances]}


def split_checkpoint(folder, m: int, threshold: float, **metadata):
    """A hand-made DQN checkpoint that never holds: prompts longer than ``threshold`` x 1,024
    tokens (feature 1 of pw-obs-v1) go to instance 0 and the others to instance 1
    (``threshold < 0``: every request to instance 0). Returns the folder."""
    import numpy as np

    from routerd.policies.dqn.checkpoint import save_checkpoint
    from routerd.policies.dqn.features import obs_dim

    d, a, h = obs_dim(m), m + 1, 4
    w = {"l1.weight": np.zeros((h, d)), "l1.bias": np.zeros(h), "l2.weight": np.zeros((h, h)),
         "l2.bias": np.zeros(h), "l3.weight": np.zeros((a, h)), "l3.bias": np.full(a, -1e6)}
    w["l1.weight"][0, 1] = w["l2.weight"][0, 0] = w["l3.weight"][0, 0] = 1.0
    w["l3.bias"][0], w["l3.bias"][1] = 0.0, threshold
    return save_checkpoint(folder, w, {"variant": "baseline", "num_instances": m, **metadata})


@pytest.fixture(scope="module")
def data_dir() -> Path:
    """The shared data directory (``../shared/data`` or ``PHASEWISE_DATA_DIR``); the test is
    skipped without it."""
    from routerd.workloads.errors import WorkloadError
    from routerd.workloads.registry import resolve_data_dir

    try:
        return resolve_data_dir(needed_by="this test")
    except WorkloadError as e:
        pytest.skip(str(e))


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as a module (registered in ``sys.modules``:
    dataclasses look their module up while the class is built)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
