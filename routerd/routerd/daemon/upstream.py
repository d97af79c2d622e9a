"""A lean HTTP/1.1 client for routerd's upstream connections, built for relaying streams.

Why not aiohttp's client: relaying a 64-token stream through aiohttp's ``StreamReader``
costs a task wake-up, a buffer copy and a timer re-arm per chunk; on this class of
machine that alone is about 1.5 ms of CPU per request, the whole budget (issue #5:
≤ 1.5 ms). Here an asyncio ``Protocol`` decodes the response framing in
``data_received`` and hands each payload piece straight to a sink callback (routerd
writes it to the client's transport), as nginx does: no coroutine switch per chunk, one
timer per request.

Scope: what routerd needs towards vLLM-like servers. Requests carry a
``Content-Length`` body; responses may be ``Content-Length``, ``chunked`` or
read-until-close. Connections are kept alive and pooled per (scheme, host, port), with
``TCP_NODELAY`` (Nagle's delay would add tens of ms to every token). No proxies, no
redirects, no compression (routerd asks for ``identity``).

Failures are classified for the retry rule: :class:`ConnectError` (connect refused or
timed out) and :class:`UpstreamBroken` with ``before_first_byte=True`` (the connection
closed or reset before any response byte) may be retried elsewhere; anything after the
first response byte may not.
"""

from __future__ import annotations

import asyncio
import re
import socket
import ssl as _ssl
from collections import deque
from typing import Callable

__all__ = ["ConnectError", "Exchange", "UpstreamBroken", "UpstreamError", "UpstreamPool", "UpstreamTimeout"]

#: Most bytes a response head may have before it is refused (bytes); also the trailers' limit.
MAX_HEAD_BYTES = 64 * 1024

#: A header field name (RFC 9110 token) and a control character no header may hold (HTAB aside).
#: Like aiohttp's client, a response with either is malformed: relaying it would make
#: routerd's own server refuse the response (header injection) or break the client's parser.
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_CTL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


class UpstreamError(Exception):
    """The upstream exchange failed. ``before_first_byte``: no response byte had arrived.
    ``reason``: what failed, as ``phasewise_streams_broken_total{reason}`` names it when it cut a
    stream (``closed``, ``malformed``, ``timeout``; ``error`` for anything else)."""

    before_first_byte = False
    reason = "error"


class ConnectError(UpstreamError):
    """The TCP (or TLS) connection could not be made (refused, unreachable, timed out)."""

    before_first_byte = True
    reason = "connect"


class UpstreamBroken(UpstreamError):
    """The connection closed (``reason`` ``closed``: an engine killed, a reset, a proxy in between
    gone) or the response was malformed (``reason`` ``malformed``)."""

    def __init__(self, message: str, before_first_byte: bool, reason: str = "malformed") -> None:
        super().__init__(message)
        self.before_first_byte = before_first_byte
        self.reason = reason


class UpstreamTimeout(UpstreamError):
    """No response byte for ``read_timeout_s``."""

    reason = "timeout"


_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER, _UNTIL_CLOSE, _DONE = range(8)


class _Conn(asyncio.Protocol):
    """One upstream connection and the response being read on it."""

    def __init__(self, pool: "UpstreamPool", key: tuple) -> None:
        self.pool = pool
        self._time = pool.loop.time
        self.key = key
        self.tr: asyncio.Transport | None = None
        self.closed = False
        self.uses = 0
        self._reset()

    def _reset(self) -> None:
        self.state = _HEAD
        self.buf = b""
        self.got_bytes = False
        self.head: asyncio.Future | None = None
        self.done: asyncio.Future | None = None
        self.sink: Callable[..., None] | None = None
        self.framed = False  # the sink also takes a piece's chunk as read (Exchange.relay)
        self.pending: list[bytes] = []
        self.remaining = 0
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.keep_alive = True
        self.last_rx = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol --------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.tr = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        if self.state == _UNTIL_CLOSE and exc is None:
            # A read-until-close body ends with the connection; a reset (exc) cuts it short.
            self.keep_alive = False
            self._finish()
            return
        if self.state != _DONE:
            self._fail(UpstreamBroken(f"connection closed ({exc or 'by the server'})",
                                      before_first_byte=not self.got_bytes, reason="closed"))

    def data_received(self, data: bytes) -> None:
        self.last_rx = self._time()
        if self.state == _CHUNK_SIZE and not self.buf and self.sink is not None:
            # Fast path: the read is exactly one whole chunk (one SSE event, the usual case),
            # framed as routerd's HTTP server frames one (lower-case hex size without leading
            # zeros or extensions, as vLLM's h11 writes it): for a ``framed`` sink the read goes
            # to a chunked client as it is, one write. Other framings take the general path.
            i = data.find(b"\r\n")  # (bounds given to find cost more than they save)
            if 0 < i < 18:
                size = len(data) - i - 4
                if size > 0 and data.endswith(b"\r\n") and data[:i] == b"%x" % size:
                    if self.framed:
                        self.sink(data[i + 2:-2], data)
                    else:
                        self.sink(data[i + 2:-2])
                    return
        if self.state == _DONE:
            # Bytes nobody asked for (after a complete response): the connection is unusable.
            self.keep_alive = False
            self.pool._close(self)
            return
        self.got_bytes = True
        while self.state == _HEAD:
            self.buf += data
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD_BYTES:
                    self._fail(UpstreamBroken("response head too large", before_first_byte=False))
                return
            head, data = self.buf[:end], self.buf[end + 4:]
            self.buf = b""
            if not self._parse_head(head):
                if self.state == _HEAD:  # an interim 1xx response: the real head follows
                    continue
                return
            h = self.head
            if h is not None and not h.done():
                h.set_result(None)
            if self.state == _DONE:
                if data:  # bytes after a bodiless response: do not trust the connection
                    self.keep_alive = False
                self._finish()
                return
        if data:
            self._body(data)

    # -- parsing -----------------------------------------------------------------
    def _parse_head(self, head: bytes) -> bool:
        lines = head.split(b"\r\n")
        status_line = lines[0]
        parts = status_line.split(b" ", 2)
        if (len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or len(parts[1]) != 3 or not parts[1].isdigit()
                or parts[1][0] == 48 or _CTL.search(status_line)):
            self._fail(UpstreamBroken(f"malformed status line {status_line[:80]!r}", before_first_byte=False))
            return False  # state is _DONE now
        status = int(parts[1])
        if 100 <= status < 200:
            # An interim response (we never send Expect: 100-continue, but be tolerant).
            return False
        self.status = status
        headers = self.headers = []
        length = None
        lengths = set()
        chunked = False
        keep_alive = parts[0] == b"HTTP/1.1"
        for line in lines[1:]:
            k, sep, v = line.partition(b":")
            if not sep:
                continue
            if not _TOKEN.fullmatch(k) or _CTL.search(v):
                self._fail(UpstreamBroken(f"malformed header line {line[:80]!r}", before_first_byte=False))
                return False
            name = k.decode("ascii")
            # UTF-8 when it is (relayed as sent); other obs-text bytes become U+FFFD.
            value = v.strip(b" \t").decode("utf-8", "replace")
            headers.append((name, value))
            low = name.lower()
            if low == "content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = -1
                lengths.add(length)
                if length < 0 or len(lengths) > 1:
                    self._fail(UpstreamBroken(f"bad Content-Length {value!r}", before_first_byte=False))
                    return False
            elif low == "transfer-encoding":
                chunked = "chunked" in value.lower()
            elif low == "connection":
                v_low = value.lower()
                if "close" in v_low:
                    keep_alive = False
                elif "keep-alive" in v_low:
                    keep_alive = True
        self.keep_alive = keep_alive
        if status in (204, 304):
            # Never a body, whatever the framing headers say (RFC 9112 section 6.3).
            self.state = _DONE
        elif chunked:
            self.state = _CHUNK_SIZE
            if length is not None:
                self.keep_alive = False  # both framings: a smuggling smell; use the connection once
        elif length is not None:
            self.remaining = length
            self.state = _LENGTH if length > 0 else _DONE
        else:
            self.state = _UNTIL_CLOSE
            self.keep_alive = False
        return True

    def _emit(self, pieces: list[bytes], last: bool) -> None:
        # One sink call per read, whatever the framing split it into: one write to the client.
        piece = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        sink = self.sink
        if sink is None:
            self.pending.append(piece)
        elif self.framed:
            sink(piece, None, last)
        else:
            sink(piece)

    def _body(self, data: bytes) -> None:
        out: list[bytes] = []
        self._decode(data, out)
        if out:
            # ``last``: this read ended the response (a failure has settled ``done`` already).
            d = self.done
            self._emit(out, self.state == _DONE and d is not None and not d.done())
        if self.state == _DONE and not self.closed:
            self._finish()

    def _decode(self, data: bytes, out: list[bytes]) -> None:
        """Append the payload pieces in ``data`` to ``out``, following the response framing.

        Works with an offset into one buffer, so a read holding many chunks (routerd
        behind a fast instance) costs O(bytes), not O(chunks x bytes).
        """
        if self.buf:
            data = self.buf + data
            self.buf = b""
        pos = 0
        end = len(data)
        while pos < end:
            st = self.state
            if st == _CHUNK_DATA:
                n = self.remaining
                if end - pos <= n:
                    self.remaining = n - (end - pos)
                    if self.remaining == 0:
                        self.state = _CHUNK_CRLF
                    out.append(data[pos:] if pos else data)
                    return
                out.append(data[pos:pos + n])
                pos += n
                self.remaining = 0
                self.state = _CHUNK_CRLF
            elif st == _CHUNK_CRLF:
                if end - pos < 2:
                    self.buf = data[pos:]
                    return
                if data[pos] != 13 or data[pos + 1] != 10:
                    self._fail(UpstreamBroken("chunk not followed by CRLF", before_first_byte=False))
                    return
                pos += 2
                self.state = _CHUNK_SIZE
            elif st == _CHUNK_SIZE:
                # Whole chunks in a row (a read holding several events): a tight loop.
                find = data.find
                while True:
                    i = find(b"\r\n", pos, pos + 18)
                    if i < 0:
                        break
                    try:
                        size = int(data[pos:i], 16)
                    except ValueError:
                        break
                    stop = i + 2 + size
                    if size <= 0 or stop + 2 > end or data[stop] != 13 or data[stop + 1] != 10:
                        break
                    out.append(data[i + 2:stop])
                    pos = stop + 2
                if pos >= end:
                    return
                i = data.find(b"\r\n", pos)
                if i < 0:
                    if end - pos > 1024:
                        self._fail(UpstreamBroken("malformed chunk size line", before_first_byte=False))
                        return
                    self.buf = data[pos:]
                    return
                line = data[pos:i].split(b";", 1)[0].strip()
                try:
                    size = int(line, 16)
                except ValueError:
                    size = -1
                if size < 0:
                    self._fail(UpstreamBroken(f"malformed chunk size {line[:20]!r}", before_first_byte=False))
                    return
                pos = i + 2
                if size == 0:
                    self.state = _TRAILER
                    self.remaining = 0  # trailer bytes read so far
                else:
                    self.remaining = size
                    self.state = _CHUNK_DATA
            elif st == _LENGTH:
                n = self.remaining
                if end - pos < n:
                    self.remaining = n - (end - pos)
                    out.append(data[pos:] if pos else data)
                    return
                out.append(data[pos:pos + n])
                self.remaining = 0
                self.state = _DONE
                if end - pos > n:
                    self.keep_alive = False  # bytes after the response: do not trust the connection
                return
            elif st == _TRAILER:
                i = data.find(b"\r\n", pos)
                if self.remaining + (end - pos if i < 0 else i - pos) > MAX_HEAD_BYTES:
                    self._fail(UpstreamBroken("response trailers too large", before_first_byte=False))
                    return
                if i < 0:
                    self.buf = data[pos:]
                    return
                if i == pos:  # the empty line after the (usually absent) trailers
                    self.state = _DONE
                    if i + 2 < end:
                        self.keep_alive = False
                    return
                self.remaining += i + 2 - pos
                pos = i + 2
            elif st == _UNTIL_CLOSE:
                out.append(data[pos:] if pos else data)
                return
            else:  # _DONE: bytes after the end of the response
                self.keep_alive = False
                return

    # -- outcome -----------------------------------------------------------------
    def _finish(self) -> None:
        self.state = _DONE
        self._cancel_timer()
        d = self.done
        if d is not None and not d.done():
            d.set_result(None)

    def _fail(self, exc: UpstreamError) -> None:
        self.keep_alive = False
        self._cancel_timer()
        for f in (self.head, self.done):
            if f is not None and not f.done():
                f.set_exception(exc)
                # Retrieved by whoever awaits it; avoid "exception never retrieved" noise otherwise.
                f.exception()
        self.state = _DONE
        if self.tr is not None and not self.tr.is_closing():
            self.tr.abort()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def arm_timeout(self, timeout_s: float, head_timeout_s: float | None = None) -> None:
        """Fail the exchange when no byte arrives for ``timeout_s``, or (``head_timeout_s``) when
        the response head is not complete that long after now (one timer, re-armed lazily)."""
        loop = self.pool.loop
        start = self.last_rx = loop.time()
        head_s = timeout_s if head_timeout_s is None else head_timeout_s

        def check() -> None:
            now = loop.time()
            idle = now - self.last_rx
            wait = timeout_s - idle
            if self.state == _HEAD:
                wait = min(wait, head_s - (now - start))
            if self.state == _DONE:
                self._timer = None
            elif wait <= 0:
                self._timer = None
                if idle >= timeout_s:
                    self._fail(UpstreamTimeout(f"no response byte for {timeout_s:g} s"))
                else:
                    self._fail(UpstreamTimeout(f"no response head within {head_s:g} s"))
            else:
                self._timer = loop.call_later(wait, check)

        self._timer = loop.call_later(min(timeout_s, head_s), check)


class Exchange:
    """One request/response on a pooled connection.

    After :meth:`UpstreamPool.request` returns, ``status`` and ``headers`` are known.
    Read the body with :meth:`read` or :meth:`relay`, then call :meth:`release`
    (returns the connection to the pool when the response was read to its end) or
    :meth:`abort` (closes it; the server sees the client go away).
    """

    __slots__ = ("conn", "status", "headers", "_released")

    def __init__(self, conn: _Conn) -> None:
        self.conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self._released = False

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (case-insensitive), or None."""
        low = name.lower()
        for k, v in self.headers:
            if k.lower() == low:
                return v
        return None

    @property
    def content_type(self) -> str:
        """The media type of the response without parameters, lower case ('' if absent)."""
        v = self.header("content-type") or ""
        return v.split(";", 1)[0].strip().lower()

    async def read(self) -> bytes:
        """The whole body.

        Raises:
            UpstreamBroken, UpstreamTimeout: the body broke off or stalled.
        """
        c = self.conn
        if c.state != _DONE:
            await c.done
        elif c.done is not None and c.done.done() and c.done.exception() is not None:
            raise c.done.exception()  # type: ignore[misc]
        return b"".join(c.pending)

    async def relay(self, sink: Callable[..., None], framed: bool = False) -> None:
        """Call ``sink`` with each body piece as it arrives (from ``data_received``); return at the end.

        ``framed``: ``sink`` takes two more arguments, ``chunk`` and ``last``. ``chunk``: when a
        read is exactly one chunk of a chunked body, framed as routerd's HTTP server frames one
        (``b"%x\\r\\n" % len(piece) + piece + b"\\r\\n"``), that read, to write to a chunked
        client unchanged (one buffer instead of three: 0.6 us of CPU per streamed token with
        uvloop), else None. ``last``: the read that brought the piece also ended the body, so
        the piece may be written with the end of the client's body (one write instead of two).

        Raises:
            UpstreamBroken, UpstreamTimeout: the body broke off or stalled.
        """
        c = self.conn
        pending, c.pending = c.pending, []
        for piece in pending:
            sink(piece)
        if c.state != _DONE:
            c.sink = sink
            c.framed = framed
            await c.done
        elif c.done is not None and c.done.done() and c.done.exception() is not None:
            raise c.done.exception()  # type: ignore[misc]

    def pause(self) -> None:
        """Stop reading from the upstream (the client is slow)."""
        tr = self.conn.tr
        if tr is not None and not tr.is_closing():
            tr.pause_reading()

    def resume(self) -> None:
        """Read from the upstream again."""
        tr = self.conn.tr
        if tr is not None and not tr.is_closing():
            tr.resume_reading()

    def release(self) -> None:
        """Give the connection back: pooled if the response ended cleanly, else closed."""
        if self._released:
            return
        self._released = True
        c = self.conn
        c.sink = None
        if c.state == _DONE and c.keep_alive and not c.closed and c.tr is not None and not c.tr.is_closing():
            c.pool._put_back(c)
        else:
            self.conn.pool._close(c)

    def abort(self) -> None:
        """Close the connection at once (the upstream sees the request cancelled)."""
        if self._released:
            return
        self._released = True
        c = self.conn
        c.sink = None
        c._cancel_timer()
        c.pool._close(c)


class UpstreamPool:
    """Keep-alive connections to the instances, at most ``limit`` open at once.

    Args:
        limit: most open connections over all hosts.
        connect_timeout_s: TCP (+TLS) connect timeout (s).
        read_timeout_s: longest wait for any response byte, headers included (s).
        response_timeout_s: longest time from sending a request to its complete response
            head (s); None = ``read_timeout_s`` alone bounds it.
    """

    def __init__(self, *, limit: int = 4096, connect_timeout_s: float = 5.0, read_timeout_s: float = 600.0,
                 response_timeout_s: float | None = None) -> None:
        self.limit = limit
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.response_timeout_s = response_timeout_s
        self.loop = asyncio.get_running_loop()
        self._idle: dict[tuple, list[_Conn]] = {}
        self._open: set[_Conn] = set()
        self._waiters: deque[asyncio.Future] = deque()
        self._ssl: _ssl.SSLContext | None = None
        self._closed = False

    async def request(self, target: tuple[str, str, int, str], path: str, headers: list[tuple[str, str]],
                      body: bytes, method: str = "POST") -> Exchange:
        """Send one request and wait for the response head.

        ``target`` is (scheme, host, port, path prefix), see ``routerd.daemon.state.url_target``.

        ``headers`` must not contain Host, Content-Length or Connection (set here). Header
        values go out as UTF-8 with ``surrogateescape``, so values aiohttp's server decoded
        that way (any bytes a client sent) are forwarded byte for byte.

        Raises:
            ConnectError: could not connect.
            UpstreamBroken: the connection failed (``before_first_byte`` says when).
            UpstreamTimeout: no response byte for ``read_timeout_s`` or no complete head
                within ``response_timeout_s``.
        """
        scheme, host, port, prefix = target
        key = (scheme, host, port)
        bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host  # IPv6
        default_port = (scheme == "http" and port == 80) or (scheme == "https" and port == 443)
        hostport = bracketed if default_port else f"{bracketed}:{port}"
        lines = [f"{method} {prefix}{path} HTTP/1.1\r\nHost: {hostport}\r\nContent-Length: {len(body)}\r\n"]
        for k, v in headers:
            lines.append(f"{k}: {v}\r\n")
        lines.append("\r\n")
        head = "".join(lines).encode("utf-8", "surrogateescape")
        # A pooled connection the server closed while idle fails before the first byte:
        # that is not the instance's fault, so try once more on a fresh connection.
        for attempt in (0, 1):
            conn = self._take_idle(key) if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = await self._connect(key)
            conn.uses += 1
            conn._reset()
            loop = self.loop
            conn.head = loop.create_future()
            conn.done = loop.create_future()
            conn.arm_timeout(self.read_timeout_s, self.response_timeout_s)
            assert conn.tr is not None
            if len(body) < 16384:
                conn.tr.write(head + body)
            else:
                conn.tr.writelines((head, body))
            try:
                await conn.head
            except UpstreamBroken as e:
                if reused and e.before_first_byte and attempt == 0:
                    continue
                raise
            except asyncio.CancelledError:
                conn._cancel_timer()
                self._close(conn)
                raise
            return Exchange(conn)
        raise AssertionError("unreachable")

    def _take_idle(self, key: tuple) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            c = idle.pop()
            if not c.closed and c.tr is not None and not c.tr.is_closing():
                return c
        return None

    async def _connect(self, key: tuple) -> _Conn:
        if self._closed:
            raise ConnectError("upstream pool is closed")
        while len(self._open) >= self.limit:
            if not self._evict_idle():
                fut = self.loop.create_future()
                self._waiters.append(fut)
                try:
                    await fut
                except asyncio.CancelledError:
                    try:
                        self._waiters.remove(fut)
                    except ValueError:
                        pass
                    if fut.done() and not fut.cancelled():
                        self._wake()  # woken, then cancelled: pass the free slot on
                    raise
        scheme, host, port = key
        ssl_ctx = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = _ssl.create_default_context()
            ssl_ctx = self._ssl
        conn = _Conn(self, key)
        self._open.add(conn)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await self.loop.create_connection(lambda: conn, host, port, ssl=ssl_ctx)
        except TimeoutError:
            self._forget(conn)
            raise ConnectError(f"connect to {host}:{port} timed out after {self.connect_timeout_s:g} s") from None
        except OSError as e:
            self._forget(conn)
            raise ConnectError(f"connect to {host}:{port} failed: {e.strerror or e}") from None
        except UnicodeError as e:  # a host name the resolver cannot encode (IDNA): never reachable
            self._forget(conn)
            raise ConnectError(f"connect to {host}:{port} failed: invalid host name ({e})") from None
        except BaseException:
            self._forget(conn)
            raise
        return conn

    def _evict_idle(self) -> bool:
        for idle in self._idle.values():
            if idle:
                self._close(idle.pop(0))
                return True
        return False

    def _put_back(self, c: _Conn) -> None:
        if self._closed:
            self._close(c)
            return
        self._idle.setdefault(c.key, []).append(c)
        self._wake()

    def _close(self, c: _Conn) -> None:
        if c.tr is not None and not c.tr.is_closing():
            c.tr.abort()
        self._forget(c)

    def _forget(self, c: _Conn) -> None:
        c.closed = True
        if c in self._open:
            self._open.discard(c)
            self._wake()
        idle = self._idle.get(c.key)
        if idle and c in idle:
            idle.remove(c)

    def _wake(self) -> None:
        while self._waiters:
            f = self._waiters.popleft()
            if not f.done():
                f.set_result(None)
                return

    @property
    def open_connections(self) -> int:
        """Connections open now (idle and busy)."""
        return len(self._open)

    async def close(self) -> None:
        """Close every connection (busy ones are aborted)."""
        self._closed = True
        for c in list(self._open):
            self._close(c)
        self._idle.clear()
        await asyncio.sleep(0)
