"""DQN policy: observation layout, numpy network, checkpoints and their errors (no torch needed)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import toy_profile

from routerd.policies.base import (
    ClusterView,
    PolicyContext,
    RequestFeatures,
    ResidentRequest,
)
from routerd.policies.dqn.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from routerd.policies.dqn.features import OBS_VERSION, featurize, obs_dim
from routerd.policies.dqn.network import q_values
from routerd.policies.registry import PolicyError, build_policy
from routerd.policies.static_view import StaticInstanceView


def res(p, g, pred, *, prefill=False, waiting=False):
    return ResidentRequest(p, g, None, float(pred), prefill or waiting, waiting)


def test_obs_width_matches_paper_for_four_instances():
    assert obs_dim(4) == 27
    assert obs_dim(8) == 51


def test_featurize_layout_by_hand():
    # instance 0: one waiting (p 100), decoding with predicted outputs 100, 300, 3000 (one per bin),
    #   remaining predicted decode 100-10 = 90, 300-200 = 100, 3000-0 = 3000 -> min 90 tokens
    #   -> 90 * 0.035 s = 3.15 s -> /10 = 0.315; KV 25 of 100 blocks used -> free 0.75
    # instance 1: empty -> zeros, free 1.0
    v0 = StaticInstanceView(0, num_running=3, num_waiting=1, kv_used_blocks=25, kv_total_blocks=100,
                            requests=[res(50, 10, 100), res(50, 200, 300), res(50, 0, 3000),
                                      res(100, 0, 100, waiting=True)])
    v1 = StaticInstanceView(1, kv_total_blocks=100)
    view = ClusterView(now=1.0, instances=[v0, v1], queue_len=5)
    req = RequestFeatures(0, 0.0, 512, 2, 2500.0)
    x = featurize(req, view, decode_token_time_s=0.035, num_buckets=4)
    expect = [5 / 512, 0.5, 2 / 3,
              1 / 32, 1 / 32, 1 / 32, 1 / 32, 0.75, 0.315,
              0, 0, 0, 0, 1.0, 0]
    np.testing.assert_allclose(x, np.array(expect, dtype=np.float32), rtol=1e-6)


def _weights(obs, actions, hidden=8, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "l1.weight": rng.normal(size=(hidden, obs)).astype(np.float32), "l1.bias": np.zeros(hidden, np.float32),
        "l2.weight": rng.normal(size=(hidden, hidden)).astype(np.float32), "l2.bias": np.zeros(hidden, np.float32),
        "l3.weight": rng.normal(size=(actions, hidden)).astype(np.float32), "l3.bias": np.arange(actions, dtype=np.float32),
    }


def test_numpy_forward_by_hand():
    w = {"l1.weight": np.array([[1.0, -1.0], [0.5, 0.5]]), "l1.bias": np.array([0.0, -1.0]),
         "l2.weight": np.eye(2), "l2.bias": np.zeros(2),
         "l3.weight": np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]), "l3.bias": np.array([0.0, 0.0, -0.5])}
    # x = (3, 1): l1 -> (2, 1) relu (2, 1); l2 identity; l3 -> (2, 2, 2.5)
    np.testing.assert_allclose(q_values(w, np.array([3.0, 1.0])), [2.0, 2.0, 2.5])


def test_checkpoint_round_trip_and_policy(tmp_path):
    prof = toy_profile()
    w = _weights(obs_dim(2), 3)
    # bias favours the last action (hold) strongly -> the policy holds; without hold -> index 1
    w["l3.bias"] = np.array([0.0, 50.0, 100.0], np.float32)
    w["l3.weight"][:] = 0
    save_checkpoint(tmp_path / "ck", w, {"variant": "baseline", "num_instances": 2})
    ck = load_checkpoint(tmp_path / "ck", num_instances=2)
    assert ck.metadata["obs_version"] == OBS_VERSION
    np.testing.assert_array_equal(ck.weights["l3.bias"], w["l3.bias"])
    view = ClusterView(0.0, [StaticInstanceView(0), StaticInstanceView(1)], 1)
    req = RequestFeatures(0, 0.0, 10, 0, 125.0)
    ctx = PolicyContext(prof, 2)
    assert build_policy("dqn", {"checkpoint": str(tmp_path / "ck")}, ctx).pick(req, view) is None
    p = build_policy("dqn", {"checkpoint": str(tmp_path / "ck"), "allow_hold": "false"}, ctx)
    assert p.pick(req, view) == 1


def test_checkpoint_errors_name_file_and_mismatch(tmp_path):
    prof = toy_profile()
    w = _weights(obs_dim(2), 3)
    save_checkpoint(tmp_path / "ck", w, {"variant": "baseline", "num_instances": 2})
    with pytest.raises(CheckpointError, match=r"trained for 2 instances, but the cluster has 4"):
        load_checkpoint(tmp_path / "ck", num_instances=4)
    with pytest.raises(PolicyError, match="dqn.*trained for 2 instances"):
        build_policy("dqn", {"checkpoint": str(tmp_path / "ck")}, PolicyContext(prof, 4))
    with pytest.raises(CheckpointError, match="not a folder"):
        load_checkpoint(tmp_path / "missing")
    meta = json.loads((tmp_path / "ck" / "metadata.json").read_text())
    meta["obs_version"] = "pw-obs-v0"
    (tmp_path / "ck" / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="observation layout 'pw-obs-v0'"):
        load_checkpoint(tmp_path / "ck")
    meta["obs_version"] = OBS_VERSION
    (tmp_path / "ck" / "metadata.json").write_text(json.dumps(meta))
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="model.safetensors is corrupt"):
        load_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "metadata.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="metadata.json is not valid JSON"):
        load_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "metadata.json").unlink()
    with pytest.raises(CheckpointError, match="missing metadata.json"):
        load_checkpoint(tmp_path / "ck")


def test_wrong_shapes_are_refused(tmp_path):
    w = _weights(obs_dim(3), 4)  # made for 3 instances but labelled 2
    save_checkpoint(tmp_path / "ck", w, {"variant": "baseline", "num_instances": 2})
    with pytest.raises(CheckpointError, match="l1.weight has shape"):
        load_checkpoint(tmp_path / "ck")


@pytest.mark.parametrize("tensor, bad, needle", [
    ("l2.bias", float("nan"), "non-finite"),
    ("l1.weight", float("inf"), "non-finite"),
    ("l3.weight", None, "dtype int64"),
])
def test_non_finite_or_integer_weights_are_refused(tmp_path, tensor, bad, needle):
    w = _weights(obs_dim(2), 3)
    if bad is None:
        w[tensor] = np.ones(w[tensor].shape, dtype=np.int64)
        from safetensors.numpy import save_file

        save_checkpoint(tmp_path / "ck", _weights(obs_dim(2), 3), {"variant": "baseline", "num_instances": 2})
        save_file(w, str(tmp_path / "ck" / "model.safetensors"))  # save_checkpoint would cast to float32
    else:
        w[tensor] = w[tensor].copy()
        w[tensor].flat[0] = bad
        save_checkpoint(tmp_path / "ck", w, {"variant": "baseline", "num_instances": 2})
    with pytest.raises(CheckpointError, match=needle) as e:
        load_checkpoint(tmp_path / "ck")
    assert str(tmp_path / "ck") in str(e.value) and tensor in str(e.value)


def _write_bf16_safetensors(path, names_shapes) -> None:
    """A safetensors file of bfloat16 zeros, written by hand (numpy has no bfloat16)."""
    import struct

    header, offset = {}, 0
    for name, shape in names_shapes.items():
        n = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def test_a_bfloat16_checkpoint_is_a_one_line_checkpoint_error(tmp_path):
    w = _weights(obs_dim(2), 3)
    save_checkpoint(tmp_path / "ck", w, {"variant": "baseline", "num_instances": 2})
    _write_bf16_safetensors(tmp_path / "ck" / "model.safetensors", {k: v.shape for k, v in w.items()})
    with pytest.raises(CheckpointError, match="numpy cannot read") as e:
        load_checkpoint(tmp_path / "ck")
    assert str(tmp_path / "ck") in str(e.value) and "\n" not in str(e.value)


def test_deeply_nested_metadata_is_a_checkpoint_error(tmp_path):
    save_checkpoint(tmp_path / "ck", _weights(obs_dim(2), 3), {"variant": "baseline", "num_instances": 2})
    (tmp_path / "ck" / "metadata.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="nested too deeply"):
        load_checkpoint(tmp_path / "ck")


def test_a_boolean_instance_count_is_refused(tmp_path):
    save_checkpoint(tmp_path / "ck", _weights(obs_dim(1), 2), {"variant": "baseline", "num_instances": True})
    with pytest.raises(CheckpointError, match="num_instances=True"):
        load_checkpoint(tmp_path / "ck")


def test_shipped_checkpoint_reproduces_its_recorded_held_out_figures():
    """The default checkpoint loads for its cluster, and re-simulating held-out sample 0
    gives exactly the figures its metadata records (so they were made by these weights)."""
    from routerd.policies.dqn.policy import DQNPolicy
    from routerd.policies.round_robin import RoundRobin
    from routerd.profiles import get_profile
    from routerd.rl import splits
    from routerd.sim import ClusterSimulator, prepare_requests
    from routerd.sim.report import summarize

    ck = load_checkpoint("default", num_instances=4)
    meta = ck.metadata
    assert (meta["num_instances"], meta["profile"], meta["obs_version"]) == (4, "llama2-7b-v100", OBS_VERSION)
    assert meta["variant"] in ("baseline", "workload-aware", "workload-guided")
    with pytest.raises(CheckpointError, match="4 instances"):
        load_checkpoint("default", num_instances=8)
    ev, wl = meta["evaluation"], meta["workload"]
    assert ev["part"] == "eval" and wl["part"] == "train"
    row = ev["samples"][0]
    prof = get_profile(meta["profile"])
    from routerd.workloads.errors import WorkloadError

    try:
        reqs = splits.sample(wl["name"], "eval", 0, wl["requests_per_episode"], wl["rate"])
    except WorkloadError as e:  # public-mix reads ../shared/data
        pytest.skip(str(e))
    prediction = meta["hyperparameters"]["prediction"]
    for make, key in ((lambda c: DQNPolicy(c), "e2e_mean"), (RoundRobin, "rr_e2e_mean")):
        prep = prepare_requests(reqs, prof, prediction=prediction, seed=0)
        s = summarize(ClusterSimulator(prof, 4, make(PolicyContext(prof, 4, seed=0))).run(prep.requests))
        assert s.e2e_mean == pytest.approx(row[key], rel=1e-12)


def test_default_bench_policies_keep_dqn_only_where_the_shipped_checkpoint_fits():
    from routerd.policies.registry import DEFAULT_BENCH_POLICIES, default_bench_policies

    specs, notes = default_bench_policies(4, "llama2-7b-v100")
    assert specs == DEFAULT_BENCH_POLICIES and "dqn" in specs and notes == []
    specs, notes = default_bench_policies(8, "llama2-7b-v100")
    assert "dqn" not in specs and specs == [s for s in DEFAULT_BENCH_POLICIES if s != "dqn"]
    assert len(notes) == 1 and "dqn left out" in notes[0] and "8" in notes[0]
    specs, notes = default_bench_policies(4, "llama2-7b-a100")
    assert "dqn" not in specs and "llama2-7b-a100" in notes[0]
