"""Mixed pools (issue 18): one hardware profile per instance in the simulator, the bench, the
policies' context and the capacity that loads are set against.

Expected values: each instance's lone-request latency is the profile's own closed form
(:meth:`HardwareProfile.lone_request_time`, independent of the simulator's scheduler); a pool of
one profile given per instance must reproduce the single-profile run exactly.
"""

from __future__ import annotations

import json

import pytest
import yaml

from routerd.bench import load_to_rate, run_bench
from routerd.cli import main
from routerd.model import Request
from routerd.policies.base import PolicyContext
from routerd.policies.round_robin import RoundRobin
from routerd.profiles import (
    PoolError,
    ProfileError,
    as_pool,
    get_profile,
    parse_pool,
    pool_admission_profile,
    pool_label,
    profile_model,
)
from routerd.sim import ClusterSimulator, prepare_requests
from routerd.sim.capacity import round_robin_capacity
from routerd.workloads.registry import load_workload

A100 = get_profile("llama3.1-8b-a100")
H100 = get_profile("llama3.1-8b-h100")


# --- parsing ---------------------------------------------------------------------------------


def test_parse_pool_keeps_order_and_counts():
    pool = parse_pool("2xllama3.1-8b-a100, 1 x llama3.1-8b-h100,1xllama3.1-8b-a100")
    assert [p.name for p in pool] == ["llama3.1-8b-a100"] * 2 + ["llama3.1-8b-h100", "llama3.1-8b-a100"]
    assert pool_label(pool) == "2xllama3.1-8b-a100,1xllama3.1-8b-h100,1xllama3.1-8b-a100"
    assert [p.name for p in parse_pool(pool_label(pool))] == [p.name for p in pool]
    assert pool_label(parse_pool("3xllama2-7b-v100")) == "llama2-7b-v100"  # homogeneous: the profile's name


def test_profile_model_is_the_name_before_the_gpu():
    assert profile_model(A100) == profile_model(H100) == "llama3.1-8b"
    assert profile_model(get_profile("llama2-7b-v100")) == "llama2-7b"


def test_a_profile_named_otherwise_joins_a_pool_by_its_model_field(tmp_path):
    # What `phasewise profile --derive llama-2-7b a100-80gb-sxm` names its profile: the name's
    # model part (llama-2-7b-a100-80gb) is not the shipped one's, so it is refused with the way out
    # named; with `model: llama2-7b` it pools with llama2-7b-v100.
    from routerd.profiles import PoolError, check_pool

    v100 = get_profile("llama2-7b-v100")
    data = get_profile("llama2-7b-a100").model_dump()
    data["name"] = "llama-2-7b-a100-80gb-sxm"
    path = tmp_path / "derived.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PoolError, match="'llama-2-7b-a100-80gb-sxm' serves 'llama-2-7b-a100-80gb'.*same 'model:'"):
        check_pool([v100, get_profile(str(path))])
    data["model"] = "llama2-7b"
    path.write_text(yaml.safe_dump(data))
    pool = parse_pool(f"1xllama2-7b-v100,1x{path}")
    assert [profile_model(p) for p in pool] == ["llama2-7b", "llama2-7b"]


@pytest.mark.parametrize("text, words", [
    ("2xllama3.1-8b-a100,2xllama2-7b-a100", ["llama3.1-8b-a100", "llama2-7b-a100", "llama3.1-8b", "llama2-7b",
                                             "different models"]),
    ("2xllama3.1-8b-b200", ["llama3.1-8b-b200", "llama2-7b-v100", "llama3.1-8b-h100"]),  # lists the valid ones
    ("2llama2-7b-a100", ["2llama2-7b-a100", "COUNT x PROFILE"]),
    ("0xllama2-7b-a100", ["COUNT must be >= 1"]),
    (" , ", ["empty"]),
    ("2xllama3.1-8b-a100,", ["item 2 of 2 is empty"]),  # a stray ',' is a typo, not a smaller pool
    ("2xllama3.1-8b-a100,,2xllama3.1-8b-h100", ["item 2 of 3 is empty"]),
])
def test_bad_pools_are_one_clear_error(text, words):
    with pytest.raises(ProfileError) as e:
        parse_pool(text)
    for w in words:
        assert w in str(e.value)


def test_pool_checks():
    with pytest.raises(ValueError, match="3 profiles for 2 instances"):
        as_pool((A100, A100, H100), 2)
    with pytest.raises(PoolError, match="block sizes"):
        as_pool((A100, H100.model_copy(update={"block_size": 32})), 2)
    assert as_pool(A100, 3) == (A100, A100, A100)
    short = H100.model_copy(update={"name": "llama3.1-8b-h100x", "max_model_len": 8192})
    assert pool_admission_profile((A100, short, A100)) is short


def test_policy_context_profiles():
    ctx = PolicyContext(A100, 3)
    assert ctx.profiles == (A100, A100, A100) and ctx.homogeneous
    mixed = PolicyContext(A100, 2, profiles=(A100, H100))
    assert mixed.profiles == (A100, H100) and not mixed.homogeneous and mixed.profile is A100
    with pytest.raises(ValueError, match="1 profiles for 2 instances"):
        PolicyContext(A100, 2, profiles=(A100,))


# --- the simulator ---------------------------------------------------------------------------


def _lone_run(pool):
    # Requests 1,000 s apart never overlap; round robin sends request i to instance i % m.
    reqs = [Request(id=i, arrival_s=1000.0 * i, prompt_tokens=500, output_tokens=200) for i in range(len(pool))]
    prep = prepare_requests(reqs, pool[0])
    sim = ClusterSimulator(pool, len(pool), RoundRobin(PolicyContext(pool[0], len(pool), profiles=pool)))
    return sim.run(prep.requests)


def test_each_instance_runs_with_its_own_profile():
    run = _lone_run((A100, H100, A100))
    e2e = [r.finish_s - r.arrival_s for r in run.requests]
    assert [r.instance for r in run.requests] == [0, 1, 2]
    # 500 prompt tokens fit one step of either budget, so the closed form is exact.
    assert e2e[0] == pytest.approx(A100.lone_request_time(500, 200), rel=1e-9)
    assert e2e[1] == pytest.approx(H100.lone_request_time(500, 200), rel=1e-9)
    assert e2e[2] == pytest.approx(e2e[0], rel=1e-12)
    assert e2e[1] < 0.75 * e2e[0]  # the H100 profile is faster
    assert [i.total_blocks for i in run.instances] == [A100.num_blocks, H100.num_blocks, A100.num_blocks]


@pytest.mark.usefixtures("data_dir")  # public-mix reads ../shared/data: skipped without it
def test_a_pool_of_one_profile_equals_the_single_profile_run():
    wl = load_workload("public-mix", n=200, seed=3, rate=30.0)
    a = run_bench(wl.requests, A100, 3, ["round_robin", "late_binding", "phasewise"], seed=3)
    b = run_bench(wl.requests, (A100, A100, A100), 3, ["round_robin", "late_binding", "phasewise"], seed=3)
    assert b.profile == a.profile == "llama3.1-8b-a100"
    for x, y in zip(a.results, b.results):
        assert x.summary == y.summary
        assert all((x.records[k] == y.records[k]).all() for k in x.records)


@pytest.mark.usefixtures("data_dir")  # public-mix reads ../shared/data: skipped without it
def test_round_robin_capacity_of_a_mixed_pool_lies_between_the_homogeneous_ones():
    reqs = load_workload("public-mix", n=300, seed=1).requests
    slow = round_robin_capacity(reqs, A100, 4)
    fast = round_robin_capacity(reqs, H100, 4)
    mixed = round_robin_capacity(reqs, (A100, A100, H100, H100), 4)
    # Round robin gives every instance the same share, so the slow ones set its makespan: here
    # exactly the all-A100 value (instances 0 and 1 get the same requests in both pools).
    assert slow <= mixed < fast
    # load_to_rate scales to load x that capacity.
    scaled, cap, rate = load_to_rate(reqs, (A100, A100, H100, H100), 4, 1.5)
    assert cap == mixed and rate == pytest.approx(1.5 * mixed)
    span = scaled[-1].arrival_s - scaled[0].arrival_s
    assert (len(scaled) - 1) / span == pytest.approx(rate, rel=0.02)


# --- the bench command -----------------------------------------------------------------------


@pytest.mark.usefixtures("data_dir")  # public-mix reads ../shared/data: skipped without it
def test_bench_runs_a_mixed_pool(tmp_path, capsys):
    rc = main(["bench", "-w", "public-mix", "-n", "120", "--instances", "1xllama3.1-8b-a100,1xllama3.1-8b-h100",
               "--policies", "round_robin,predicted_latency", "--no-plot", "-o", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "profile=1xllama3.1-8b-a100,1xllama3.1-8b-h100 instances=2" in out
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["pool"] == ["llama3.1-8b-a100", "llama3.1-8b-h100"] and data["instances"] == 2
    # Round robin alternates, whatever the speeds.
    rows = (tmp_path / "requests.csv").read_text().splitlines()[1:]
    rr = [int(r.split(",")[4]) for r in rows if r.startswith("round_robin,")]
    assert rr.count(0) == rr.count(1) == 60


@pytest.mark.usefixtures("data_dir")  # public-mix reads ../shared/data: skipped without it
def test_a_default_bench_of_a_mixed_pool_adds_predicted_latency_and_says_so(tmp_path, capsys):
    from routerd.policies.registry import DEFAULT_BENCH_POLICIES

    assert main(["bench", "-w", "public-mix", "-n", "30", "--instances", "1xllama3.1-8b-a100,1xllama3.1-8b-h100",
                 "--no-plot", "-o", str(tmp_path / "mixed")]) == 0
    assert "note: a mixed pool: predicted_latency added" in capsys.readouterr().err
    names = [r.split(",")[0] for r in (tmp_path / "mixed" / "requests.csv").read_text().splitlines()[1:]]
    assert "predicted_latency" in names and names[-1] == "oracle"
    # One profile: the published default list, unchanged.
    assert main(["bench", "-w", "public-mix", "-n", "30", "--instances", "2xllama3.1-8b-a100", "--no-plot",
                 "-o", str(tmp_path / "one")]) == 0
    assert "predicted_latency" not in capsys.readouterr().err
    assert "predicted_latency" not in (tmp_path / "one" / "requests.csv").read_text()
    assert "predicted_latency" not in DEFAULT_BENCH_POLICIES
    # A copy of a profile under another name is one profile's terms: not mixed for the defaults.
    import yaml
    from routerd.profiles import get_profile

    copy = tmp_path / "my-a100.yaml"
    copy.write_text(yaml.safe_dump({**get_profile("llama3.1-8b-a100").model_dump(), "name": "my-a100",
                                    "model": "llama3.1-8b"}))
    assert main(["bench", "-w", "public-mix", "-n", "30", "--instances", f"1xllama3.1-8b-a100,1x{copy}",
                 "--no-plot", "-o", str(tmp_path / "copy")]) == 0
    assert "predicted_latency" not in capsys.readouterr().err


def test_bench_pool_of_one_profile_prints_what_a_count_prints(tmp_path, capsys):
    base = ["bench", "--limit", "60", "--policies", "round_robin,late_binding", "--no-plot"]
    assert main(base + ["-o", str(tmp_path / "a"), "--instances", "3", "--profile", "llama2-7b-a100"]) == 0
    a = capsys.readouterr().out
    assert main(base + ["-o", str(tmp_path / "b"), "--instances", "3xllama2-7b-a100"]) == 0
    b = capsys.readouterr().out
    assert a.replace("/a/", "/b/") == b


@pytest.mark.parametrize("args, words", [
    (["--instances", "2xllama3.1-8b-a100,2xllama2-7b-a100"], ["llama3.1-8b-a100", "llama2-7b-a100"]),
    (["--instances", "2xllama2-7b-a100", "--profile", "llama2-7b-a100"], ["--profile"]),
    (["--instances", "2xnope"], ["nope", "llama2-7b-v100"]),
    (["--instances", "1xllama2-7b-a100,1xllama2-7b-v100", "--study8"], ["--study8"]),
])
def test_bad_pool_arguments_exit_2_with_one_line(tmp_path, capsys, args, words):
    assert main(["bench", "--limit", "10", "--no-plot", "-o", str(tmp_path)] + args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("phasewise: error:")
    for w in words:
        assert w in err
