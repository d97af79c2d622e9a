"""routerd's upstream HTTP/1.1 client against hostile or broken instances (regressions of adversarial tests).

Each case is a scripted loopback server sending bytes an instance should never send; the
client must fail the exchange cleanly (``UpstreamBroken``/``UpstreamTimeout``), never
relay a piece that would corrupt the client's stream, never hang, and never pool a
connection whose framing it cannot trust.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from test_daemon_upstream import SSE_HEAD, Scripted
from routerd.daemon.state import url_target
from routerd.daemon.upstream import MAX_HEAD_BYTES, UpstreamBroken, UpstreamPool, UpstreamTimeout, _Conn


def run(coro):
    return asyncio.run(coro)


async def _exchange(reply: bytes, piece=None, **pool_kw):
    """(status, relayed pieces, open connections after release) or the UpstreamError raised."""
    async with Scripted([reply], piece=piece, linger=True) as srv:
        pool = UpstreamPool(read_timeout_s=pool_kw.pop("read_timeout_s", 2.0), **pool_kw)
        try:
            ex = await pool.request(srv.target, "/x", [], b"")
            got: list[bytes] = []
            await ex.relay(got.append)
            ex.release()
            await asyncio.sleep(0.01)
            return ex.status, got, pool.open_connections
        except (UpstreamBroken, UpstreamTimeout) as e:
            return e
        finally:
            await pool.close()


@pytest.mark.parametrize("piece", [None, 1])
def test_a_negative_chunk_size_is_malformed_not_an_empty_piece(piece):
    # int("-2", 16) parses; an empty piece written to the client as a chunk ends its response.
    reply = SSE_HEAD + b"-2\r\n5\r\nhello\r\n0\r\n\r\n"
    got = run(_exchange(reply, piece))
    assert isinstance(got, UpstreamBroken) and "chunk size" in str(got)


@pytest.mark.parametrize("with_crlf", [True, False])
def test_endless_trailers_are_refused_not_buffered(with_crlf):
    line = b"X-T: " + b"a" * 1000 + (b"\r\n" if with_crlf else b"")
    reply = SSE_HEAD + b"5\r\nhello\r\n0\r\n" + line * (2 * MAX_HEAD_BYTES // len(line)) + b"\r\n"
    got = run(_exchange(reply, piece=4096))
    assert isinstance(got, UpstreamBroken) and "trailers too large" in str(got)


def test_304_and_204_have_no_body_whatever_their_content_length_says():
    async def main():
        replies = [b"HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\n\r\n",
                   b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n",
                   b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]
        async with Scripted(replies) as srv:
            pool = UpstreamPool(read_timeout_s=1.0)
            for want in (304, 204, 200):
                ex = await pool.request(srv.target, "/x", [], b"")
                assert ex.status == want
                assert await ex.read() == (b"ok" if want == 200 else b"")
                ex.release()
            assert srv.connections == 1  # no hang waiting for a body, and the connection stayed usable
            await pool.close()
    run(main())


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 5\r\n\r\nhello",
    b"HTTP/1.1 000 Zero\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX-A: a\nInjected: b\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX-A: \x00\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX A(): v\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n: v\r\nContent-Length: 0\r\n\r\n",
])
def test_malformed_heads_fail_the_exchange(head):
    got = run(_exchange(head))
    assert isinstance(got, UpstreamBroken) and not got.before_first_byte, got


def test_both_framings_decode_as_chunked_and_the_connection_is_not_pooled():
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    status, got, still_open = run(_exchange(reply))
    assert status == 200 and b"".join(got) == b"hello" and still_open == 0


def test_bytes_after_a_bodiless_response_are_not_trusted():
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\nHTTP/1.1 200 OK\r\n"
    status, got, still_open = run(_exchange(reply))
    assert status == 200 and got == [] and still_open == 0


def test_utf8_header_values_are_decoded_as_utf8():
    async def main():
        reply = "HTTP/1.1 200 OK\r\nX-Name: café\r\nContent-Length: 0\r\n\r\n".encode()
        async with Scripted([reply]) as srv:
            pool = UpstreamPool()
            ex = await pool.request(srv.target, "/x", [], b"")
            assert ex.header("x-name") == "café"
            ex.release()
            await pool.close()
    run(main())


def test_request_header_values_outside_latin1_are_sent_byte_for_byte():
    async def main():
        reply = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
        async with Scripted([reply, reply]) as srv:
            pool = UpstreamPool()
            # What aiohttp's server makes of the header bytes: UTF-8, undecodable bytes escaped.
            for value in ("日本", b"\xff\xfe".decode("utf-8", "surrogateescape")):
                ex = await pool.request(srv.target, "/x", [("X-Foo", value)], b"")
                await ex.read()
                ex.release()
            assert b"X-Foo: \xe6\x97\xa5\xe6\x9c\xac\r\n" in srv.requests[0]
            assert b"X-Foo: \xff\xfe\r\n" in srv.requests[1]
            await pool.close()
    run(main())


def test_a_reset_during_a_read_until_close_body_is_an_error_not_the_end():
    async def serve(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{\"partial")
        await writer.drain()
        await asyncio.sleep(0.05)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST

    async def main():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        target = url_target(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        pool = UpstreamPool(read_timeout_s=2.0)
        ex = await pool.request(target, "/x", [], b"")
        with pytest.raises(UpstreamBroken):
            await ex.read()
        ex.release()
        await pool.close()
        server.close()
        await server.wait_closed()
    run(main())


def test_response_timeout_bounds_the_wait_for_the_head_even_while_bytes_trickle():
    async def main():
        finished = asyncio.Event()

        async def serve(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            try:
                while not writer.is_closing() and not reader.at_eof():
                    # Interim responses keep the idle timer fresh; the head never comes.
                    writer.write(b"HTTP/1.1 102 Processing\r\n\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.05)
            except ConnectionError:
                pass
            writer.close()
            finished.set()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        target = url_target(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        pool = UpstreamPool(read_timeout_s=5.0, response_timeout_s=0.3)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamTimeout, match="head"):
            await pool.request(target, "/x", [], b"")
        assert asyncio.get_running_loop().time() - t0 < 1.5
        await pool.close()
        await asyncio.wait_for(finished.wait(), 10.0)
        server.close()
        await server.wait_closed()
    run(main())


def test_a_waiter_woken_then_cancelled_passes_the_free_slot_on():
    async def main():
        reply = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
        async with Scripted([reply]) as srv:
            pool = UpstreamPool(limit=1)
            key = srv.target[:3]
            busy = _Conn(pool, key)
            pool._open.add(busy)  # the one allowed connection, in use
            a = asyncio.create_task(pool._connect(key))
            b = asyncio.create_task(pool._connect(key))
            await asyncio.sleep(0.01)
            pool._forget(busy)  # frees the slot: wakes a
            a.cancel()  # ...which is cancelled before it runs
            conn = await asyncio.wait_for(b, 10.0)  # b must get the slot, not wait forever
            assert a.cancelled() and conn is not None
            await pool.close()
    run(main())
