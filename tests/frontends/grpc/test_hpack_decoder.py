"""The gRPC server's header decoder (``pyserve.frontends.grpc.http2.HeaderDecoder``) against RFC 7541's own
examples (Appendix C) and, by property-based fuzzing, against the ``hpack`` package decoding the
same blocks with no cache in front: the same headers for every block, in every order, whatever
the table has become (the remembered-blocks cache must never answer for a table that changed).
The fuzz targets run 300 examples each, or ``PYSERVE_FUZZ_EXAMPLES`` for a longer run
(docs/security.md).
"""

from __future__ import annotations

import os

import hpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyserve.frontends.grpc import http2 as h2

REQUESTS = [
    [(":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com")],
    [(":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com"),
     ("cache-control", "no-cache")],
    [(":method", "GET"), (":scheme", "https"), (":path", "/index.html"), (":authority", "www.example.com"),
     ("custom-key", "custom-value")],
]
REQUEST_TABLES = [
    [(":authority", "www.example.com")],
    [("cache-control", "no-cache"), (":authority", "www.example.com")],
    [("custom-key", "custom-value"), ("cache-control", "no-cache"), (":authority", "www.example.com")],
]
DATE1, DATE2 = "Mon, 21 Oct 2013 20:13:21 GMT", "Mon, 21 Oct 2013 20:13:22 GMT"
URL, COOKIE = "https://www.example.com", "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1"
RESPONSES = [
    [(":status", "302"), ("cache-control", "private"), ("date", DATE1), ("location", URL)],
    [(":status", "307"), ("cache-control", "private"), ("date", DATE1), ("location", URL)],
    [(":status", "200"), ("cache-control", "private"), ("date", DATE2), ("location", URL),
     ("content-encoding", "gzip"), ("set-cookie", COOKIE)],
]
RESPONSE_TABLES = [
    [("location", URL), ("date", DATE1), ("cache-control", "private"), (":status", "302")],
    [(":status", "307"), ("location", URL), ("date", DATE1), ("cache-control", "private")],
    [("set-cookie", COOKIE), ("content-encoding", "gzip"), ("date", DATE2)],
]
EXAMPLES = {  # RFC 7541 Appendix C: table size, the blocks, the headers, the table after each
    "C.3": (4096, [
        "8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
        "8286 84be 5808 6e6f 2d63 6163 6865",
        "8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65",
    ], REQUESTS, REQUEST_TABLES),
    "C.4": (4096, [
        "8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff",
        "8286 84be 5886 a8eb 1064 9cbf",
        "8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf",
    ], REQUESTS, REQUEST_TABLES),
    "C.5": (256, [
        "4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32"
        "3120 474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
        "4803 3330 37c1 c0bf",
        "88c1 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32 3220 474d 54c0 5a04 677a 6970"
        "7738 666f 6f3d 4153 444a 4b48 514b 425a 584f 5157 454f 5049 5541 5851 5745 4f49 553b 206d 6178 2d61"
        "6765 3d33 3630 303b 2076 6572 7369 6f6e 3d31",
    ], RESPONSES, RESPONSE_TABLES),
    "C.6": (256, [
        "4882 6402 5885 aec3 771a 4b61 96d0 7abe 9410 54d4 44a8 2005 9504 0b81 66e0 82a6 2d1b ff6e 919d 29ad"
        "1718 63c7 8f0b 97c8 e9ae 82ae 43d3",
        "4883 640e ffc1 c0bf",
        "88c1 6196 d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff c05a 839b d9ab 77ad 94e7 821d d7f2"
        "e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f 9587 3160 65c0 03ed 4ee5 b106 3d50 07",
    ], RESPONSES, RESPONSE_TABLES),
}


def decoder(table_size: int = 4096) -> h2.HeaderDecoder:
    decoding = h2.HeaderDecoder(1 << 20)
    decoding._decoder.header_table_size = table_size
    return decoding


def table(decoding: h2.HeaderDecoder) -> list[tuple[str, str]]:
    return [(name.decode(), value.decode()) for name, value in decoding._table.dynamic_entries]


@pytest.mark.parametrize("section", sorted(EXAMPLES))
def test_rfc_7541_appendix_c(section: str) -> None:
    size, blocks, headers, tables = EXAMPLES[section]
    decoding = decoder(size)
    for block, expected, expected_table in zip(blocks, headers, tables):
        decoded, _ = decoding.decode(bytes.fromhex(block.replace(" ", "")))
        assert decoded == expected
        assert table(decoding) == expected_table


def test_a_block_repeated_after_the_table_changed_means_the_new_entry() -> None:
    """The remembered-blocks cache: ``62`` after ``alice`` and after ``bob`` (RFC 7541 §2.3.3)."""
    decoding = decoder()
    insert_alice = b"\x40" + h2.literal(b"x-tenant", b"alice")[1:]
    insert_bob = b"\x40" + h2.literal(b"x-tenant", b"bob")[1:]
    newest = b"\x82\xbe"  # :method GET, then dynamic index 62
    assert decoding.decode(insert_alice)[0] == [("x-tenant", "alice")]
    assert decoding.decode(newest)[0] == [(":method", "GET"), ("x-tenant", "alice")]
    assert decoding.decode(insert_bob)[0] == [("x-tenant", "bob")]
    assert decoding.decode(newest)[0] == [(":method", "GET"), ("x-tenant", "bob")]
    decoding.decode(b"\x3f\x01")  # a table size update to 32: every entry is evicted
    with pytest.raises(h2.ConnectionError_):
        decoding.decode(newest)


@pytest.mark.parametrize(("headers", "problem"), [
    ([(":method", "POST"), ("x-Upper", "1")], "not lower case"),
    ([("x-a", "1"), (":path", "/")], "after a regular field"),
    ([(":status", "200")], "unknown pseudo-header"),
    ([("connection", "keep-alive")], "connection-specific"),
    ([("te", "gzip")], "connection-specific"),
    ([(":method", "POST"), ("te", "trailers"), ("x-1", "2")], ""),
])
def test_malformed_field_sections_are_named(headers: list[tuple[str, str]], problem: str) -> None:
    found = h2.field_problem(headers)
    assert (problem in found) if problem else found == ""


# -- fuzzing against the hpack package -------------------------------------------------------------

NAMES = st.sampled_from([":method", ":path", ":authority", "content-type", "te", "grpc-timeout", "x-fwd-a",
                         "x-fwd-b", "traceparent", "custom-key"])
VALUES = st.sampled_from(["POST", "/a", "/b", "localhost", "application/grpc", "trailers", "1S", "alice", "bob",
                          "", "x" * 40, "ü"])
FIELD = st.tuples(NAMES, VALUES, st.booleans())  # the third: sensitive (never indexed)
STEP = st.one_of(
    st.tuples(st.just("block"), st.lists(FIELD, min_size=1, max_size=6), st.booleans()),
    st.tuples(st.just("repeat"), st.integers(0, 50)),
    st.tuples(st.just("resize"), st.sampled_from([0, 64, 128, 256, 4096])),
)
FUZZ = settings(max_examples=int(os.environ.get("PYSERVE_FUZZ_EXAMPLES", "300")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow], database=None)


@FUZZ
@given(st.lists(STEP, min_size=1, max_size=40))
def test_decoding_matches_the_hpack_package(steps: list[tuple]) -> None:
    """Blocks from hpack's encoder (indexing, never-indexed fields, Huffman, table size updates),
    with earlier blocks re-sent byte for byte: the cached decoder answers as hpack does."""
    encoder, reference, decoding = hpack.Encoder(), hpack.Decoder(), decoder()
    sent: list[bytes] = []
    for step in steps:
        if step[0] == "resize":
            encoder.header_table_size = step[1]
            continue
        if step[0] == "repeat":
            if not sent:
                continue
            block = sent[step[1] % len(sent)]
        else:
            block = encoder.encode([(name, value, sensitive) for name, value, sensitive in step[1]], huffman=step[2])
            sent.append(block)
        try:
            expected = reference.decode(block)
        except Exception:  # e.g. a repeated size update that is no longer allowed: both refuse
            with pytest.raises(h2.ConnectionError_):
                decoding.decode(block)
            return
        assert decoding.decode(block)[0] == [(name, value) for name, value in expected]


@FUZZ
@given(st.lists(st.binary(max_size=40), min_size=1, max_size=8))
def test_arbitrary_bytes_decode_as_hpack_decodes_them_or_fail_cleanly(blocks: list[bytes]) -> None:
    reference, decoding = hpack.Decoder(max_header_list_size=1 << 20), decoder()
    for block in blocks:
        try:
            expected = [(name, value) for name, value in reference.decode(block)]
        except Exception:
            with pytest.raises(h2.ConnectionError_):
                decoding.decode(block)
            return
        assert decoding.decode(block)[0] == expected
