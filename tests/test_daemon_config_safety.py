"""routerd config safety (issue 15): empty files refused, endpoint URLs checked, oracle policies
refused, every error of a file in one run, and a reload that never applies a half-written file."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest

from routerd.daemon.app import Daemon, file_signature
from routerd.daemon.config import load_settings, servable_policies
from routerd.errors import ConfigError
from routerd.policies.registry import POLICIES


def write(tmp_path, text, name="routerd.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("text, what", [("", "is empty"), ("  \n\n", "is empty"),
                                        ("# all commented out\n# endpoints: []\n", "holds no settings (only comments or null)")])
def test_an_empty_file_is_refused_not_taken_as_all_defaults(tmp_path, text, what):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_settings(p, environ={})
    assert str(e.value).startswith(f"config {p}: the file {what}; refused")
    assert load_settings(write(tmp_path, "{}\n", "ok.yaml"), environ={}).endpoints == []  # `{}` is explicit


@pytest.mark.parametrize("url, message", [
    ("http://10.0.0.1:0", "port 0 cannot be dialled"),
    ("http://my host:8000", "must not contain white space"),
    ("http://10.0.0.1 :8000", "must not contain white space"),
    ("http://user:secret@10.0.0.1:8000", "must not carry credentials"),
    ("http://10.0.0.1:8000/v1", "must not have a path (routerd adds /v1/... itself)"),
    ("http://10.0.0.1:8000/api/", "must not have a path: give the server only"),
    ("http://10.0.0.1:70000", "has an invalid port"),
])
def test_bad_endpoint_urls_are_refused_naming_the_field(tmp_path, url, message):
    p = write(tmp_path, f"endpoints:\n  - {{name: a, url: 'http://10.0.0.2:8000'}}\n  - {{name: b, url: '{url}'}}\n")
    with pytest.raises(ConfigError) as e:
        load_settings(p, environ={})
    assert str(e.value).startswith(f"config {p}: endpoints[1].url: {message}"), str(e.value)
    assert "secret" not in str(e.value)  # credentials are not echoed into logs


@pytest.mark.parametrize("url, kept", [("http://10.0.0.1:8000/", "http://10.0.0.1:8000"),
                                       ("  https://vllm.example:443  ", "https://vllm.example:443"),
                                       ("http://[::1]:8000", "http://[::1]:8000"), ("http://vllm", "http://vllm")])
def test_good_endpoint_urls_are_kept(tmp_path, url, kept):
    p = write(tmp_path, f"endpoints:\n  - {{name: a, url: '{url}'}}\n")
    assert load_settings(p, environ={}).endpoints[0].url == kept


def test_oracle_policies_are_refused_and_only_servable_ones_are_offered(tmp_path):
    oracles = sorted(n for n, c in POLICIES.items() if c.oracle)
    assert oracles == ["decode_balancer", "oracle"]  # the registry's two true-length policies
    assert set(servable_policies()) == set(POLICIES) - set(oracles)
    for name in oracles:
        with pytest.raises(ConfigError) as e:
            load_settings(write(tmp_path, f"policy: {{name: {name}}}\n"), environ={})
        msg = str(e.value)
        assert "policy.name: reads true output lengths" in msg and "servable: round_robin" in msg
        assert not any(f" {o}," in msg or msg.endswith(f" {o}") for o in oracles)
    with pytest.raises(ConfigError, match=r"policy\.name: unknown policy 'nope'; servable: round_robin"):
        load_settings(None, environ={"PHASEWISE_POLICY__NAME": "nope"})


def test_every_error_of_a_file_is_reported_in_one_run_with_the_file_and_field(tmp_path):
    p = write(tmp_path, "endpoints:\n  - {name: a, url: 'http://h:0'}\n  - {name: b, url: 'http://h:1/v1'}\n"
                        "policy: {name: late_binding, params: {reserve_fraction: 3}}\nrouter: {queue_limit: 0}\n")
    with pytest.raises(ConfigError) as e:
        load_settings(p, environ={})
    lines = str(e.value).splitlines()
    assert lines[0] == "4 configuration errors:"
    fields = [line.strip().split(": ")[1] for line in lines[1:]]
    assert fields == ["endpoints[0].url", "endpoints[1].url", "policy.params.reserve_fraction", "router.queue_limit"]
    assert all(line.strip().startswith(f"config {p}: ") for line in lines[1:])


def _daemon_with(path) -> Daemon:
    d = Daemon(load_settings(path, environ={}), config_path=path)
    return d


def test_a_reload_of_an_empty_or_broken_file_keeps_the_running_configuration(tmp_path, caplog):
    p = write(tmp_path, "endpoints:\n  - {name: a, url: 'http://10.0.0.1:8000'}\n")

    async def main():
        d = _daemon_with(p)
        before = [e.name for e in d.router.endpoints]
        for text in ("", "endpoints: [\n", "endpoints:\n  - {name: a, url: 'http://h:0'}\n"):
            p.write_text(text)
            with caplog.at_level(logging.ERROR, logger="routerd.daemon.app"):
                assert await d.reload() is False
            assert [e.name for e in d.router.endpoints] == before
        assert "reload refused, keeping the running configuration: config" in caplog.text
        p.write_text("endpoints:\n  - {name: b, url: 'http://10.0.0.2:8000'}\n")
        assert await d.reload() is True
        assert [e.name for e in d.router.endpoints] == ["b"]

    asyncio.run(main())


def test_the_watcher_applies_a_file_only_once_it_has_stopped_changing(tmp_path):
    """A writer that truncates, then writes in pieces slower than the poll interval: the watcher
    applies only the complete file, never a prefix of it (each prefix here is valid YAML with
    fewer endpoints, which a half-way read would apply)."""
    p = write(tmp_path, "reload: {poll_interval_s: 0.05, settle_s: 1.0}\nendpoints:\n"
                        "  - {name: a, url: 'http://10.0.0.1:8000'}\n")
    full = ("reload: {poll_interval_s: 0.05, settle_s: 1.0}\nendpoints:\n"
            + "".join(f"  - {{name: n{i}, url: 'http://10.0.1.{i}:8000'}}\n" for i in range(4)))
    pieces = full.splitlines(keepends=True)

    async def main():
        d = _daemon_with(p)
        d._config_sig = file_signature(p)
        applied: list[list[str]] = []
        real_reload = d.reload

        async def recording_reload(*a, **kw):
            ok = await real_reload(*a, **kw)
            if ok:
                applied.append([e.name for e in d.router.endpoints])
            return ok

        d.reload = recording_reload
        watcher = asyncio.create_task(d._watch_config())
        try:
            with open(p, "w") as f:  # truncate, then write line by line, 0.1 s apart (well under settle_s)
                for piece in pieces:
                    f.write(piece)
                    f.flush()
                    os.fsync(f.fileno())
                    await asyncio.sleep(0.1)
            for _ in range(200):  # the settled file is applied within a bounded wait
                if applied:
                    break
                await asyncio.sleep(0.05)
        finally:
            watcher.cancel()
        assert applied == [["n0", "n1", "n2", "n3"]], applied

    asyncio.run(main())
