"""RL environment and trainer: reward by hand, determinism, a tiny training run, CLI errors."""

from __future__ import annotations

import json

import pytest
from conftest import toy_profile

from routerd.model import Request
from routerd.rl.reward import RewardConfig

gym = pytest.importorskip("gymnasium")


def _env(reqs, variant="baseline", m=1):
    from routerd.rl.env import RoutingEnv

    prof = toy_profile()
    return RoutingEnv(prof, m, lambda seed: reqs, RewardConfig(variant, r_w=60.0))


def test_reward_integrates_the_penalty_over_time_by_hand():
    # One request, prompt 10, output 3, predicted bucket 0 -> point estimate 125 tokens.
    # T = grad1 * 10 + 0.02 * 125 = 0.0032 + 2.5 = 2.5032 s.
    # Events: arrival 0, prefill end 0.02 (generated 1), decode segment end 0.0463 (done).
    # Penalty integral (left sums over events): (1/T)*0.02 + (1/T)(1 - 1/125)*0.0263.
    env = _env([Request(id=0, arrival_s=0.0, prompt_tokens=10, output_tokens=3)])
    obs, _ = env.reset(seed=0)
    assert obs.shape == (9,)
    _, r, done, trunc, info = env.step(0)
    assert done and not trunc
    T = 3.2e-4 * 10 + 0.02 * 125
    integral = 0.02 / T + (1 - 1 / 125) * (0.0463 - 0.02) / T
    assert r == pytest.approx(-integral / 0.02 + 60.0)
    assert info["completed"] == 1


def test_hold_then_dispatch_and_shaping_sign():
    reqs = [Request(id=i, arrival_s=0.0, prompt_tokens=10, output_tokens=3) for i in range(2)]
    env = _env(reqs, "workload-aware", m=2)
    env.reset(seed=0)
    _, r_hold, done, _, info = env.step(2)  # hold: next decision at the 0.02 s tick
    assert not done and info["time"] == pytest.approx(0.02) and info["h"] == 0.0
    _, _, _, _, info = env.step(0)
    assert info["h"] <= 0.0


def test_env_is_deterministic_for_a_seed():
    reqs = [Request(id=i, arrival_s=0.01 * i, prompt_tokens=10 + i, output_tokens=5 + i) for i in range(20)]
    traces = []
    for _ in range(2):
        env = _env(reqs, m=2)
        obs, _ = env.reset(seed=3)
        done, out = False, []
        k = 0
        while not done:
            obs, r, done, _, _ = env.step(k % 3)
            out.append((round(r, 9), tuple(obs.round(6))))
            k += 1
        traces.append(out)
    assert traces[0] == traces[1]


def test_guided_weight_and_discount_schedule():
    cfg = RewardConfig("workload-guided", gamma=0.99, beta_d=0.5)
    # gamma_k = (1 - e^{-0.5 k}) * 0.99; weight = gamma - gamma_k = 0.99 e^{-0.5 k}
    assert cfg.discount(0) == 0.0 and cfg.shaping_weight(0) == pytest.approx(0.99)
    assert cfg.discount(2) == pytest.approx((1 - 0.36787944) * 0.99)
    assert cfg.shaping_weight(10) == pytest.approx(0.99 * 0.006737947, rel=1e-6)
    assert RewardConfig("baseline").shaping_weight(3) == 0.0
    assert RewardConfig("workload-aware").shaping_weight(30) == 1.0
    with pytest.raises(ValueError, match="unknown reward variant"):
        RewardConfig("greedy")


def test_tiny_training_run_writes_a_loadable_checkpoint(tmp_path):
    pytest.importorskip("torch")
    from routerd.policies.dqn.checkpoint import load_checkpoint
    from routerd.rl.train import Args, train

    args = Args(workload="paper-mix", instances=2, episodes=2, requests_per_episode=60, rate=10.0,
                learning_starts=50, batch_size=32, target_update_steps=50, explore_episodes=1,
                eval_episodes=1, output=str(tmp_path / "ck"), seed=1)
    path = train(args, log=lambda _m: None, progress=False)
    ck = load_checkpoint(path, num_instances=2)
    meta = ck.metadata
    assert meta["variant"] == "workload-guided" and meta["num_instances"] == 2
    assert len(meta["training"]["history"]) == 2
    assert meta["evaluation"]["part"] == "eval" and len(meta["evaluation"]["samples"]) == 1
    assert ck.weights["l1.weight"].shape == (64, 15)
    # same seed -> same weights
    args2 = Args(**{**args.__dict__, "output": str(tmp_path / "ck2")})
    ck2 = load_checkpoint(train(args2, log=lambda _m: None, progress=False))
    assert all((ck.weights[k] == ck2.weights[k]).all() for k in ck.weights)
    json.dumps(meta)


def test_train_cli_bad_input_exit_2(capsys):
    pytest.importorskip("torch")
    from routerd.cli import main

    assert main(["train", "--workload", "nope", "--episodes", "1"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["train", "--instances", "0"]) == 2
    assert "--instances" in capsys.readouterr().err


def test_numpy_forward_equals_torch_forward():
    torch = pytest.importorskip("torch")
    import numpy as np

    from routerd.policies.dqn.network import q_values
    from routerd.rl.qnet import build_torch_qnet

    torch.manual_seed(0)
    net = build_torch_qnet(27, 5)
    x = torch.randn(32, 27)
    with torch.no_grad():
        expect = net(x).numpy()
    weights = {k: v.detach().numpy() for k, v in net.state_dict().items()}
    np.testing.assert_allclose(q_values(weights, x.numpy()), expect, rtol=1e-5, atol=1e-6)


def test_large_margin_loss_by_hand():
    torch = pytest.importorskip("torch")
    from routerd.rl.train import large_margin_loss

    q = torch.tensor([[1.0, 2.0, 0.5], [3.0, 0.0, 2.5]])
    a = torch.tensor([1, 0])
    # row 0: max(1+0.8, 2+0, 0.5+0.8) - 2 = 0; row 1: max(3, 0.8, 3.3) - 3 = 0.3
    assert large_margin_loss(q, a, 0.8).item() == pytest.approx(0.15)
    # a demonstrated action that is already ahead by more than the margin costs nothing
    assert large_margin_loss(torch.tensor([[5.0, 0.0]]), torch.tensor([0]), 0.8).item() == 0.0


@pytest.mark.parametrize("loss", ["dqfd", "cross-entropy"])
def test_demonstrations_and_selection_keep_the_best_validated_weights(tmp_path, loss):
    pytest.importorskip("torch")
    from routerd.policies.dqn.checkpoint import load_checkpoint
    from routerd.profiles import get_profile
    from routerd.rl.train import SELECT_INDEX_BASE, Args, greedy_e2e, train

    lines: list[str] = []
    args = Args(workload="paper-mix", instances=2, episodes=2, requests_per_episode=40, rate=10.0,
                learning_starts=20, batch_size=32, target_update_steps=50, explore_episodes=1, eval_episodes=1,
                demo_policy="late_binding", demo_episodes=1, pretrain_steps=20, pretrain_loss=loss,
                select_samples=1, select_from=0, output=str(tmp_path / "ck"), seed=2)
    ck = load_checkpoint(train(args, log=lines.append, progress=False), num_instances=2)
    training = ck.metadata["training"]
    # candidates: the pre-trained network and one per episode; the saved one has the lowest E2E
    scores = [float(x.split("greedy mean E2E ")[1].split("s ")[0]) for x in lines if x.startswith("selection:")]
    assert len(scores) == 3 and any(x.startswith("demonstration 0: late_binding") for x in lines)
    assert training["selection_e2e_mean"] == pytest.approx(min(scores), abs=0.005)
    assert training["selected"] in ("pre-trained", "episode 0", "episode 1")
    # the saved weights reproduce the recorded validation figure
    again = greedy_e2e(ck.weights, get_profile(args.profile), 2, args, "train", [SELECT_INDEX_BASE])
    assert again == pytest.approx(training["selection_e2e_mean"])
    assert "e2e_vs_heuristic_pct_mean" in ck.metadata["evaluation"]


def test_bad_pretrain_loss_is_refused(tmp_path):
    pytest.importorskip("torch")
    from routerd.rl.train import Args, train

    with pytest.raises(ValueError, match="pretrain_loss"):
        train(Args(workload="paper-mix", instances=2, episodes=1, requests_per_episode=20, rate=10.0,
                   demo_policy="late_binding", demo_episodes=1, pretrain_loss="bogus",
                   output=str(tmp_path / "ck")), log=lambda _m: None, progress=False)


def test_a_held_out_part_shorter_than_an_episode_is_refused_before_training(tmp_path):
    # sample: 2,000 requests, train part 1,200, held-out part 800. 900 requests per episode
    # fit the training part, so the failure used to come after training, with nothing saved.
    pytest.importorskip("torch")
    from routerd.rl.train import Args, train

    lines: list[str] = []
    with pytest.raises(ValueError, match="eval part has 800 requests"):
        train(Args(workload="sample", instances=2, episodes=1, requests_per_episode=900, rate=None,
                   output=str(tmp_path / "ck")), log=lines.append, progress=False)
    assert lines == []


@pytest.mark.parametrize("seed, extra, needle", [
    (90, {"select_samples": 1}, "validation"),  # episode 0 = sample 900,000 = validation sample 0
    (100, {"select_samples": 1, "demo_policy": "late_binding", "demo_episodes": 1}, "validation"),
    (-1, {}, "seed"),
    (2**32, {}, "seed"),
])
def test_seeds_whose_sample_indices_collide_are_refused(tmp_path, seed, extra, needle):
    pytest.importorskip("torch")
    from routerd.rl.train import Args, train

    lines: list[str] = []
    with pytest.raises(ValueError, match=needle):
        train(Args(workload="paper-mix", instances=2, episodes=1, requests_per_episode=20, rate=10.0, seed=seed,
                   eval_episodes=1, pretrain_steps=1, output=str(tmp_path / "ck"), **extra),
              log=lines.append, progress=False)
    assert lines == []


@pytest.mark.usefixtures("data_dir")  # reads the shared traces: skipped without them
def test_train_cli_bad_seed_is_one_line(capsys):
    pytest.importorskip("torch")
    from routerd.cli import main

    assert main(["train", "--seed", "-1", "--episodes", "1", "--requests-per-episode", "5", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "seed" in err


@pytest.mark.usefixtures("data_dir")  # reads the shared traces: skipped without them
@pytest.mark.parametrize("argv, want", [
    # No recipe: the CLI's own defaults (30 episodes, exploration over 20, no demonstrations).
    ([], dict(episodes=30, explore_episodes=20, demo_policy=None, select_samples=0, pretrain_loss="dqfd")),
    # A recipe sets every field it names ...
    (["--recipe", "bc"], dict(episodes=6, explore_episodes=3, demo_policy="late_binding", demo_episodes=12,
                              pretrain_steps=12_000, pretrain_loss="cross-entropy", learning_rate=1e-4,
                              select_samples=3, eps_start=0.1)),
    # ... explicit flags win, exploration never outlasts the episodes, '' turns demonstrations off.
    (["--recipe", "bc", "--episodes", "2", "--select-samples", "0", "--demo-policy", ""],
     dict(episodes=2, explore_episodes=2, demo_policy=None, select_samples=0, pretrain_steps=12_000)),
    (["--recipe", "paper", "--episodes", "8"], dict(episodes=8, explore_episodes=8, select_samples=2)),
])
def test_train_cli_recipe_sets_args_and_flags_win(argv, want, monkeypatch):
    pytest.importorskip("torch")
    import routerd.rl.train as T
    from routerd.cli import main

    seen = []
    monkeypatch.setattr(T, "train", lambda args, **kw: seen.append(args))
    assert main(["train", "--quiet", *argv]) == 0
    (args,) = seen
    assert {k: getattr(args, k) for k in want} == want
    # Fields no flag or recipe touches keep Args' defaults.
    assert args.gamma == T.Args().gamma and args.batch_size == 512


def test_train_cli_refuses_an_unwritable_output_before_training(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    import routerd.rl.train as T
    from routerd.cli import main

    monkeypatch.setattr(T, "train", lambda *a, **k: pytest.fail("training started"))
    f = tmp_path / "afile"
    f.write_text("x")
    for out, needle in ((f, "exists and is not a folder"), (f / "sub", "is not a folder")):
        assert main(["train", "--quiet", "--output", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err
    assert main(["train", "--quiet", "--select-samples", "-1"]) == 2
    assert "--select-samples must be >= 0, got -1" in capsys.readouterr().err


def _workload(n: int, seed: int) -> list[Request]:
    import random

    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(40.0)
        out.append(Request(id=i, arrival_s=t, prompt_tokens=rng.randint(5, 400), output_tokens=rng.randint(1, 60)))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_littles_law_return_is_minus_the_summed_e2e_whatever_the_actions(seed):
    # The invariant behind the variant: with no guidance the undiscounted return is exactly
    # -(sum of E2E) / step_s (the integral of the number in system), for any sequence of actions,
    # holds and preemptions included (here: random actions on a small, overloaded pool).
    import random

    from routerd.rl.env import RoutingEnv

    reqs = _workload(60, seed)
    env = RoutingEnv(toy_profile(), 2, lambda s: reqs, RewardConfig("littles-law"))
    env.reset(seed=seed)
    rng = random.Random(seed)
    total, done = 0.0, False
    while not done:
        _, r, done, _, info = env.step(rng.randrange(3))
        total += r
    e2e = [q.finish_s - q.arrival_s for q in env.run.requests]
    assert all(q.finish_s >= q.arrival_s for q in env.run.requests)
    assert total * 0.02 == pytest.approx(-sum(e2e), rel=1e-9, abs=1e-9)


def test_littles_law_has_no_completion_bonus_and_optional_guidance():
    cfg = RewardConfig("littles-law")
    assert cfg.counts_requests and cfg.shaping_weight(0) == 0.0 and cfg.shaping_weight(50) == 0.0
    assert RewardConfig("littles-law", guidance=0.5).shaping_weight(7) == 0.5
    assert not RewardConfig("workload-guided").counts_requests
    # One request alone: reward = -(its E2E) / step_s, nothing for completing it.
    env = _env([Request(id=0, arrival_s=0.0, prompt_tokens=10, output_tokens=3)], "littles-law")
    env.reset(seed=0)
    _, r, done, _, info = env.step(0)
    assert done and info["completed"] == 1
    q = env.run.requests[0]
    assert r == pytest.approx(-(q.finish_s - q.arrival_s) / 0.02)


def test_action_mask_allows_what_fits_and_always_hold():
    # 64 blocks of 16 tokens, 5% reserve: 60 usable. Each request needs at least blocks(560) = 35
    # (its prompt, whatever its predicted output; at most the 60 usable). After the first goes to
    # instance 0 (its prefill takes 0.56 s), instance 0 holds its 35 prompt blocks: 35 > 60 - 35,
    # so only instance 1 (empty: 60 free) and hold remain.
    from routerd.rl.env import RoutingEnv

    reqs = [Request(id=0, arrival_s=0.0, prompt_tokens=560, output_tokens=200),
            Request(id=1, arrival_s=0.001, prompt_tokens=560, output_tokens=200)]
    prof = toy_profile(max_model_len=1024, max_num_batched_tokens=1024)
    env = RoutingEnv(prof, 2, lambda s: reqs, RewardConfig("littles-law"))
    env.reset(seed=0)
    assert env.action_mask().tolist() == [True, True, True]
    env.step(0)
    assert env.action_mask().tolist() == [False, True, True]
