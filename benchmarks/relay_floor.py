"""The floor of a Python relay: the least a uvloop program can do to proxy the load benchmark.

It is not a router and not used by routerd. It exists to measure what any Python data path
in routerd's architecture must at least spend, on this machine, under
``benchmarks/routerd_overhead.py``'s load: it reads a request head and body, writes them
verbatim to a round-robin backend over a kept-alive connection, and copies every response
read to the client unchanged (no header rewriting, no token counting, no JSON, no metrics,
no decision). A response ends at a read ending in the last-chunk marker ``0\\r\\n\\r\\n``,
which is true of that benchmark's backends.

Usage: python benchmarks/routerd_overhead.py --router floor  (runs this as the router)
       python benchmarks/relay_floor.py PORT BACKEND_PORT [BACKEND_PORT ...]
"""

from __future__ import annotations

import asyncio
import sys


class _Up(asyncio.Protocol):
    """A kept-alive connection to a backend; relays each read to the client it serves."""

    def __init__(self, pool: list) -> None:
        self.pool = pool
        self.client: asyncio.Transport | None = None

    def connection_made(self, tr) -> None:
        self.tr = tr

    def data_received(self, data: bytes) -> None:
        self.client.write(data)
        if data.endswith(b"0\r\n\r\n"):
            self.client = None
            self.pool.append(self)

    def connection_lost(self, exc) -> None:
        if self in self.pool:
            self.pool.remove(self)
        if self.client is not None:
            self.client.close()


class _Front(asyncio.Protocol):
    """One client connection: frames requests by Content-Length and forwards them."""

    backends: list[int] = []
    pools: list[list] = []
    rr = 0

    def connection_made(self, tr) -> None:
        self.tr = tr
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        i = self.buf.find(b"\r\n\r\n")
        if i < 0:
            return
        j = self.buf.find(b"Content-Length: ", 0, i)
        n = int(self.buf[j + 16:self.buf.index(b"\r\n", j)]) if j >= 0 else 0
        if len(self.buf) < i + 4 + n:
            return
        req, self.buf = self.buf[:i + 4 + n], self.buf[i + 4 + n:]
        k = _Front.rr = (_Front.rr + 1) % len(self.backends)
        asyncio.get_running_loop().create_task(self._forward(k, req))

    async def _forward(self, k: int, req: bytes) -> None:
        pool = self.pools[k]
        if pool:
            up = pool.pop()
        else:
            _, up = await asyncio.get_running_loop().create_connection(
                lambda: _Up(pool), "127.0.0.1", self.backends[k])
            up.tr.get_extra_info("socket").setsockopt(6, 1, 1)  # TCP_NODELAY
        up.client = self.tr
        up.tr.write(req)


def main() -> None:
    import uvloop

    port, backends = int(sys.argv[1]), [int(p) for p in sys.argv[2:]]
    _Front.backends, _Front.pools = backends, [[] for _ in backends]
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(loop.create_server(_Front, "127.0.0.1", port, backlog=1024))
    loop.run_forever()


if __name__ == "__main__":
    main()
