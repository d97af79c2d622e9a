"""``phasewise profile`` against a real emulator on loopback, and its fits on known data."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest
import yaml
from aiohttp import web
from conftest import toy_profile

from routerd.emulator.process import EmulatorProcess
from routerd.profiler.__main__ import main as profile_main
from routerd.profiler.fit import fit_decode, fit_prefill
from routerd.profiler.measure import DecodePoint, PrefillPoint, quantile_fit
from routerd.profiles import load_profile_file

# Terms large enough to stand out of scheduling noise on a loaded 2-core machine, and
# iterations short enough that the quick plan runs in about ten seconds.
TARGET = dict(name="profiler-target", overhead_s=0.005, prefill_per_token_s=5e-5, prefill_attn_s=1e-8,
              decode_per_seq_s=2e-4, decode_per_ctx_token_s=5e-7, kv_capacity_tokens=65536, block_size=16,
              max_num_seqs=128, max_num_batched_tokens=1024, chunked_prefill=True, max_model_len=2048)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    path = folder / "target.yaml"
    path.write_text(yaml.safe_dump(toy_profile(**TARGET).model_dump(mode="json")))
    with EmulatorProcess("--port", "0", "--profile", str(path), "--model", "m1") as emu:
        yield emu


def test_profile_recovers_the_emulators_profile(target, tmp_path, capsys):
    out = tmp_path / "fitted.yaml"
    code = profile_main(["--endpoint", target.url, "--output", str(out), "--quick", "--max-batch-tokens", "1000",
                         "--base-profile", "llama2-7b-a100", "--name", "fitted"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    fitted = load_profile_file(out)
    true = toy_profile(**TARGET)

    ratios = {f: getattr(fitted, f) / getattr(true, f) for f in (
        "prefill_per_token_s", "decode_per_seq_s", "overhead_s", "decode_per_ctx_token_s", "prefill_attn_s")}
    print(ratios)
    # The fit reads client-side wall-clock timings, which scheduling on a loaded machine
    # skews: only a sanity band here, each term within a factor of 2 (a wrong unit, a
    # swapped term or a failed fit is far outside it). The accuracy target (grad1 and
    # grad2 within 10 %) is measured and printed by benchmarks/profiler_accuracy.py (issue 19).
    assert all(0.5 <= r <= 2.0 for r in ratios.values()), ratios
    assert fitted.grad1 == fitted.prefill_per_token_s
    # Read from the endpoint: /v1/models and vllm:cache_config_info.
    assert (fitted.max_model_len, fitted.kv_capacity_tokens, fitted.block_size) == (2048, 65536, 16)
    # Not observable: from the base profile.
    a100 = load_profile_file("routerd/routerd/data/profiles/llama2-7b-a100.yaml")
    assert (fitted.max_num_seqs, fitted.max_num_batched_tokens, fitted.grad2) == \
        (a100.max_num_seqs, a100.max_num_batched_tokens, a100.grad2)
    assert fitted.decode_token_time_s == pytest.approx(
        fitted.overhead_s + 32 * fitted.decode_per_seq_s + 32 * 1024 * fitted.decode_per_ctx_token_s)
    text = out.read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert any(line.startswith("# Plan: {") for line in header)
    assert sum("residual" in line for line in header) >= 2
    # One row per decode batch (3 sizes x 2 prompts) and per prefill batch (6), with residuals.
    rows = [line for line in header if line.startswith("#   ") and line[4].isdigit()]
    assert len(rows) == 6 + 6
    assert f"wrote {out}" in printed


@pytest.mark.parametrize("make_endpoint,needle", [
    ("refused", "cannot reach it (connection refused)"),
    ("not_openai", "did not return JSON"),
    ("missing", "HTTP 404"),
])
def test_bad_endpoints_exit_2_with_one_line(make_endpoint, needle, tmp_path, capsys):
    async def serve_and_profile() -> int:
        async def not_openai(_request: web.Request) -> web.Response:
            return web.Response(text="<html>hello</html>")

        app = web.Application()
        app.router.add_get("/v1/models", not_openai)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            if make_endpoint == "refused":
                with socket.socket() as s:  # a port nobody listens on
                    s.bind(("127.0.0.1", 0))
                    url = f"http://127.0.0.1:{s.getsockname()[1]}"
            elif make_endpoint == "not_openai":
                url = f"http://127.0.0.1:{port}"
            else:
                url = f"http://127.0.0.1:{port}/somewhere"
            return await asyncio.to_thread(profile_main, ["--endpoint", url, "--output", str(tmp_path / "p.yaml")])
        finally:
            await runner.cleanup()

    assert asyncio.run(serve_and_profile()) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("phasewise: error: --endpoint") and needle in err[0]
    assert not (tmp_path / "p.yaml").exists()


def test_unknown_model_and_bad_flags_exit_2(target, tmp_path, capsys):
    assert profile_main(["--endpoint", target.url, "--model", "nope", "--output", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err
    assert "--model 'nope'" in err and "m1" in err
    assert profile_main(["--endpoint", "ftp://x", "--output", str(tmp_path / "p.yaml")]) == 2
    assert "--endpoint" in capsys.readouterr().err
    assert profile_main(["--endpoint", target.url, "--output", str(tmp_path / "p.yaml"),
                         "--max-batch-tokens", "10"]) == 2
    assert "--max-batch-tokens" in capsys.readouterr().err


# ---------------------------------------------------------------- fits on synthetic points

def test_fits_recover_exact_coefficients_and_drop_an_outlier():
    prof = toy_profile(**TARGET)
    dec = [DecodePoint(b, b * (p + 30.0), prof.decode_time(b, int(b * (p + 30))), p, 40)
           for b in (1, 8, 32, 64) for p in (32, 400)]
    fit = fit_decode(dec)
    assert fit.value("overhead_s") == pytest.approx(prof.overhead_s, rel=1e-6)
    assert fit.value("decode_per_seq_s") == pytest.approx(prof.decode_per_seq_s, rel=1e-6)
    assert fit.value("decode_per_ctx_token_s") == pytest.approx(prof.decode_per_ctx_token_s, rel=1e-6)
    assert fit.rms_s < 1e-12 and fit.dropped == []

    pre = [PrefillPoint(n, n * L, float(n * L * L),
                        prof.prefill_per_token_s * n * L + prof.prefill_attn_s * n * L * L, 0.005, 2)
           for n, L in ((1, 1000), (2, 500), (8, 125), (1, 500), (4, 125), (1, 250), (2, 250))]
    pre[3].excess_s += 0.02  # a batch spoilt by a burst of client delay
    fit = fit_prefill(pre)
    assert fit.dropped == [3]
    assert fit.value("prefill_per_token_s") == pytest.approx(prof.prefill_per_token_s, rel=1e-6)
    assert fit.value("prefill_attn_s") == pytest.approx(prof.prefill_attn_s, rel=1e-6)
    assert fit.residuals[3] == pytest.approx(0.02, rel=1e-6)


def test_quantile_fit_follows_the_prompt_arrivals():
    # Tick times of a 10 ms iteration, late by small noise and sometimes by 20-40 ms bursts.
    rng = np.random.default_rng(3)
    i = np.arange(200, dtype=float)
    late = rng.exponential(0.0003, size=200)
    late[rng.choice(200, size=30, replace=False)] += rng.uniform(0.02, 0.04, size=30)
    t = 1.0 + 0.01 * i + late
    X = np.column_stack([np.ones_like(i), i - i.mean()])
    slope = quantile_fit(X, t)[1]
    ols = np.linalg.lstsq(X, t, rcond=None)[0][1]
    assert slope == pytest.approx(0.01, rel=0.002)
    assert abs(slope - 0.01) < abs(ols - 0.01)


@pytest.mark.parametrize("argv,needle", [
    (["profile", "--endpoint", "http://127.0.0.1:9", "--output", "unused.yaml"], "--endpoint"),
    (["emulate", "--profile", "no-such-profile"], "--profile"),
])
def test_phasewise_entry_point_exits_2(argv, needle, capsys, tmp_path, monkeypatch):
    from routerd.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
    assert not (tmp_path / "unused.yaml").exists()
