"""``phasewise epp``: its flags and ``epp:`` settings, ``--print-envoy-config``, the Envoy config
builder's errors, and the picker as a process (separate health port, metrics, SIGTERM)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from routerd.cli import main
from routerd.daemon.config import load_settings
from routerd.epp.envoy_config import build_envoy_config
from stack_processes import REPO, StackProcess, _base_env, free_ports, http_get, marked_processes


def test_print_envoy_config_is_the_builders(capsys, tmp_path):
    cfg = tmp_path / "routerd.yaml"
    cfg.write_text("epp: {port: 9100, mode: efficient}\nmodels: [m]\n")
    assert main(["epp", "--config", str(cfg), "--print-envoy-config", "--envoy-listen-port", "8090",
                 "--admin-port", "0"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == build_envoy_config(listen_port=8090, picker_address="127.0.0.1:9100", mode="efficient",
                                         admin_port=None)
    hcm = printed["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == ["envoy.filters.http.header_mutation", "envoy.filters.http.ext_proc", "envoy.filters.http.lua",
                     "envoy.filters.http.router"]
    ext = hcm["http_filters"][1]["typed_config"]
    assert ext["processing_mode"]["response_body_mode"] == "NONE" and not ext["failure_mode_allow"]
    assert hcm["access_log"][0]["typed_config"]["additional_request_headers_to_log"] == ["x-phasewise-request-id"]
    clusters = {c["name"]: c for c in printed["static_resources"]["clusters"]}
    od = clusters["phasewise_original_destination"]
    assert od["type"] == "ORIGINAL_DST" and od["original_dst_lb_config"] == {
        "use_http_header": True, "http_header_name": "x-gateway-destination-endpoint"}
    assert od["circuit_breakers"]["thresholds"][0]["max_requests"] == 100_000
    assert clusters["phasewise_picker"]["circuit_breakers"]["thresholds"][0]["max_requests"] == 100_000
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["timeout"] == "0s"  # Envoy's default 15 s would cut LLM streams


def test_full_duplex_and_fail_open_config():
    c = build_envoy_config(mode="full-duplex", failure_mode="FailOpen", fail_open_endpoints=["10.0.0.1:8000"])
    hcm = c["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext = hcm["http_filters"][1]["typed_config"]
    assert ext["failure_mode_allow"] and ext["processing_mode"]["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert "access_log" not in hcm
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert routes[1]["route"]["cluster"] == "phasewise_fail_open"


@pytest.mark.parametrize("kwargs,message", [
    ({"failure_mode": "FailOpen"}, "fail_open_endpoints"),
    ({"picker_address": "nohost"}, "HOST:PORT"),
    ({"mode": "fast"}, "mode must be"),
    ({"failure_mode": "Maybe"}, "failure_mode must be"),
])
def test_builder_errors_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_envoy_config(**kwargs)


def test_epp_settings_errors_and_flags(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("epp: {port: 70000, mode: turbo}\n")
    assert main(["epp", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "epp.port" in err and "epp.mode" in err and "Traceback" not in err
    from routerd.epp.cli import overrides_from_args
    from routerd.cli import build_parser

    args = build_parser().parse_args(["epp", "--port", "9500", "--health-port", "0", "--metrics-port", "9600",
                                      "--mode", "efficient", "--endpoint", "a=http://10.0.0.1:8000",
                                      "--policy", "late_binding"])
    o, flags = overrides_from_args(args)
    s = load_settings(None, overrides=o, override_flags=flags)
    assert (s.epp.port, s.epp.health_port, s.epp.metrics_port, s.epp.mode) == (9500, 0, 9600, "efficient")
    assert s.endpoints[0].url == "http://10.0.0.1:8000" and s.policy.name == "late_binding"


def test_picker_process_health_metrics_and_sigterm(tmp_path):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    import grpc

    stack_id = uuid.uuid4().hex
    port, hport, mport = free_ports(3)
    p = StackProcess("picker", ["epp", "--host", "127.0.0.1", "--port", str(port), "--health-port", str(hport),
                                "--metrics-port", str(mport), "--model", "m", "--predictor", "none",
                                "--endpoint", "a=http://127.0.0.1:9"], tmp_path, _base_env(stack_id))
    try:
        import re

        p.wait_for(re.compile(r"endpoint picker \(full-duplex mode\) listening"), 60)
        with grpc.insecure_channel(f"127.0.0.1:{hport}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for name in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                deadline = time.monotonic() + 10
                while stub.Check(health_pb2.HealthCheckRequest(service=name)).status != \
                        health_pb2.HealthCheckResponse.SERVING:
                    assert time.monotonic() < deadline, name
                    time.sleep(0.05)
        status, body = http_get(f"http://127.0.0.1:{mport}/metrics")
        assert status == 200 and b"phasewise_epp_streams_total" in body and b"phasewise_in_flight_requests" in body
        assert http_get(f"http://127.0.0.1:{mport}/readyz")[0] == 200
        p.signal(signal.SIGTERM)
        assert p.wait(15) == 0
    finally:
        p.signal(signal.SIGKILL)
        p.wait(5)
    assert marked_processes(stack_id) == []
    assert "Traceback" not in p.log_text()


def test_epp_without_a_port_it_can_bind_is_one_line(tmp_path):
    with socket_taken() as port:
        r = subprocess.run([sys.executable, "-m", "routerd", "epp", "--host", "127.0.0.1", "--port", str(port),
                            "--health-port", "0", "--metrics-port", str(port), "--model", "m", "--predictor", "none"],
                           capture_output=True, text=True, timeout=60, cwd=str(REPO),
                           env=_base_env(uuid.uuid4().hex))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"phasewise: error: epp.port: cannot listen on 127.0.0.1:{port}" in r.stderr


class socket_taken:
    """A TCP port on 127.0.0.1 held by a listening socket for the block."""

    def __enter__(self) -> int:
        import socket

        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        self.s.listen()
        return self.s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.s.close()


@pytest.mark.parametrize("argv,flag", [
    (["--envoy-listen-port", "70000"], "--envoy-listen-port"),
    (["--envoy-listen-port", "-5"], "--envoy-listen-port"),
    (["--admin-port", "70000"], "--admin-port"),
    (["--failure-mode", "FailOpen", "--fail-open-endpoint", "localhost:8100"], "--fail-open-endpoint"),
    (["--fail-open-endpoint", "127.0.0.1:8100"], "--fail-open-endpoint"),
    (["--envoy-listen-port", "9901"], "--envoy-listen-port"),
    (["--envoy-listen-port", "9002"], "--envoy-listen-port"),
    (["--envoy-listen-port", "9003"], "--envoy-listen-port"),
    (["--envoy-listen-port", "9090"], "--envoy-listen-port"),
    (["--envoy-listen-address", "localhost"], "--envoy-listen-address"),
])
def test_print_envoy_config_refuses_bad_flags_naming_them(argv, flag, capsys):
    assert main(["epp", "--print-envoy-config", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err and "Traceback" not in err, err


@pytest.mark.parametrize("kwargs,message", [
    ({"listen_port": 70000}, "listen_port"),
    ({"admin_port": 0}, "admin_port"),
    ({"listen_port": 9901}, "admin_port"),
    ({"fail_open_endpoints": ["10.0.0.1:80"]}, "fail_open_endpoints"),
    ({"failure_mode": "FailOpen", "fail_open_endpoints": ["localhost:80"]}, "fail_open_endpoints"),
    ({"listen_port": 9002, "picker_ports": {"epp.port": 9002}}, "epp.port"),
])
def test_builder_refuses_bad_ports_and_endpoints(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_envoy_config(**kwargs)


def test_envoy_listen_address_follows_a_concrete_epp_host(capsys):
    assert main(["epp", "--host", "127.0.0.1", "--print-envoy-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["address"] == "127.0.0.1"
    assert "layered_runtime" not in cfg
    mon = cfg["overload_manager"]["resource_monitors"][0]
    assert mon["typed_config"]["max_active_downstream_connections"] == 100_000
    assert main(["epp", "--print-envoy-config", "--envoy-listen-address", "127.0.0.2"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["address"] == "127.0.0.2"
    assert main(["epp", "--host", "0.0.0.0", "--print-envoy-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["address"] == "0.0.0.0"
