"""Header blocks of a gRPC connection: HEADERS and CONTINUATION frames, and the streams they open.

Every block is HPACK-decoded (the decoding table must follow every block, also of refused
streams). A block opens a stream, or, on an open stream, is its trailers. A new stream is
checked before any byte of its body is taken: POST with a gRPC content type (else an HTTP
error), a method the server has, the header a restricted category needs, a known
``grpc-encoding``, a ``grpc-timeout`` not already expired.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import grpc

from pyserve.frontends.grpc import http2 as h2
from pyserve.frontends.grpc.call import CallContext, RequestMessages
from pyserve.frontends.grpc.connection_state import MAX_CONCURRENT_STREAMS, MAX_CONTINUATIONS, MAX_HEADER_LIST
from pyserve.frontends.grpc.http2_stream import Stream
from pyserve.frontends.grpc.request_body import RequestBody
from pyserve.frontends.restricted import GRPC_CATEGORIES
from pyserve.runtime.scheduling import client_activity

log = logging.getLogger("pyserve.frontends.grpc")

_SELF_DEPENDENT = 0x100
"""Not an HTTP/2 flag: marks a HEADERS frame whose priority names its own stream."""
_ENCODINGS = frozenset({"identity", "gzip", "deflate"})


class HeaderBlocks(RequestBody):
    """Receiving header blocks: opening streams, admitting their calls, and trailers."""

    def _headers_frame(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id == 0:
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "HEADERS on stream 0")
        if flags & h2.PADDED:
            payload = h2.unpad(payload)
        if flags & h2.PRIORITY_FLAG:
            if len(payload) < 5:
                raise h2.ConnectionError_(h2.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            if int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == stream_id:
                flags |= _SELF_DEPENDENT  # the block is decoded (HPACK state), then the stream reset
            payload = payload[5:]
        if len(payload) > MAX_HEADER_LIST:
            raise h2.ConnectionError_(h2.ENHANCE_YOUR_CALM, f"header block larger than {MAX_HEADER_LIST} bytes")
        if flags & h2.END_HEADERS:
            self._headers(stream_id, flags, bytes(payload))
        else:
            self._continuation = (stream_id, flags, bytearray(payload))
            self._continuations = 0
            self.guard.header_block_begins()

    def _continuation_frame(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if self._continuation is None or self._continuation[0] != stream_id:
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "unexpected CONTINUATION")
        block = self._continuation[2]
        block += payload
        self._continuations += 1
        if len(block) > MAX_HEADER_LIST:
            raise h2.ConnectionError_(h2.ENHANCE_YOUR_CALM, f"header block larger than {MAX_HEADER_LIST} bytes")
        if self._continuations > MAX_CONTINUATIONS and not flags & h2.END_HEADERS:
            raise h2.ConnectionError_(h2.ENHANCE_YOUR_CALM,
                                      f"header block in more than {MAX_CONTINUATIONS} CONTINUATION frames")
        if flags & h2.END_HEADERS:
            _, first_flags, _ = self._continuation
            self._continuation = None
            self.guard.header_started = None
            self._headers(stream_id, first_flags, bytes(block))

    def _headers(self, stream_id: int, flags: int, block: bytes) -> None:
        headers, problem = self._decoder.decode(block)  # always: the HPACK table must follow every block
        stream = self._streams.get(stream_id)
        if stream is not None:  # trailers from the client end its stream
            if not flags & h2.END_STREAM or problem or flags & _SELF_DEPENDENT:
                self._reset(stream, h2.PROTOCOL_ERROR)
                return
            self._remote_end(stream)
            return
        if stream_id <= self._last_stream_id:
            if any(name.startswith(":") for name, _ in headers):  # a new request, not late trailers
                raise h2.ConnectionError_(
                    h2.PROTOCOL_ERROR, f"stream id {stream_id} is not above the last one ({self._last_stream_id})")
            return  # trailers of a stream that already ended here
        if not stream_id & 1:
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "even stream id from a client")
        self._last_stream_id = stream_id
        if problem or flags & _SELF_DEPENDENT:  # malformed (RFC 9113 §8.1.1): a stream error
            log.debug("gRPC connection from %s: stream %d reset: %s", self.peer, stream_id,
                      problem or "the stream depends on itself")
            self._control(h2.rst_stream(stream_id, h2.PROTOCOL_ERROR))
            return
        if self.closing or len(self._streams) >= MAX_CONCURRENT_STREAMS:
            self._control(h2.rst_stream(stream_id, h2.REFUSED_STREAM))
            return
        self._open_stream(stream_id, flags, headers)

    def _open_stream(self, stream_id: int, flags: int, headers: list[tuple[str, str]]) -> None:
        """A new stream's request headers: the stream is opened and its call admitted or refused."""
        stream = Stream(stream_id, self, self.peer_initial_window)
        path = method = content_type = ""
        timeout: float | None = None
        for name, value in headers:
            if name == ":path":
                path = value
            elif name == ":method":
                method = value
            elif name == "content-type":
                content_type = value
            elif name == "grpc-timeout":
                timeout = h2.parse_timeout(value)
            elif name == "grpc-encoding":
                stream.encoding = value
            elif name == "grpc-accept-encoding":
                stream.accept_gzip, stream.accept_deflate = _accepted_compressions(value)
        self._streams[stream_id] = stream
        self._opened += 1
        self._opened_in_read += 1
        client_activity.request_from(self.activity_key, together=self._opened_in_read > 1 or len(self._streams) > 1)
        stream.path = path
        deadline = None if timeout is None else self.loop.time() + timeout
        context = stream.context = CallContext(stream, headers, deadline, self.peer)
        if flags & h2.END_STREAM:
            stream.remote_closed = True
        if method != "POST" or not content_type.startswith("application/grpc"):
            self._http_error(stream, 405 if method != "POST" else 415)
            return
        self._admit(stream, context, headers, timeout)

    def _admit(self, stream: Stream, context: CallContext, headers: Sequence[tuple[str, str]],
               timeout: float | None) -> None:
        """Start a gRPC call on a new stream, or end it with the status that refuses it."""
        path = stream.path
        handler = self.server.lookup(path)
        if handler is None:
            self._fail(stream, grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {path}")
            return
        denied = self._restricted(path, headers)
        if denied:  # before any byte of the body is taken
            self._fail(stream, grpc.StatusCode.UNAVAILABLE, denied)
            return
        if stream.encoding not in _ENCODINGS:
            self._fail(stream, grpc.StatusCode.UNIMPLEMENTED,
                       f"Compression algorithm '{stream.encoding}' is not supported (identity, deflate, gzip)")
            return
        stream.handler = handler
        if timeout is not None and timeout <= 0:  # expired on arrival: nothing to run
            stream.deadline_hit = True
            self._fail(stream, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            return
        if timeout is not None:
            stream.deadline_handle = self.loop.call_later(timeout, self._deadline, stream)
        if handler.request_streaming:
            stream.messages = RequestMessages(handler.request_deserializer)
            context.attach_messages(stream.messages)
            stream.task = self.loop.create_task(self._run(stream))
        if stream.remote_closed:
            self._remote_end(stream)

    def _restricted(self, path: str, headers: Sequence[tuple[str, str]]) -> str:
        """The refusal of a call to a restricted category without its header, or ""."""
        rules = self.server.restrictions
        if not rules:
            return ""
        rule = rules.get(GRPC_CATEGORIES.get(path.rsplit("/", 1)[-1], ""))
        if rule is None or (rule.key, rule.value) in headers:
            return ""
        return rule.grpc_message


@functools.lru_cache(maxsize=64)
def _accepted_compressions(value: str) -> tuple[bool, bool]:
    """(gzip, deflate) accepted by a ``grpc-accept-encoding`` value (clients repeat one value)."""
    accepted = {item.strip() for item in value.split(",")}
    return "gzip" in accepted, "deflate" in accepted
