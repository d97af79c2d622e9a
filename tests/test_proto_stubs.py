"""The committed gRPC stubs match proto/ and load as the phasewise.v1 package."""

from routerd.api import codegen
from routerd.api.v1 import instance_state_pb2, router_pb2


def test_committed_stubs_match_proto_files():
    assert codegen.stale_files() == []


def test_stub_detects_drift(tmp_path):
    codegen.write(tmp_path)
    (tmp_path / "router_pb2.py").write_text("# edited\n")
    assert codegen.stale_files(tmp_path) == ["router_pb2.py"]


def test_messages_carry_the_proto_package_and_round_trip():
    assert router_pb2.DESCRIPTOR.package == "phasewise.v1"
    state = instance_state_pb2.InstanceState(instance="vllm-0", num_requests_running=3, kv_cache_usage=0.25)
    ep = router_pb2.EndpointState(instance="vllm-0", in_flight=2, instance_state=state)
    back = router_pb2.EndpointState.FromString(ep.SerializeToString())
    assert back.instance_state.kv_cache_usage == 0.25 and back.in_flight == 2
    services = {s.full_name for s in router_pb2.DESCRIPTOR.services_by_name.values()}
    assert services == {"phasewise.v1.RouterService"}
