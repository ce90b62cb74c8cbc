"""Encoding a request for the wire, refused on this side when the daemon would drop it for its size.

ZeroMQ drops a frame larger than the daemon's max_message_bytes together with the connection, and no error
can come back: the request would only time out, and other requests in flight on that connection would lose
their replies. The daemon says its limit in its hello reply; a larger request is refused here instead.
"""

from __future__ import annotations

import msgspec

from kvpool import protocol as p

from .errors import BadRequest


def encode_request(message: p.Request, max_bytes: int) -> bytes:
    """The request's frame; BadRequest when it exceeds ``max_bytes`` (0: no limit known, an older daemon)."""
    try:
        frame = p.encode(message)
    except (OverflowError, msgspec.EncodeError) as exc:  # (an integer past what msgpack carries: 2**64 and up)
        raise BadRequest(f"This request cannot be encoded: {exc}; a value is out of range.") from None
    if max_bytes and len(frame) > max_bytes:
        raise BadRequest(
            f"This request is {len(frame)} bytes once encoded, more than the {max_bytes} bytes the daemon accepts "
            "in one message (max_message_bytes); send a shorter prompt, or raise max_message_bytes in the "
            "daemon's configuration.",
            detail={"frame_bytes": len(frame), "max_message_bytes": max_bytes},
        )
    return frame
