"""routerd's upstream HTTP/1.1 client against scripted loopback servers: framing, pooling, failures."""

from __future__ import annotations

import asyncio

import pytest

from routerd.daemon.state import url_target
from routerd.daemon.upstream import ConnectError, UpstreamBroken, UpstreamPool, UpstreamTimeout


class Scripted:
    """A TCP server answering each request with the next scripted reply, sent in ``pieces``-byte writes."""

    def __init__(self, replies, piece=None, delay=0.0, linger=False):
        self.linger = linger
        self.replies = list(replies)
        self.piece = piece
        self.delay = delay
        self.requests: list[bytes] = []
        self.connections = 0
        self.writers: set = set()

    async def _serve(self, reader, writer):
        self.connections += 1
        self.writers.add(writer)
        try:
            while self.replies:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                reply = self.replies.pop(0)
                if reply is None:  # close without answering
                    break
                step = self.piece or len(reply)
                for i in range(0, len(reply), step):
                    writer.write(reply[i:i + step])
                    await writer.drain()
                    if self.delay:
                        await asyncio.sleep(self.delay)
                if b"Connection: close" in reply:
                    break
            if self.linger:  # keep the connection open, silent, until the client leaves
                await reader.read()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.target = url_target(f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}")
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        for w in self.writers:
            w.close()
        await self.server.wait_closed()
        await asyncio.sleep(0.01)


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("piece", [None, 1, 3, 7])
def test_chunked_stream_is_decoded_whatever_the_write_boundaries_and_the_connection_reused(piece):
    events = [b"data: {\"n\": %d}\n\n" % i for i in range(5)] + [b"data: [DONE]\n\n"]
    reply = SSE_HEAD + chunked(*events)

    async def main():
        async with Scripted([reply, reply], piece=piece) as srv:
            pool = UpstreamPool()
            for _ in range(2):
                ex = await pool.request(srv.target, "/v1/completions", [("X-A", "1")], b'{"a":1}')
                assert ex.status == 200 and ex.content_type == "text/event-stream"
                got = []
                await ex.relay(got.append)
                assert b"".join(got) == b"".join(events)
                ex.release()
            assert srv.connections == 1  # kept alive and reused
            assert srv.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
            assert b"Content-Length: 7\r\nX-A: 1\r\n\r\n{\"a\":1}" in srv.requests[0]
            await pool.close()
    asyncio.run(main())


def test_content_length_until_close_interim_and_prefix():
    body = b'{"usage": {"completion_tokens": 3}}'
    replies = [
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
        b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + body,  # until close
    ]

    async def main():
        async with Scripted(replies, piece=5) as srv:
            pool = UpstreamPool()
            ex = await pool.request(srv.target, "/x", [], b"")
            assert ex.status == 200 and await ex.read() == body
            ex.release()
            ex = await pool.request(srv.target, "/x", [], b"")
            assert await ex.read() == body
            ex.release()
            await asyncio.sleep(0.01)
            assert pool.open_connections == 0  # read-until-close is never pooled
            await pool.close()
        async with Scripted([b"HTTP/1.1 204 No Content\r\n\r\n"]) as srv:
            pool = UpstreamPool()
            target = url_target(f"http://127.0.0.1:{srv.target[2]}/api/")
            ex = await pool.request(target, "/v1/models", [], b"", method="GET")
            assert ex.status == 204 and await ex.read() == b""
            assert srv.requests[0].startswith(b"GET /api/v1/models HTTP/1.1")
            await pool.close()
    asyncio.run(main())


def test_failures_are_classified_for_the_retry_rule():
    async def main():
        pool = UpstreamPool(connect_timeout_s=1.0, read_timeout_s=0.2)
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        dead = url_target(f"http://127.0.0.1:{s.getsockname()[1]}")
        s.close()
        with pytest.raises(ConnectError) as e:
            await pool.request(dead, "/", [], b"")
        assert e.value.before_first_byte
        async with Scripted([None]) as srv:  # closes before any byte
            with pytest.raises(UpstreamBroken) as e:
                await pool.request(srv.target, "/", [], b"")
            assert e.value.before_first_byte
        async with Scripted([b"HTTP/1.1 200 OK\r\nContent-Le"]) as srv:  # closes mid-head
            with pytest.raises(UpstreamBroken) as e:
                await pool.request(srv.target, "/", [], b"")
            assert not e.value.before_first_byte
        async with Scripted([b"garbage\r\n\r\n"]) as srv:
            with pytest.raises(UpstreamBroken, match="malformed status line"):
                await pool.request(srv.target, "/", [], b"")
        async with Scripted([SSE_HEAD + b"5\r\nab"]) as srv:  # body cut off
            ex = await pool.request(srv.target, "/", [], b"")
            with pytest.raises(UpstreamBroken) as e:
                await ex.relay(lambda b: None)
            assert not e.value.before_first_byte
            ex.release()
        async with Scripted([SSE_HEAD + b"zz\r\n"]) as srv:
            ex = await pool.request(srv.target, "/", [], b"")
            with pytest.raises(UpstreamBroken, match="malformed chunk size"):
                await ex.read()
            ex.release()
        async with Scripted([SSE_HEAD + b"5\r\nab"], linger=True) as srv:
            ex = await pool.request(srv.target, "/", [], b"")
            with pytest.raises(UpstreamTimeout):  # stalls: no byte for read_timeout_s
                await ex.read()
            ex.release()
            await asyncio.sleep(0.05)
        assert pool.open_connections == 0
        await pool.close()
    asyncio.run(main())


def test_a_pooled_connection_closed_by_the_server_is_replaced_transparently():
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def main():
        # The server answers once per connection and then closes it, as after a keep-alive timeout.
        async with Scripted([reply, None, reply]) as srv:
            pool = UpstreamPool()
            ex = await pool.request(srv.target, "/", [], b"")
            assert await ex.read() == b"ok"
            ex.release()
            await asyncio.sleep(0.05)
            ex = await pool.request(srv.target, "/", [], b"")
            assert await ex.read() == b"ok"
            ex.release()
            await pool.close()
    asyncio.run(main())


def test_the_connection_limit_queues_requests():
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def main():
        async with Scripted([reply] * 3) as srv:
            pool = UpstreamPool(limit=1)
            ex = await pool.request(srv.target, "/", [], b"")
            second = asyncio.create_task(pool.request(srv.target, "/", [], b""))
            await asyncio.sleep(0.05)
            assert not second.done()
            assert await ex.read() == b"ok"
            ex.release()  # pooled: the waiter takes the same connection
            ex2 = await asyncio.wait_for(second, 10.0)
            assert await ex2.read() == b"ok"
            ex2.abort()
            assert pool.open_connections == 0
            await pool.close()
    asyncio.run(main())
