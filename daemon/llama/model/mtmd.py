"""Images and audio through llama.cpp's libmtmd: a projector GGUF (``mmproj``) turns a medium into embeddings that
are decoded into a session like a prompt chunk.

A medium is prepared once when a request brings it (its bitmap made, tokenized as mtmd would: the text it puts
around the medium, e.g. Gemma 3's ``<start_of_image>`` ... ``<end_of_image>``, and how many cells the medium
takes), and encoded only when a step is about to feed it (``encode``: the projector's forward pass, the costly
part). Engine thread only, as the rest of the model.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as lc
import llama_cpp.mtmd_cpp as mtmd
import numpy as np

from kvpool.daemon.kv.positions import MAX_N_POS
from kvpool.daemon.llama.model.backend import route_media_log
from kvpool.daemon.llama.model.loading import ModelLoadError
from kvpool.protocol.file_kinds import AUDIO_KINDS, IMAGE_KINDS, file_kind

IMAGE, AUDIO = "image", "audio"
# The formats a medium's bytes come in: raw frames, PCM, or a file (JPEG, PNG, BMP, GIF; WAV, MP3, FLAC).
RGB, RGBA, PCM_F32, ENCODED = "rgb", "rgba", "pcm_f32", "encoded"


MAX_DECODED_PIXELS = 1 << 24  # a file that decodes to more (4096 x 4096) is refused before it is decoded


def image_size(data: bytes) -> tuple[int, int] | None:
    """An image file's width and height from its header (PNG, GIF, BMP, JPEG), None when it does not say: checked
    before decoding, so that a small file that would decode to gigabytes is refused (a file that does not say is
    refused too: the decoder reads layouts this does not, and would decode it whatever its size)."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return _png_size(data)
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return int.from_bytes(data[6:8], "little"), int.from_bytes(data[8:10], "little")
    if data.startswith(b"BM") and len(data) >= 26:
        if int.from_bytes(data[14:18], "little") == 12:  # an OS/2 header: 16-bit sizes
            return int.from_bytes(data[18:20], "little"), int.from_bytes(data[20:22], "little")
        return abs(int.from_bytes(data[18:22], "little", signed=True)), abs(
            int.from_bytes(data[22:26], "little", signed=True)
        )
    if data.startswith(b"\xff\xd8"):
        return _jpeg_size(data)
    return None


def _png_size(data: bytes) -> tuple[int, int] | None:
    """The size in a PNG's IHDR chunk: the first, or the one after an Apple CgBI chunk (which the decoder reads)."""
    at = 8
    for _ in range(2):
        if at + 16 > len(data):
            return None
        length, kind = int.from_bytes(data[at : at + 4], "big"), data[at + 4 : at + 8]
        if kind == b"IHDR":
            return int.from_bytes(data[at + 8 : at + 12], "big"), int.from_bytes(data[at + 12 : at + 16], "big")
        if kind != b"CgBI":
            return None
        at += 12 + length
    return None


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """The size in a JPEG's start-of-frame segment, walking the segments before it as the decoder does: fill bytes,
    markers without a length, and padding between segments (bytes up to the next 0xFF) included."""
    at = 2
    while at + 1 < len(data):
        if data[at] != 0xFF:  # padding after a segment: the decoder scans on to the next marker
            at += 1
            continue
        marker = data[at + 1]
        if marker == 0xFF:  # a fill byte
            at += 1
        elif marker == 0x01 or 0xD0 <= marker <= 0xD7:  # TEM, RSTn: no length
            at += 2
        elif 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a start of frame: its size
            if at + 9 > len(data):
                return None
            return int.from_bytes(data[at + 7 : at + 9], "big"), int.from_bytes(data[at + 5 : at + 7], "big")
        else:
            at += 2 + int.from_bytes(data[at + 2 : at + 4], "big")
    return None


def _file_kind(data: bytes) -> str:
    """IMAGE or AUDIO when a file's first bytes say it is one llama.cpp decodes (checked before its decoders, whose
    fallback for unknown bytes starts ffprobe), else ""."""
    kind = file_kind(data)
    return IMAGE if kind in IMAGE_KINDS else AUDIO if kind in AUDIO_KINDS else ""


class MediaError(Exception):
    """A medium that cannot be read (its bytes do not match what they claim to be); the message says why."""


@dataclass(frozen=True, slots=True)
class MediumPositions:
    """Where an M-RoPE model puts a piece's cells, relative to the piece's first position ``p``: cell i's four
    sections (t, y, x, z, as llama.cpp's batch takes them) are ``offsets[:, i] + p * moves[:, i]``. ``n_pos``: how
    far the text after it moves on. ``grid``: every cell in time at ``p`` (an image on Qwen2-VL's grid), so the
    session's positions part from its cell indexes there (kv/positions.py); else cell i is at ``p + i`` in time."""

    offsets: np.ndarray  # [4, n_tokens] int32
    moves: np.ndarray  # [4, n_tokens] int32, 0 or 1
    n_pos: int
    grid: bool

    def at(self, first_pos: int) -> np.ndarray:
        return (self.offsets + first_pos * self.moves).astype(np.int32)


@dataclass(eq=False)
class Piece:
    """One piece of a medium as the projector splits it (most media are one; a tiled image or audio over 30 s are
    several): its cells, and its chunk (owned here until ``free``), which ``encode`` turns into embeddings."""

    kind: str
    n_tokens: int  # cells it takes
    non_causal: bool  # its cells attend to each other both ways (decoded in one batch)
    chunk: ctypes.c_void_p | None
    positions: MediumPositions | None = None  # an M-RoPE model's (None: cell i at the piece's position + i)

    def free(self) -> None:
        if self.chunk:
            mtmd.mtmd_input_chunk_free(self.chunk)
            self.chunk = None


@dataclass(eq=False)
class Prepared:
    """A medium tokenized: what the projector makes of it, in order: text tokens it puts around and between (e.g.
    Gemma 3's ``<start_of_image>``, a tiling projector's row separators) and its pieces."""

    kind: str
    segments: list[list[int] | Piece]

    @property
    def pieces(self) -> list[Piece]:
        return [s for s in self.segments if isinstance(s, Piece)]

    def free(self) -> None:
        for piece in self.pieces:
            piece.free()


def _medium_positions(chunk: ctypes.c_void_p, n_tokens: int) -> MediumPositions:
    """An M-RoPE piece's positions as llama.cpp's own helper gives them (mtmd_helper_decode_image_chunk): an
    image's from mtmd_image_tokens_get_decoder_pos, audio's 1D (every section ``p + i``). Read at positions 0 and
    1 to tell the offsets from what moves with the piece's place. Kinds of layout kvpool's positions do not follow
    (cells in time neither all at ``p`` nor at ``p + i``) are refused."""
    n_pos = int(mtmd.mtmd_input_chunk_get_n_pos(chunk))
    image = mtmd.mtmd_input_chunk_get_tokens_image(chunk)
    if not image:
        offsets = np.tile(np.arange(n_tokens, dtype=np.int32), (4, 1))
        return MediumPositions(offsets, np.ones_like(offsets), n_pos, grid=False)
    at0 = np.empty((4, n_tokens), dtype=np.int64)
    at1 = np.empty((4, n_tokens), dtype=np.int64)
    for i in range(n_tokens):
        for out, p in ((at0, 0), (at1, 1)):
            d = mtmd.mtmd_image_tokens_get_decoder_pos(image, p, i)
            out[:, i] = (d.t, d.y, d.x, d.z)  # (the batch's section order: set_position_mrope_2d)
    moves = at1 - at0
    if not np.isin(moves, (0, 1)).all():
        raise MediaError("the projector places the image's cells in a way kvpool cannot follow")
    t, t_moves = at0[0], moves[0]
    if (t == 0).all() and t_moves.all() and 0 < n_pos <= n_tokens:
        grid = True
    elif (t == np.arange(n_tokens)).all() and t_moves.all() and n_pos == n_tokens:
        grid = False
    else:
        raise MediaError(
            "the projector places the image's cells in time in a way kvpool cannot follow (neither all at the "
            "image's first position nor one after another)"
        )
    if grid and n_pos > MAX_N_POS:
        raise MediaError(f"the image spans {n_pos} positions, more than the {MAX_N_POS} a session's tokens can mark")
    return MediumPositions(at0.astype(np.int32), moves.astype(np.int32), n_pos, grid)


class MediaEncoder:
    """The projector of one model: what it reads, and its encodes."""

    def __init__(self, path: Path, model: ctypes.c_void_p, n_embd: int, threads: int, max_tokens: int):
        """``model``: the language model's weights (the projector's output must be its embedding width);
        ``max_tokens``: the most cells one medium may take (a non-causal medium is decoded in one batch)."""
        route_media_log()
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = False
        params.n_threads = threads
        params.print_timings = False
        params.warmup = True  # its compute buffer is reserved now, not at the first encode
        self.path = Path(path)
        self.ctx = mtmd.mtmd_init_from_file(str(path).encode(), model, params)
        if not self.ctx:
            raise ModelLoadError(
                f"llama.cpp could not load the projector {path}: it is not an mmproj GGUF, is damaged, or does not "
                "fit the model (its output width must be the model's embedding width; the log says which)."
            )
        self.n_embd = n_embd
        self.vision = bool(mtmd.mtmd_support_vision(self.ctx))
        self.audio = bool(mtmd.mtmd_support_audio(self.ctx))
        self.sample_rate = int(mtmd.mtmd_get_audio_sample_rate(self.ctx)) if self.audio else 0
        self.mrope = bool(mtmd.mtmd_decode_use_mrope(self.ctx))  # media take four positions per cell
        self.max_tokens = max_tokens
        self.marker = mtmd.mtmd_default_marker()

    # ------------------------------------------------------------------ reading a medium

    def prepare(self, kind: str, fmt: str, data: bytes, width: int, height: int, digest: str) -> Prepared:
        """The medium tokenized, or MediaError; ``digest`` names its content (llama.cpp keeps it as the chunk's
        id)."""
        if (kind == IMAGE and not self.vision) or (kind == AUDIO and not self.audio):
            raise MediaError(f"the projector {self.path.name} does not read {kind}")
        bitmap = self._bitmap(kind, fmt, data, width, height)
        try:
            mtmd.mtmd_bitmap_set_id(bitmap, digest.encode())
            return self._tokenize(kind, bitmap)
        finally:
            mtmd.mtmd_bitmap_free(bitmap)

    def _bitmap(self, kind: str, fmt: str, data: bytes, width: int, height: int) -> ctypes.c_void_p:
        if fmt in (RGB, RGBA):
            if kind != IMAGE:
                raise MediaError(f"{fmt} frames are images, not {kind}")
            channels = 3 if fmt == RGB else 4
            if width <= 0 or height <= 0:
                raise MediaError(f"a {width}x{height} {fmt} frame has no pixels; send one of at least 1x1")
            if len(data) != width * height * channels:
                raise MediaError(
                    f"a {width}x{height} {fmt} frame is {max(width, 0) * max(height, 0) * channels} bytes, "
                    f"not {len(data)}"
                )
            pixels = np.frombuffer(data, dtype=np.uint8)
            if fmt == RGBA:
                pixels = np.ascontiguousarray(pixels.reshape(-1, 4)[:, :3])
            bitmap = mtmd.mtmd_bitmap_init(width, height, pixels.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
        elif fmt == PCM_F32:
            if kind != AUDIO:
                raise MediaError(f"PCM is audio, not {kind}")
            if not data or len(data) % 4:
                raise MediaError(f"PCM float32 is a whole number of 4-byte samples, not {len(data)} bytes")
            samples = np.frombuffer(data, dtype=np.float32)
            if not np.isfinite(samples).all():
                raise MediaError("the PCM holds samples that are not finite numbers")
            bitmap = mtmd.mtmd_bitmap_init_from_audio(
                len(samples), samples.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            )
        elif fmt == ENCODED:
            if _file_kind(data) != kind:
                raise MediaError(
                    f"the {kind}'s bytes are no file of a kind llama.cpp decodes "
                    f"({'JPEG, PNG, BMP, GIF' if kind == IMAGE else 'WAV, MP3, FLAC'})"
                )
            size = image_size(data) if kind == IMAGE else None
            if kind == IMAGE and size is None:
                raise MediaError(
                    "the image's header does not say its size where a PNG, GIF, BMP or JPEG says it (a damaged or "
                    "unusual file); send it as a plain PNG or JPEG"
                )
            if size is not None and size[0] * size[1] > MAX_DECODED_PIXELS:
                raise MediaError(
                    f"the image is {size[0]}x{size[1]} pixels, more than {MAX_DECODED_PIXELS} once decoded; send a "
                    "smaller one (the projector reads it at its own size anyway)"
                )
            buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
            bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self.ctx, buffer, len(data), False)
            if not bitmap:
                raise MediaError(
                    f"the {kind}'s bytes are no file llama.cpp decodes "
                    f"({'JPEG, PNG, BMP, GIF' if kind == IMAGE else 'WAV, MP3, FLAC'}): damaged or cut short?"
                )
            if bool(mtmd.mtmd_bitmap_is_audio(bitmap)) != (kind == AUDIO):
                mtmd.mtmd_bitmap_free(bitmap)
                raise MediaError(f"the file decodes to {'audio' if kind == IMAGE else 'an image'}, not {kind}")
        else:
            raise MediaError(f"unknown format {fmt!r}")
        if not bitmap:
            raise MediaError(f"llama.cpp could not take the {kind}")
        return bitmap

    def _tokenize(self, kind: str, bitmap: ctypes.c_void_p) -> Prepared:
        text = mtmd.mtmd_input_text()
        text.text, text.text_len, text.add_special, text.parse_special = self.marker, len(self.marker), False, True
        chunks = mtmd.mtmd_input_chunks_init()
        segments: list[list[int] | Piece] = []
        prepared = Prepared(kind, segments)
        try:
            bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
            rc = mtmd.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), bitmaps, 1)
            if rc != 0:
                raise MediaError(f"llama.cpp could not tokenize the {kind} (mtmd_tokenize returned {rc})")
            for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                chunk = mtmd.mtmd_input_chunks_get(chunks, i)
                if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t()
                    tokens = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    if segments and isinstance(segments[-1], list):
                        segments[-1].extend(tokens[j] for j in range(n.value))
                    else:
                        segments.append([tokens[j] for j in range(n.value)])
                    continue
                copy = mtmd.mtmd_input_chunk_copy(chunk)
                piece = Piece(
                    kind,
                    int(mtmd.mtmd_input_chunk_get_n_tokens(copy)),
                    bool(mtmd.mtmd_decode_use_non_causal(self.ctx, copy)),
                    copy,
                )
                segments.append(piece)
                if self.mrope:
                    piece.positions = _medium_positions(copy, piece.n_tokens)
                if piece.n_tokens > self.max_tokens:
                    raise MediaError(
                        f"a piece of the {kind} takes {piece.n_tokens} cells, more than one batch holds "
                        f"({self.max_tokens}); raise batch_size"
                    )
            if not prepared.pieces:
                raise MediaError(f"llama.cpp made no {kind} chunk of it")
        except BaseException:
            prepared.free()
            raise
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
        return prepared

    # ------------------------------------------------------------------ encoding

    def encode(self, piece: Piece) -> np.ndarray:
        """The piece's embeddings, [n_tokens, n_embd] float32 (a copy: llama.cpp's buffer is reused)."""
        assert piece.chunk, "a piece is encoded before it is freed"
        rc = mtmd.mtmd_encode_chunk(self.ctx, piece.chunk)
        if rc != 0:
            raise MediaError(f"llama.cpp could not encode the {piece.kind} (mtmd_encode_chunk returned {rc})")
        out = mtmd.mtmd_get_output_embd(self.ctx)
        return np.ctypeslib.as_array(out, shape=(piece.n_tokens, self.n_embd)).copy()

    def close(self) -> None:
        if self.ctx:
            mtmd.mtmd_free(self.ctx)
            self.ctx = None


class EmbeddingBatch:
    """A llama_batch of embeddings (one medium's rows): llama.cpp takes tokens or embeddings in one batch, not both.
    An M-RoPE model's embeddings take four positions each (section-major: all rows' t, then y, x, z), in an array
    of this batch's own that its ``pos`` points to while it lives."""

    def __init__(self, capacity: int, n_embd: int, mrope: bool = False):
        self.capacity, self.n_embd = capacity, n_embd
        self._batch = lc.llama_batch_init(capacity, n_embd, 1)
        b = self._batch
        self.embd = np.ctypeslib.as_array(b.embd, shape=(capacity, n_embd))
        self._own_pos: np.ndarray | None = None
        self._llama_pos = b.pos
        if mrope:
            self._own_pos = np.zeros(4 * capacity, dtype=np.int32)
            b.pos = self._own_pos.ctypes.data_as(ctypes.POINTER(lc.llama_pos))
        self.pos = np.ctypeslib.as_array(b.pos, shape=(capacity,))
        self.logits = np.ctypeslib.as_array(b.logits, shape=(capacity,))
        np.ctypeslib.as_array(b.n_seq_id, shape=(capacity,))[:] = 1
        self._seq_rows = [b.seq_id[i] for i in range(capacity)]

    def fill(self, seq_id: int, rows: np.ndarray, first_pos: int, outputs: int, positions: np.ndarray | None) -> int:
        """The rows of one sequence at ``first_pos`` on, or with an M-RoPE model at ``positions`` ([4, rows]); the
        last ``outputs`` rows give logits. Returns the row to sample from (the last)."""
        n = len(rows)
        assert 0 < n <= self.capacity
        self.embd[:n] = rows
        if self._own_pos is not None:
            assert positions is not None and positions.shape == (4, n), "an M-RoPE model's media take 4 positions"
            self._own_pos[: 4 * n] = positions.reshape(-1)
        else:
            assert positions is None, "positions in sections are an M-RoPE model's"
            self.pos[:n] = np.arange(first_pos, first_pos + n, dtype=np.int32)
        self.logits[:n] = 0
        if outputs:
            self.logits[max(0, n - outputs) : n] = 1
        for i in range(n):
            self._seq_rows[i][0] = seq_id
        self._batch.n_tokens = n
        return n - 1

    def as_llama_batch(self) -> lc.llama_batch:
        return self._batch

    def free(self) -> None:
        self._batch.pos = self._llama_pos  # (llama.cpp frees the array it made)
        lc.llama_batch_free(self._batch)
