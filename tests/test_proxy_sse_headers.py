"""The proxy's SSE event counting follows the specification's line endings, and hop-by-hop
headers (those named in ``Connection`` included) are not forwarded (issue 15)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from routerd.daemon.proxy import _StreamRelay, connection_named, final_usage_tokens


class _Ep:
    def __init__(self) -> None:
        self.tokens = 0

    def on_tokens(self, r, n: int) -> None:
        self.tokens += n

    def on_first_token(self, r) -> None:
        pass


class _Client:
    """The client transport the relay writes to (bytes kept)."""

    def __init__(self) -> None:
        self.out = bytearray()

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.out += data

    def get_write_buffer_size(self) -> int:
        return 0


def _count(chunks: list[bytes]) -> tuple[int, bool]:
    ep = _Ep()
    ctr = _Client()
    relay = _StreamRelay(ctr, False, None, ep, None)
    for c in chunks:
        relay.sink(c)
    assert bytes(ctr.out) == b"".join(chunks)
    assert relay.events == ep.tokens
    return relay.events, relay.at_boundary


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % len(data) for c in cuts} - {0})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]


@settings(max_examples=300, deadline=None)
@given(events=st.integers(1, 6), eol=st.sampled_from([b"\n", b"\r\n", b"\r"]),
       cuts=st.lists(st.integers(0, 10_000), max_size=12), partial=st.booleans())
def test_events_are_counted_once_whatever_the_line_ending_and_the_chunking(events, eol, cuts, partial):
    body = b"".join(b'data: {"choices": [{"text": "tok%d"}]}' % i + eol + eol for i in range(events))
    if partial:
        body += b'data: {"choices": [{"text": "cut off' + eol  # an event without its blank line yet
    n, at_boundary = _count(_split(body, cuts))
    assert n == events
    assert at_boundary is (not partial)


def test_a_crlf_split_between_two_chunks_is_one_line_ending():
    # "data: x\r" + "\n\r\n": one CRLF split across the read boundary, then the blank line.
    assert _count([b"data: x\r", b"\n\r\n"]) == (1, True)
    # A lone CR is a line ending too, so "\r" + "\r" is a blank line.
    assert _count([b"data: x\r", b"\r"]) == (1, True)
    assert _count([b"data: x\r\n", b"data: y\r\n"]) == (0, False)  # two lines, no blank line


def test_final_usage_is_read_from_crlf_streams():
    tail = (b'data: {"choices": [], "usage": {"completion_tokens": 7}}\r\n\r\n'
            b"data: [DONE]\r\n\r\n")
    assert final_usage_tokens(tail) == 7
    assert final_usage_tokens(tail.replace(b"\r\n", b"\n")) == 7


def test_headers_named_in_connection_are_hop_by_hop():
    assert connection_named(["keep-alive, X-Secret-Hop", " x-other ,"]) == {"keep-alive", "x-secret-hop", "x-other"}
    assert connection_named([]) == frozenset()
