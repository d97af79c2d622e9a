"""The least an ext_proc endpoint picker in Python grpc.aio can do per request: the transport floor.

What ``phasewise epp --mode efficient`` does per request, minus everything Phasewise adds: one
``Process`` stream per request (Envoy's ``FULL_DUPLEX_STREAMED`` request body, response phases
skipped, the shipped configuration's efficient mode), the request headers read, the body
buffered to its end, then one HeadersResponse setting the destination header (round robin over
the ``--backends``, nothing parsed, no policy, no predictor, no bookkeeping) with the same value as
``envoy.lb`` dynamic metadata, and the body echoed back in one BodyResponse (what
``FULL_DUPLEX_STREAMED`` requires). Envoy's access-log stream (the shipped configuration sends
one entry per request to the picker's port) is read and dropped. The garbage collector is tuned
as the real picker's is (``gc.freeze()``, young threshold 20,000).

``benchmarks/epp_overhead.py`` runs it as the ``epp-minimal`` setup beside routerd in the same
run: its CPU per request bounds from below what any picker speaking this protocol through Python
grpc.aio can cost here (issue #16's CPU target: Envoy + picker at most 1.5x routerd's).

Usage: python benchmarks/epp_minimal_picker.py PORT BACKEND_PORT [BACKEND_PORT ...]
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "routerd"))

import grpc  # noqa: E402
from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc  # noqa: E402

from routerd.epp.names import DEST_HEADER, LB_NAMESPACE  # noqa: E402

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


class MinimalPicker(ep_grpc.ExternalProcessorServicer):
    """Round robin over ``destinations`` (``ip:port``), the protocol's minimum per stream."""

    def __init__(self, destinations: list[str]) -> None:
        self.next = itertools.cycle(destinations).__next__

    async def Process(self, request_iterator, context):
        body = bytearray()
        async for msg in request_iterator:
            which = msg.WhichOneof("request")
            if which == "request_headers":
                if not msg.request_headers.end_of_stream:
                    continue
            elif which == "request_body":
                body += msg.request_body.body
                if not msg.request_body.end_of_stream:
                    continue
            else:
                continue
            dest = self.next()
            first = ep_pb2.ProcessingResponse()
            common = first.request_headers.response
            common.clear_route_cache = True
            for k, v in ((DEST_HEADER, dest), ("content-length", str(len(body)))):
                h = common.header_mutation.set_headers.add()
                h.header.key = k
                h.header.raw_value = v.encode()
                h.append_action = _OVERWRITE
            first.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DEST_HEADER].string_value = dest
            yield first
            if body:
                m = ep_pb2.ProcessingResponse()
                sr = m.request_body.response.body_mutation.streamed_response
                sr.body = bytes(body)
                sr.end_of_stream = True
                yield m
            body = bytearray()


class DropLogs(als_pb2_grpc.AccessLogServiceServicer):
    async def StreamAccessLogs(self, request_iterator, context):
        async for _ in request_iterator:
            pass
        return als_pb2.StreamAccessLogsResponse()


async def serve(port: int, backends: list[int]) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    ep_grpc.add_ExternalProcessorServicer_to_server(MinimalPicker([f"127.0.0.1:{p}" for p in backends]), server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(DropLogs(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__.rstrip().splitlines()[-1])
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)
    asyncio.run(serve(int(sys.argv[1]), [int(p) for p in sys.argv[2:]]))


if __name__ == "__main__":
    main()
