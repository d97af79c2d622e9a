"""routerd configuration: YAML + PHASEWISE_* environment + flags, and errors that name where and what."""

from __future__ import annotations

import argparse

import pytest

from routerd.daemon import cli
from routerd.daemon.app import Daemon
from routerd.daemon.config import DEFAULT_MAX_BODY_BYTES, Settings, load_settings
from routerd.errors import ConfigError


def write(tmp_path, text):
    p = tmp_path / "routerd.yaml"
    p.write_text(text)
    return p


def test_defaults_file_environment_and_flags_in_that_order(tmp_path):
    p = write(tmp_path, "http: {port: 8001}\nendpoints:\n  - {name: a, url: 'http://10.0.0.1:8000/'}\n"
                        "policy: {name: late_binding, params: {reserve_fraction: 0.1}}\n")
    s = load_settings(p, environ={})
    assert s.http.port == 8001 and s.http.host == "0.0.0.0"
    assert s.endpoints[0].url == "http://10.0.0.1:8000"  # trailing slash dropped
    assert s.policy.params == {"reserve_fraction": 0.1}
    assert s.router.action_interval_s == 0.02 and s.max_body_bytes == DEFAULT_MAX_BODY_BYTES
    env = {"PHASEWISE_HTTP__PORT": "8002", "PHASEWISE_MODELS": '["llama"]', "PHASEWISE_ROUTER__QUEUE_LIMIT": "5",
           "UNRELATED": "x"}
    s = load_settings(p, environ=env)
    assert (s.http.port, s.models, s.router.queue_limit) == (8002, ["llama"], 5)
    s = load_settings(p, environ=env, overrides={"http": {"port": 8003}}, override_flags={"http": "--port"})
    assert s.http.port == 8003 and s.http.host == "0.0.0.0"


@pytest.mark.parametrize("text, expected", [
    ("endpoints:\n  - {name: a, url: 'http://h:1'}\n  - {name: b, url: 'ftp://h:2'}\n",
     "config {p}: endpoints[1].url: must be an http:// or https:// URL with a host, got 'ftp://h:2'"),
    ("endpoints:\n  - {name: a, url: 'http://h:1'}\n  - {name: a, url: 'http://h:2'}\n",
     "config {p}: endpoints[1].name: duplicate endpoint name 'a' (also endpoints[0])"),
    ("endpoints:\n  - {name: a, url: 'http://h:1', state_address: 'h'}\n",
     "config {p}: endpoints[0].state_address: state_address must be host:port, got 'h'"),
    ("router: {queue_limt: 3}\n", "config {p}: router.queue_limt: Extra inputs are not permitted"),
    ("router: {action_interval_s: 0}\n", "config {p}: router.action_interval_s: Input should be greater than 0"),
    ("kubernetes: {enabled: true}\n",
     "config {p}: kubernetes: service (or selector) is required when kubernetes discovery is enabled"),
    ("http: [1, 2]\n", "config {p}: http: Input should be a valid dictionary or instance of HttpConfig"),
    ("http: {port: 8000\n",
     "config {p}: invalid YAML at line 2, column 1: expected ',' or '}}', but got '<stream end>'"),
    ("- 1\n", "config {p}: the top level must be a mapping of settings, got list"),
])
def test_file_errors_name_the_file_and_the_indexed_field(tmp_path, text, expected):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_settings(p, environ={})
    assert str(e.value) == expected.format(p=p)


def test_environment_and_flag_errors_name_their_source(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_settings(None, environ={"PHASEWISE_ROUTER__QUEUE_LIMIT": "0"})
    assert str(e.value) == ("environment variable PHASEWISE_ROUTER__QUEUE_LIMIT: router.queue_limit: "
                            "Input should be greater than or equal to 1")
    with pytest.raises(ConfigError) as e:
        load_settings(None, environ={"PHASEWISE_ENDPOINTS": "[not json"})
    assert "environment" in str(e.value) and "endpoints" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_settings(None, environ={}, overrides={"http": {"port": 70000}}, override_flags={"http": "--port"})
    assert str(e.value) == "flag --port: http.port: Input should be less than or equal to 65535"
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "missing.yaml", environ={})


def _args(*argv):
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command")
    cli.add_parser(sub)
    return p.parse_args(["serve", *argv])


def test_flags_become_overrides():
    o, flags = cli.overrides_from_args(_args("--port", "0", "--endpoint", "a=http://h:1,h:2", "--endpoint",
                                             "b=http://h:3", "--policy", "late_binding:reserve_fraction=0.2",
                                             "--no-grpc", "--model", "m"))
    assert o == {"http": {"port": 0}, "grpc": {"enabled": False}, "models": ["m"],
                 "endpoints": [{"name": "a", "url": "http://h:1", "state_address": "h:2"},
                               {"name": "b", "url": "http://h:3"}],
                 "policy": {"name": "late_binding", "params": {"reserve_fraction": "0.2"}}}
    assert flags["endpoints"] == "--endpoint" and flags["policy"] == "--policy"
    with pytest.raises(ConfigError, match="flag --endpoint: expected NAME=URL"):
        cli.overrides_from_args(_args("--endpoint", "http://h:1"))
    with pytest.raises(ConfigError, match="flag --policy"):
        cli.overrides_from_args(_args("--policy", "late_binding:oops"))


def test_policy_profile_and_predictor_are_checked_at_start():
    # A policy parameter is checked with the settings, so the error names where it came from.
    with pytest.raises(ConfigError, match=r"^flag --policy: policy\.params\.reserve_fraction: "):
        load_settings(None, environ={}, overrides={"policy": {"name": "late_binding", "params": {"reserve_fraction": 3}}},
                      override_flags={"policy": "--policy"})
    # The profile is checked with the settings too (naming its source), and again by the daemon.
    with pytest.raises(ConfigError, match="^command line: profile: unknown profile 'no-such-profile'"):
        load_settings(None, environ={}, overrides={"profile": "no-such-profile"})
    with pytest.raises(ConfigError, match="^profile: "):
        Daemon(Settings(profile="no-such-profile"))
    with pytest.raises(ConfigError, match="^predictor: unknown predictor 'nope'"):
        Daemon(load_settings(None, environ={}, overrides={"predictor": "nope"}))


def test_another_policy_by_flag_or_environment_drops_the_files_parameters(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("policy: {name: late_binding, params: {reserve_fraction: 0.2}}\n")
    s = load_settings(p, environ={}, overrides={"policy": {"name": "round_robin", "params": {}}},
                      override_flags={"policy": "--policy"})
    assert (s.policy.name, dict(s.policy.params)) == ("round_robin", {})
    s = load_settings(p, environ={"PHASEWISE_POLICY__NAME": "join_shortest_queue"})
    assert (s.policy.name, dict(s.policy.params)) == ("join_shortest_queue", {})
    # The same policy keeps the file's parameters and takes the environment's on top.
    s = load_settings(p, environ={"PHASEWISE_POLICY__PARAMS__MAX_WAITING": "3"})
    assert s.policy.name == "late_binding" and dict(s.policy.params) == {"reserve_fraction": 0.2, "max_waiting": "3"}


# ---------------------------------------------------------------- the length predictor setting

def test_the_shipped_predictor_is_the_default_and_none_turns_it_off(tmp_path):
    from routerd.model import PREDICTOR_BUCKET_EDGES
    from routerd.predictor.assign import DEFAULT_PREDICTOR
    from routerd.predictor.ngram_predictor import NgramPredictor

    assert DEFAULT_PREDICTOR == "default"
    # A file that never mentions the predictor gets the shipped one.
    s = load_settings(write(tmp_path, "http: {port: 8001}\n"), environ={})
    assert s.predictor == "default"
    d = Daemon(s)
    assert isinstance(d.predictor, NgramPredictor) and tuple(d.predictor.edges) == PREDICTOR_BUCKET_EDGES
    assert d.router.bucket_edges == PREDICTOR_BUCKET_EDGES
    assert d._is_blocking(d.predictor) is False  # numpy: predicted on the event loop
    # Off by file, environment variable or flag.
    assert Daemon(load_settings(write(tmp_path, "predictor: none\n"), environ={})).predictor is None
    s = load_settings(None, environ={"PHASEWISE_PREDICTOR": "none"})
    assert s.predictor == "none" and Daemon(s).predictor is None
    o, flags = cli.overrides_from_args(_args("--predictor", "none"))
    assert o == {"predictor": "none"} and flags["predictor"] == "--predictor"
    assert Daemon(load_settings(None, environ={}, overrides=o, override_flags=flags)).predictor is None


def test_only_the_transformer_is_predicted_off_the_event_loop():
    from routerd.predictor import MajorityPredictor
    from routerd.predictor.ngram_predictor import load_shipped

    hf_like = type("HFPredictor", (), {"__module__": "routerd.predictor.hf"})()
    assert Daemon._is_blocking(hf_like) is True
    assert Daemon._is_blocking(load_shipped()) is False
    assert Daemon._is_blocking(MajorityPredictor((250, 1000, 4000))) is False
    assert Daemon._is_blocking(None) is False


@pytest.mark.parametrize("spec, package, extra", [
    ("/models/minilm", "torch", "predictor"),
    ("/models/minilm", "transformers", "predictor"),
    ("length-only", "sklearn", "predictor-train"),
    ("length+task", "sklearn.ensemble", "predictor-train"),
    ("/models/other", "threadpoolctl", "predictor-train"),
])
def test_a_missing_package_names_the_extra_that_provides_it(monkeypatch, spec, package, extra):
    import routerd.predictor
    from routerd.daemon.app import load_length_predictor

    def missing(_spec):
        raise ModuleNotFoundError(f"No module named {package!r}", name=package)

    monkeypatch.setattr(routerd.predictor, "load_predictor", missing)
    with pytest.raises(ConfigError) as e:
        load_length_predictor(spec)
    assert str(e.value) == (f"predictor: {spec!r} needs the Python package {package!r}; "
                            f"install the extra: pip install 'phasewise[{extra}]'")


def test_missing_extras_through_the_real_loaders(monkeypatch, tmp_path):
    """Without torch a transformer folder asks for [predictor]; without scikit-learn the
    length baselines ask for [predictor-train]; the shipped default needs neither."""
    import json
    import sys

    from routerd.daemon.app import load_length_predictor

    folder = tmp_path / "minilm"
    folder.mkdir()
    (folder / "predictor.json").write_text(json.dumps({"kind": "hf", "edges": [250, 1000, 4000], "tasks": [],
                                                       "max_length": 128}))
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "sklearn", None)
    with pytest.raises(ConfigError, match=r"^predictor: .*torch.*pip install 'phasewise\[predictor\]'"):
        load_length_predictor(str(folder))
    with pytest.raises(ConfigError, match=r"^predictor: .*scikit-learn.*pip install 'phasewise\[predictor-train\]'"):
        load_length_predictor("length-only")
    assert load_length_predictor("default") is not None


def test_one_run_names_field_errors_and_the_profile_checks_together(tmp_path):
    # Three field mistakes and a profile that does not load: all four in one error, each with the
    # file. A prefix.block_size other than the profile's is no error (the engines' own size, learnt
    # from their KV events, is what their blocks are keyed in).
    p = tmp_path / "r.yaml"
    p.write_text("endpoints: [{name: a, url: 'http://127.0.0.1:8100', extra: 1}]\n"
                 "policy: {name: late_binding, params: {reserve_fraction: 2}}\n"
                 "profile: h100-dream\nprefix: {block_size: 32}\nstatee: {}\n")
    with pytest.raises(ConfigError) as e:
        load_settings(p, environ={})
    lines = str(e.value).splitlines()
    assert lines[0] == "4 configuration errors:"
    assert [ln.strip().split(": ")[1] for ln in lines[1:]] == [
        "endpoints[0].extra", "policy.params.reserve_fraction", "statee", "profile"]
    assert all(ln.strip().startswith(f"config {p}: ") for ln in lines[1:])
    assert "unknown profile 'h100-dream'" in lines[4]
    p.write_text("profile: llama2-7b-a100\nprefix: {block_size: 128}\n")
    assert load_settings(p, environ={}).prefix.block_size == 128
    p.write_text("profile: nope\nprefix: {block_size: 'x'}\n")
    with pytest.raises(ConfigError) as e:
        load_settings(p, environ={})
    assert "prefix.block_size: Input should be a valid integer" in str(e.value)
    assert f"config {p}: profile: unknown profile 'nope'" in str(e.value)


def test_endpoint_profiles_must_serve_the_model_with_its_block_size(tmp_path):
    # endpoints[].profile: a known profile of the same model (llama3.1-8b: the A100's beside
    # routerd's H100) passes; an unknown one, or one of another model, is named by its entry.
    p = tmp_path / "r.yaml"
    p.write_text("profile: llama3.1-8b-h100\nendpoints:\n"
                 "  - {name: a, url: 'http://127.0.0.1:8100', profile: llama3.1-8b-a100}\n"
                 "  - {name: b, url: 'http://127.0.0.1:8101'}\n")
    s = load_settings(p, environ={})
    assert [e.profile for e in s.endpoints] == ["llama3.1-8b-a100", None]
    p.write_text("profile: llama3.1-8b-h100\nendpoints:\n"
                 "  - {name: a, url: 'http://127.0.0.1:8100', profile: llama2-7b-a100}\n"
                 "  - {name: b, url: 'http://127.0.0.1:8101', profile: nope}\n")
    with pytest.raises(ConfigError) as e:
        load_settings(p, environ={})
    lines = str(e.value).splitlines()
    assert lines[0] == "2 configuration errors:"
    assert lines[1].strip().startswith(f"config {p}: endpoints[0].profile: pool mixes profiles of different models")
    assert lines[2].strip().startswith(f"config {p}: endpoints[1].profile: unknown profile 'nope'")


def test_kubernetes_profiles_by_slice_label_are_checked_as_endpoint_profiles(tmp_path):
    # kubernetes.profiles (one per engine group's Service label): same rules as endpoints[].profile,
    # named by the key; a mapping without the label that keys it is refused.
    p = tmp_path / "r.yaml"
    base = ("profile: llama3.1-8b-h100\nkubernetes:\n  enabled: true\n"
            "  selector: 'phasewise.io/pool=chat,phasewise.io/engine-group'\n")
    p.write_text(base + "  profile_label: phasewise.io/engine-group\n"
                 "  profiles: {a100: llama3.1-8b-a100, h100: llama3.1-8b-h100}\n")
    s = load_settings(p, environ={})
    assert s.kubernetes.service is None and s.kubernetes.profiles == {"a100": "llama3.1-8b-a100",
                                                                      "h100": "llama3.1-8b-h100"}
    p.write_text(base + "  profile_label: phasewise.io/engine-group\n"
                 "  profiles: {v100: llama2-7b-v100, x: nope}\n")
    with pytest.raises(ConfigError) as e:
        load_settings(p, environ={})
    lines = str(e.value).splitlines()
    assert lines[0] == "2 configuration errors:"
    assert lines[1].strip().startswith(f"config {p}: kubernetes.profiles.v100: pool mixes profiles of different models")
    assert lines[2].strip().startswith(f"config {p}: kubernetes.profiles.x: unknown profile 'nope'")
    p.write_text(base + "  profiles: {a100: llama3.1-8b-a100}\n")
    with pytest.raises(ConfigError, match="profiles needs profile_label"):
        load_settings(p, environ={})
    p.write_text("kubernetes: {enabled: true}\n")
    with pytest.raises(ConfigError, match=r"service \(or selector\) is required"):
        load_settings(p, environ={})
