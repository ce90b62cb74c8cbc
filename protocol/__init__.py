"""The wire schema shared by the daemon and every client.

Every message is a msgspec Struct in a tagged union (tag field ``op``), encoded with msgpack and sent as a
single ZeroMQ frame (the ROUTER socket adds the client's identity frame in front). Each request carries an
``id`` chosen by the client; every reply to it carries the same ``id``, so one connection can have several
requests in flight. A generation streams ``Chunk`` messages and always ends with exactly one ``Final`` (or
one ``Error``).

Field constraints (``Meta``) are part of the schema: a request that violates them is refused by the
decoder with BAD_REQUEST before it reaches the engine.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from .status import DaemonStatus

PROTOCOL_VERSION = 1

RequestId = Annotated[int, Meta(ge=0, le=2**63 - 1)]
NonNegInt = Annotated[int, Meta(ge=0)]
SessionId = Annotated[str, Meta(max_length=64)]
Token = Annotated[str, Meta(max_length=128)]
TaskName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class ErrorCode(StrEnum):
    """Stable error codes: clients branch on these, people read the message next to them."""

    BAD_REQUEST = "BAD_REQUEST"  # malformed frame, wrong field type, value out of range
    UNKNOWN_OP = "UNKNOWN_OP"  # a message type this daemon does not know
    VERSION_MISMATCH = "VERSION_MISMATCH"
    UNKNOWN_TASK = "UNKNOWN_TASK"
    UNKNOWN_SESSION = "UNKNOWN_SESSION"
    NOT_OWNER = "NOT_OWNER"
    SESSION_BUSY = "SESSION_BUSY"
    SESSION_EVICTED = "SESSION_EVICTED"  # dropped because the pool and the spill directory were full
    SESSION_CORRUPT = "SESSION_CORRUPT"  # its saved state failed its checksum; the session was closed
    CONFLICT = "CONFLICT"  # the session does not hold the context the request expected (`after`)
    POOL_FULL = "POOL_FULL"
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
    CONTEXT_OVERFLOW = "CONTEXT_OVERFLOW"
    BUDGET_UNMEETABLE = "BUDGET_UNMEETABLE"
    OVERLOADED = "OVERLOADED"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    # An RPC worker holding part of the model was lost: the daemon restarts, its sessions stay in the pool
    WORKER_LOST = "WORKER_LOST"
    REMOTE_UNAVAILABLE = "REMOTE_UNAVAILABLE"  # the remote tier (Redis) did not answer; local sessions still work
    # The spill directory failed a read or write (not a full disk): the session is kept, nothing was dropped.
    SPILL_UNAVAILABLE = "SPILL_UNAVAILABLE"
    # The client sent nothing (not even heartbeats), or read nothing, for the daemon's client_patience: its
    # generation was stopped; the session keeps what was generated.
    CLIENT_UNRESPONSIVE = "CLIENT_UNRESPONSIVE"
    KV_FULL = "KV_FULL"  # the unified KV ran out of cells mid-answer and no idle session could make room
    MEDIA_UNSUPPORTED = "MEDIA_UNSUPPORTED"  # an image or audio for a daemon without a projector (mmproj) that reads it
    INTERNAL = "INTERNAL"


class FinishReason(StrEnum):
    """Why a generation ended as asked: its own end, its limit, or its client's cancel. A generation the daemon
    had to stop (shutting down, a client it could not reach, a full KV) ends with an ``Error`` instead, whose
    ``detail`` says what the session kept (``cut_detail``)."""

    STOP = "stop"  # end-of-generation token or a stop string
    LENGTH = "length"  # max_tokens reached, or the session's context is full
    CANCELLED = "cancelled"  # the client cancelled it (Cancel, or closing the session)
    SHUTDOWN = "shutdown"  # older daemons only (now an Error SHUTTING_DOWN); clients treat it as that error


# ---------------------------------------------------------------- requests (client -> daemon)


class Request(Struct, tag_field="op", forbid_unknown_fields=True, kw_only=True):
    id: RequestId = 0


class Hello(Request, tag="hello"):
    version: int
    client: Annotated[str, Meta(max_length=128)] = ""
    # The client pings while it waits for replies: when it falls silent its generations are stopped.
    heartbeat: bool = False
    # It multiplexes many users (the HTTP gateway): it may have max_inflight_per_multiplexer generations in flight.
    multiplexer: bool = False


class Status(Request, tag="status"):
    pass


class ListSessions(Request, tag="sessions"):
    pass


class Ping(Request, tag="ping"):
    """A client's heartbeat while it waits for replies: a client that stops sending them (its process died)
    has its generations stopped. Answered by Pong."""


class Tokenize(Request, tag="tokenize"):
    """Turn ``text`` into the model's token ids. ``special``: text such as ``<start_of_turn>`` (what a chat
    template writes) becomes the model's special tokens, not their letters; ``add_bos``: start with BOS when the
    model wants one. A prompt rendered from a chat template is tokenized this way and sent as ``prompt_tokens``."""

    text: Annotated[str, Meta(max_length=1 << 22)]
    add_bos: bool = False
    special: bool = True


class Detokenize(Request, tag="detokenize"):
    """The text of ``tokens`` (special tokens such as end-of-turn render as nothing), e.g. what a stop string
    left in a session beyond the text that was streamed."""

    tokens: Annotated[list[NonNegInt], Meta(max_length=1 << 18)]


MAX_MEDIUM_BYTES = 1 << 28  # what one medium's bytes may be at most (a daemon's max_media_bytes is lower)


class Medium(Struct, forbid_unknown_fields=True, kw_only=True):
    """An image or an audio clip in a prompt (docs/protocol.md). Its bytes come ``data`` (in the message), or
    from the frame area the daemon gave this connection (FrameArea): ``length`` bytes at ``offset``, so that a
    camera frame crosses no socket.

    Formats: ``rgb`` / ``rgba`` (a frame of ``width`` x ``height`` pixels, 8 bits a channel, row by row), ``pcm_f32``
    (mono float32 samples at the projector's sample rate, little-endian), ``encoded`` (a file: JPEG, PNG, BMP or GIF
    for an image; WAV, MP3 or FLAC for audio)."""

    kind: Literal["image", "audio"]
    format: Literal["rgb", "rgba", "pcm_f32", "encoded"]
    width: Annotated[int, Meta(ge=0, le=1 << 15)] = 0
    height: Annotated[int, Meta(ge=0, le=1 << 15)] = 0
    data: Annotated[bytes, Meta(max_length=MAX_MEDIUM_BYTES)] | None = None
    area: Annotated[str, Meta(max_length=255)] | None = None
    offset: NonNegInt = 0
    length: Annotated[int, Meta(ge=0, le=MAX_MEDIUM_BYTES)] = 0


# A prompt in parts, in order: text, token ids (a rendered chat template's pieces, special tokens included), media
# (at most 64 a request).
Parts = Annotated[
    list[Annotated[str, Meta(max_length=1 << 20)] | Annotated[list[NonNegInt], Meta(max_length=1 << 18)] | Medium],
    Meta(max_length=1024),
]


class FrameArea(Request, tag="frame_area"):
    """A shared-memory area for this connection's media (a POSIX segment the daemon creates, mode 0660 in its
    group): write a frame there and name its place in a Medium instead of sending its bytes. One per connection,
    freed when the connection goes; asking again gives the same area. Answered by FrameAreaReply."""

    size: Annotated[int, Meta(ge=1 << 16, le=1 << 30)] = 16 << 20


class OpenSession(Request, tag="open"):
    """Open a session for ``task``. It starts with ``system_prompt`` (text, or ``system_prompt_tokens``), else
    with its task's configured one; sessions that start alike share those tokens' KV (computed once)."""

    task: TaskName = "default"
    system_prompt: Annotated[str, Meta(max_length=1 << 20)] | None = None
    system_prompt_tokens: Annotated[list[NonNegInt], Meta(max_length=1 << 18)] | None = None
    # A system prompt with media (an image every session of a task starts from): shared like a text one.
    system_parts: Parts | None = None


class SessionRequest(Request):
    """A request about one session: it must present the capability token returned at open."""

    session: SessionId
    token: Token


class CloseSession(SessionRequest, tag="close"):
    pass


class History(SessionRequest, tag="history"):
    """The session's tokens from ``start`` on (e.g. to learn whether a turn interrupted by a crash was kept)."""

    start: NonNegInt = 0


class ResumeSession(SessionRequest, tag="resume"):
    """Take a session back (e.g. from a new process, or after a daemon restart) with its id and token. A daemon
    with a remote tier resumes a session it does not hold from there (docs/remote.md). ``prefetch``: also move
    its KV up the tiers ahead of the next turn (see Prefetch)."""

    prefetch: bool = False


class Prefetch(SessionRequest, tag="prefetch"):
    """A hint: the session's next turn is coming. Its KV moves from disk or the remote tier into the pool, and
    into a hot slot when one is free (nothing is evicted for it). Answered by Prefetched."""


class Migrate(SessionRequest, tag="migrate"):
    """Hand the session over to another node: its newest checkpoint is written to the remote tier, its lease
    given up and its local copy dropped; then resume it on the other node. Answered by Migrated."""


class Cancel(SessionRequest, tag="cancel"):
    pass


Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
TriggerWord = Annotated[str, Meta(min_length=1, max_length=256)]


class Generate(SessionRequest, tag="generate"):
    """Append ``prompt`` (text, or ``prompt_tokens``) to the session and generate a continuation.

    Sampling defaults follow llama.cpp's; ``temperature=0`` is greedy. ``seed=None`` draws a random seed.

    Constrained decoding (docs/protocol.md): ``grammar`` (GBNF, start rule ``root``) or ``json_schema`` (a JSON
    Schema as JSON text, converted to GBNF) limits the generated tokens to what it allows. With
    ``grammar_trigger_words`` or ``grammar_trigger_tokens`` the grammar is lazy: free text until one of them is
    generated, then the grammar applies from that word (or token) on. ``grammar_from`` replays the session's
    tokens from that position into the grammar first, so a constrained answer cut short (by max_tokens, or a
    daemon restart) can be continued under the same grammar. ``text_from`` likewise replays them into the text
    stream without sending their text, so a continuation holds back what the cut answer held back (the bytes of a
    character split across tokens, the start of a stop string) and its text joins the streamed text exactly.
    """

    prompt: Annotated[str, Meta(max_length=1 << 20)] = ""
    prompt_tokens: Annotated[list[NonNegInt], Meta(max_length=1 << 18)] | None = None
    # A prompt with images or audio: text and media in order (instead of ``prompt``; docs/protocol.md).
    parts: Parts | None = None
    # 0: a prefill. The prompt goes into the session's KV and nothing is generated (the final message says
    # completion_tokens 0, finish_reason length); a later generate computes only its own new tokens.
    max_tokens: Annotated[int, Meta(ge=0, le=1 << 20)] = 128
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] = 0.8
    top_k: Annotated[int, Meta(ge=0, le=1 << 24)] = 40
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.95
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.05
    repeat_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0
    repeat_last_n: Annotated[int, Meta(ge=0, le=1 << 16)] = 64
    seed: Annotated[int, Meta(ge=0, le=2**32 - 1)] | None = None
    stop: Annotated[list[Annotated[str, Meta(min_length=1, max_length=256)]], Meta(max_length=16)] = []
    # Only if the session holds exactly this many tokens (else CONFLICT): makes a resent turn safe, since a
    # turn that was already applied (its answer lost in a crash) cannot be applied twice.
    after: NonNegInt | None = None
    # Tighten the task's time-to-first-token budget for this request (milliseconds); it cannot loosen it.
    deadline_ms: Annotated[float, Meta(gt=0, le=3_600_000)] | None = None
    typical_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0  # locally typical sampling (1: off)
    presence_penalty: Penalty = 0.0  # subtracted once from each token seen in the last repeat_last_n
    frequency_penalty: Penalty = 0.0  # subtracted per occurrence in the last repeat_last_n
    logit_bias: Annotated[dict[NonNegInt, Bias], Meta(max_length=1024)] = {}  # token id -> added to its logit
    # The log-probabilities (of the raw logits, before any sampler) of each sampled token and of this many most
    # likely ones, in every chunk (None: none).
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    grammar: Annotated[str, Meta(min_length=1, max_length=1 << 20)] | None = None
    json_schema: Annotated[str, Meta(min_length=1, max_length=1 << 20)] | None = None
    grammar_trigger_words: Annotated[list[TriggerWord], Meta(max_length=16)] = []
    grammar_trigger_tokens: Annotated[list[NonNegInt], Meta(max_length=16)] = []
    grammar_from: NonNegInt | None = None
    text_from: NonNegInt | None = None
    # The answer the client expects (text, or ``prediction_tokens``): the file an edit gives back mostly unchanged.
    # Where the answer follows it, its tokens are guessed and verified in the step (docs/speculative.md); the
    # answer is the one sampling gives either way. Needs guesses on (draft_tokens > 0).
    prediction: Annotated[str, Meta(max_length=1 << 20)] | None = None
    prediction_tokens: Annotated[list[NonNegInt], Meta(max_length=1 << 18)] | None = None


AnyRequest = (
    Hello
    | Status
    | ListSessions
    | OpenSession
    | ResumeSession
    | CloseSession
    | Cancel
    | Generate
    | Ping
    | History
    | Tokenize
    | Detokenize
    | Prefetch
    | Migrate
    | FrameArea
)


# ---------------------------------------------------------------- replies (daemon -> client)


class Reply(Struct, tag_field="op", kw_only=True):
    id: int = 0
    # The daemon process that sent it (new at each start): a client tells a restart by it, see restarts.py.
    instance: str = ""


class HelloReply(Reply, tag="hello"):
    version: int
    daemon_version: str
    model: str
    max_message_bytes: int = 0  # the largest request frame the daemon accepts (0: not said, an older daemon)
    max_inflight: int = 0  # generations this connection may have queued or running at once (0: not said)


class FrameAreaReply(Reply, tag="frame_area"):
    name: str  # the POSIX shared-memory name (shm_open), e.g. /kvpool-frames-...
    size: int


class Pong(Reply, tag="pong"):
    pass


class TokensReply(Reply, tag="tokens"):
    tokens: list[int]


class TextReply(Reply, tag="text"):
    text: str


class HistoryReply(Reply, tag="history"):
    tokens: list[int]
    context_tokens: int


class StatusReply(Reply, tag="status"):
    status: DaemonStatus


class SessionInfo(Struct, kw_only=True):
    session: str
    task: str
    tier: str  # "hot" (in a slot), "pool" (shared memory), "disk" (spill directory), "new" (nothing computed)
    context_tokens: int
    snapshot_bytes: int  # size of its last checkpoint (0 if none)
    checkpoint_version: int
    busy: bool
    idle_s: float
    age_s: float
    shared_tokens: int = 0  # leading tokens whose KV it shares with other sessions (a shared prefix)
    # Its whole context is in a committed snapshot: a crash now loses nothing. False while a turn runs, for
    # resident sessions under checkpoint = "on_evict", and when neither the pool nor the spill directory could
    # take its checkpoint (a crash then brings it back evicted).
    saved: bool = True
    kv_type: str = ""  # the KV type its snapshot is stored at ("f16", "q8_0", ...; "" without one)
    # The remote tier's copy (docs/remote.md): "current" (holds its newest checkpoint), "behind" (a write is
    # pending, or Redis is down), "lost" (another node owns it now); "" without a remote tier.
    remote: str = ""


class SessionsReply(Reply, tag="sessions"):
    sessions: list[SessionInfo]


class SessionOpened(Reply, tag="opened"):
    session: str
    token: str
    task: str
    context_size: int
    context_tokens: int = 0  # tokens the session already holds (non-zero when resumed)


class Closed(Reply, tag="closed"):
    session: str


class Prefetched(Reply, tag="prefetched"):
    session: str
    tier: str  # where its KV is now: hot, pool, disk (no room was free) or new


class Migrated(Reply, tag="migrated"):
    session: str
    context_tokens: int  # what the remote tier now holds for it


class Cancelled(Reply, tag="cancelled"):
    """``completion_tokens`` is the count at the moment the engine stopped the generation: the final
    message of that generation reports the same count, which shows that no step ran after the cancel."""

    cancelled: bool
    completion_tokens: int = 0


class TopLogprob(Struct, array_like=True):
    token: int
    logprob: float
    piece: bytes = b""  # the bytes the token stands for (a piece of a UTF-8 character, possibly)


class TokenLogprob(Struct, kw_only=True):
    """A sampled token's log-probability under the raw logits (log-softmax over the vocabulary, before any
    sampler), its bytes, and the ``top`` most likely tokens' (most likely first)."""

    token: int
    logprob: float
    piece: bytes = b""
    top: list[TopLogprob] = []


class Chunk(Reply, tag="chunk"):
    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    context_tokens: int  # the session's whole context after this generation
    # Of a request's prediction: the tokens guessed from it that sampling took, and those guessed and refused.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Timings(Struct, kw_only=True):
    queue_ms: float  # arrival until the first step that worked on it
    ttft_ms: float  # arrival until the first generated token
    total_ms: float
    decode_tokens_per_s: float  # generated tokens after the first, per second of decoding
    # Of ttft_ms: making the session hot (a slot, its KV back from the pool or disk): what preloading can save.
    restore_ms: float = 0.0


class Final(Reply, tag="final"):
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    # The generation ended with the model's end-of-generation token (its last chunk's token): the session holds
    # it, though no text stands for it. False for the other ends (a stop string's tokens stay in the session too).
    eog: bool = False
    stop: str | None = None  # the request's stop string that ended it (None: another end)


class Error(Reply, tag="error"):
    code: ErrorCode
    message: str
    detail: dict[str, Any] | None = None


def cut_detail(completion_tokens: int, context_tokens: int) -> dict[str, int]:
    """The ``detail`` of an Error that ends a generation after its prompt went into the session: the tokens it
    generated, and the session's whole context now (what a resumed session holds). A refusal never has them."""
    return {"completion_tokens": completion_tokens, "context_tokens": context_tokens}


def is_cut(detail: dict[str, Any] | None) -> bool:
    """True when an Error with this ``detail`` ended a generation that had started (cut_detail)."""
    return detail is not None and "completion_tokens" in detail and "context_tokens" in detail


AnyReply = (
    HelloReply
    | StatusReply
    | SessionsReply
    | SessionOpened
    | Closed
    | Cancelled
    | Chunk
    | Final
    | Error
    | Pong
    | HistoryReply
    | TokensReply
    | TextReply
    | Prefetched
    | Migrated
    | FrameAreaReply
)

_request_decoder = msgspec.msgpack.Decoder(AnyRequest)
_reply_decoder = msgspec.msgpack.Decoder(AnyReply)


def _encode_other(obj: Any) -> Any:
    # Status figures may be numpy scalars; they travel as plain numbers.
    if hasattr(obj, "item") and hasattr(obj, "dtype"):
        return obj.item()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_encode_other)


def encode(message: Request | Reply) -> bytes:
    return _encoder.encode(message)


class _ErrorOfAnyCode(Reply, tag="error"):
    code: str
    message: str
    detail: dict[str, Any] | None = None


_error_of_any_code_decoder = msgspec.msgpack.Decoder(_ErrorOfAnyCode)


def decode_reply(frame: bytes) -> AnyReply:
    """The reply in ``frame``. An Error whose code this version does not know (a newer daemon's) is still an Error,
    its code the plain string: dropping it would leave its request waiting for an answer that came."""
    try:
        return _reply_decoder.decode(frame)
    except msgspec.ValidationError as not_known:
        try:
            other = _error_of_any_code_decoder.decode(frame)
        except msgspec.DecodeError:
            raise not_known from None  # not an Error either: say what failed the first time
        code: Any = other.code  # a plain string where an ErrorCode is expected: error_from_code takes either
        return Error(id=other.id, instance=other.instance, code=code, message=other.message, detail=other.detail)


class RequestDecodeError(Exception):
    """A frame that is not a valid request; carries the error code and a sentence for the sender."""

    def __init__(self, code: ErrorCode, message: str, request_id: int = 0):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


def decode_request(frame: bytes) -> AnyRequest:
    """Decode one request frame, or raise RequestDecodeError saying exactly what is wrong with it."""
    try:
        return _request_decoder.decode(frame)
    except msgspec.DecodeError as exc:
        # Only the error path pays for a second, untyped decode: it tells unknown ops from bad fields.
        try:
            raw = msgspec.msgpack.decode(frame)
        except msgspec.DecodeError:
            raise RequestDecodeError(
                ErrorCode.BAD_REQUEST, f"The frame is not valid msgpack ({exc}); send protocol messages."
            ) from None
        except RecursionError:  # (a traceback in the log for every such frame, and no sentence for its sender)
            raise RequestDecodeError(
                ErrorCode.BAD_REQUEST, "The frame nests maps or arrays too deeply; send protocol messages."
            ) from None
        request_id = raw.get("id", 0) if isinstance(raw, dict) else 0
        # bool is an int in Python, but not on the wire: echoing True back would make the reply undecodable.
        valid_id = isinstance(request_id, int) and not isinstance(request_id, bool) and 0 <= request_id < 2**63
        request_id = request_id if valid_id else 0
        op = raw.get("op") if isinstance(raw, dict) else None
        if not isinstance(raw, dict) or not isinstance(op, str):
            raise RequestDecodeError(
                ErrorCode.BAD_REQUEST,
                "A request must be a msgpack map whose `op` field is a string naming the operation.",
                request_id,
            ) from None
        if op not in REQUEST_OPS:
            known = ", ".join(sorted(REQUEST_OPS))
            raise RequestDecodeError(
                ErrorCode.UNKNOWN_OP, f"Unknown operation {op[:64]!r}; this daemon knows: {known}.", request_id
            ) from None
        raise RequestDecodeError(ErrorCode.BAD_REQUEST, f"Invalid {op!r} request: {exc}.", request_id) from None


REQUEST_OPS = frozenset(cls.__struct_config__.tag for cls in AnyRequest.__args__)
