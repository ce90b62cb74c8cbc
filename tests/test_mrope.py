"""A model that takes M-RoPE positions (Qwen2-VL's kind) serving images, on a real kvpoold with the suite's tiny
random-weight Qwen2-VL pair (tests/tiny_qwen2vl.py): every cell of an image sits at one position in time and the
text after it moves on by the grid's longer side, not by its cell count (kv/positions.py). The daemon's answers
are compared with llama.cpp's own path (mtmd_helper_eval_chunk_single, which llama-mtmd-cli and llama-server
use), within a tolerance, and its image sessions restore, spill, compress and share prefixes like any other."""

from __future__ import annotations

import ctypes
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.client import Client, Image

from .daemon_process import DaemonProcess, wait_until
from .redis_server import RedisServer, resume_when_free
from .tiny_qwen2vl import build_tiny_qwen2vl, build_tiny_qwen2vl_mmproj, image_grid

WIDE = (np.arange(64 * 96 * 3) % 241).astype(np.uint8).reshape(64, 96, 3)  # 96 wide, 64 high: a 6x4 grid
OTHER = np.ascontiguousarray(WIDE[::-1])
GREEDY = {"temperature": 0.0}
BEFORE, AFTER = "Look: ", " What is it?"
# What llama.cpp's own path and the daemon may differ by (batch shapes and kernels differ; tokens do not).
LOGPROB_TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def qwen2vl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("qwen2vl")
    model, mmproj = folder / "tiny-qwen2vl.gguf", folder / "tiny-qwen2vl-mmproj.gguf"
    wide_heads = folder / "tiny-qwen2vl-heads-32.gguf"  # heads of 32 values: whole q8_0 blocks
    build_tiny_qwen2vl(model)
    build_tiny_qwen2vl(wide_heads, heads=(2, 1))
    build_tiny_qwen2vl_mmproj(mmproj)
    return {"model": model, "wide_heads": wide_heads, "mmproj": mmproj}


@pytest.fixture
def qwen_daemon(start_daemon: Callable[..., DaemonProcess], qwen2vl: dict[str, Path]) -> Callable[..., DaemonProcess]:
    def start(*args: str, model: str = "model", config: str | None = None, name: str = "d") -> DaemonProcess:
        flags = ("--mmproj", str(qwen2vl["mmproj"]), "--context-size", "1024", *args)
        return start_daemon(*flags, model=qwen2vl[model], config=config, name=name)

    return start


class Reference:
    """llama.cpp's own multimodal path in this process: mtmd_tokenize, then every chunk through
    mtmd_helper_eval_chunk_single (which places an image's cells by M-RoPE), then text tokens one by one."""

    def __init__(self, paths: dict[str, Path]):
        import llama_cpp as lc
        import llama_cpp.mtmd_cpp as mtmd

        self.lc, self.mtmd = lc, mtmd
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(str(paths["model"]).encode(), lc.llama_model_default_params())
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_threads = 512, 512, 512, 2
        self.ctx = lc.llama_init_from_model(self.model, params)
        mparams = mtmd.mtmd_context_params_default()
        mparams.use_gpu, mparams.print_timings, mparams.n_threads = False, False, 2
        self.mctx = mtmd.mtmd_init_from_file(str(paths["mmproj"]).encode(), self.model, mparams)
        assert self.mctx and mtmd.mtmd_decode_use_mrope(self.mctx)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))

    def close(self) -> None:
        self.mtmd.mtmd_free(self.mctx)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def logprobs(self, frame: np.ndarray, answer: list[int], shift_text_after: int = 0) -> tuple[int, np.ndarray]:
        """The prompt's cell count, and the log-probabilities before each token of ``answer`` (and after the
        last), [len(answer) + 1, n_vocab]. ``shift_text_after``: put the text after the image that many positions
        further on (the mistake of a daemon that gave each image cell a position of its own)."""
        lc, mtmd = self.lc, self.mtmd
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        height, width = frame.shape[:2]
        pixels = np.ascontiguousarray(frame, dtype=np.uint8)
        bitmap = mtmd.mtmd_bitmap_init(width, height, pixels.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte)))
        prompt = f"{BEFORE}{mtmd.mtmd_default_marker().decode()}{AFTER}".encode()
        text = mtmd.mtmd_input_text()
        text.text, text.text_len, text.add_special, text.parse_special = prompt, len(prompt), True, True
        chunks = mtmd.mtmd_input_chunks_init()
        rows = []
        try:
            bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
            assert mtmd.mtmd_tokenize(self.mctx, chunks, ctypes.byref(text), bitmaps, 1) == 0
            n_past, cells, seen_image = 0, 0, False
            n_chunks = mtmd.mtmd_input_chunks_size(chunks)
            for i in range(n_chunks):
                chunk = mtmd.mtmd_input_chunks_get(chunks, i)
                image = mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE
                if seen_image and not image:
                    n_past += shift_text_after
                    shift_text_after = 0
                seen_image |= image
                cells += mtmd.mtmd_input_chunk_get_n_tokens(chunk)
                new_n_past = lc.llama_pos(n_past)  # (the helper adds a text chunk's tokens to it)
                last = i == n_chunks - 1
                rc = mtmd.mtmd_helper_eval_chunk_single(
                    self.mctx, self.ctx, chunk, n_past, 0, 512, last, ctypes.byref(new_n_past)
                )
                assert rc == 0
                n_past = new_n_past.value
            rows.append(self._logprobs())
            for token in answer:
                batch = lc.llama_batch_init(1, 0, 1)
                try:
                    batch.n_tokens = 1
                    batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = token, n_past, 1, 1
                    batch.seq_id[0][0] = 0
                    assert lc.llama_decode(self.ctx, batch) == 0
                finally:
                    lc.llama_batch_free(batch)
                n_past += 1
                rows.append(self._logprobs())
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)
        return cells, np.stack(rows)

    def _logprobs(self) -> np.ndarray:
        logits = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,)).astype(
            np.float64
        )
        return logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()


@pytest.fixture(scope="module")
def reference(qwen2vl: dict[str, Path]) -> Iterator[Reference]:
    ref = Reference(qwen2vl)
    yield ref
    ref.close()


def test_an_mrope_model_sees_an_image_where_llama_cpp_puts_it(
    qwen_daemon: Callable[..., DaemonProcess], reference: Reference
) -> None:
    nx, ny = image_grid(96, 64)
    assert (nx, ny) == (6, 4)  # wider than high: a swap of x and y, or of cells and positions, shows
    daemon = qwen_daemon()
    with Client(daemon.address) as client, client.open_session() as s:
        served = s.complete([BEFORE, Image(WIDE), AFTER], max_tokens=8, logprobs=5, **GREEDY)
        media = client.status().media
        assert media is not None and media.vision
    cells, expected = reference.logprobs(WIDE, served.tokens)
    assert served.usage.prompt_tokens == cells  # the same cells: the image's 24 and its markers' and the text's
    got = np.array([entry.logprob for entry in served.logprobs])
    want = expected[np.arange(len(served.tokens)), served.tokens]
    assert np.abs(got - want).max() < LOGPROB_TOLERANCE, (got, want)
    for entry, row in zip(served.logprobs, expected, strict=False):
        assert entry.token == int(np.argmax(row))  # greedy, as llama.cpp's own path
        for top in entry.top:
            assert abs(top.logprob - row[top.token]) < LOGPROB_TOLERANCE
    # The check can fail: text that follows the image by its cell count (24) instead of its grid's side (6) reads
    # other logits.
    _, misplaced = reference.logprobs(WIDE, served.tokens, shift_text_after=nx * ny - nx)
    assert np.abs(misplaced[0] - expected[0]).max() > 50 * LOGPROB_TOLERANCE


def test_an_image_session_restores_from_pool_disk_and_a_restart_and_shares_its_system_prompt(
    qwen_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = qwen_daemon("--hot-slots", "1", "--deterministic", "--threads", "2")
    prompt = [BEFORE, Image(WIDE), AFTER]
    with Client(daemon.address) as client:
        with client.open_session() as alone:  # the reference: the same turns with nothing in between
            ref1 = alone.complete(prompt, max_tokens=8, **GREEDY)
            ref2 = alone.complete(" Say more.", max_tokens=8, **GREEDY)
        s = client.open_session()
        first = s.complete(prompt, max_tokens=8, **GREEDY)
        with client.open_session() as other:  # takes the only slot: the image session hibernates to the pool
            other.complete("Something else entirely.", max_tokens=4, **GREEDY)
        assert {x.session: x.tier for x in client.sessions()}[s.id] == "pool"
        computed = client.status().counters.prompt_tokens
        second = s.complete(" Say more.", max_tokens=8, **GREEDY)
        # Only the new text was computed, and the first answer's last token (sampled, not fed yet).
        assert client.status().counters.prompt_tokens - computed == second.usage.prompt_tokens + 1
        assert (first.tokens, second.tokens) == (ref1.tokens, ref2.tokens)  # bit for bit as alone

        system = ["You watch the door camera. ", Image(WIDE), " Be brief."]
        with client.open_session(system_prompt=system) as a:
            answer_a = a.complete(" What is new?", max_tokens=6, **GREEDY)
        before = client.status().counters.prompt_tokens
        with client.open_session(system_prompt=system) as b:
            answer_b = b.complete(" What is new?", max_tokens=6, **GREEDY)
        computed = client.status().counters.prompt_tokens - before
        assert client.status().prefixes.hits >= 1
        assert computed == answer_b.usage.prompt_tokens and answer_b.usage.context_tokens > 24 + computed
        assert answer_a.tokens == answer_b.tokens  # the shared image cells are where the session's own would be
        saved = (s.id, s.token)
    daemon.stop(signal.SIGKILL)
    daemon.start()
    with Client(daemon.address) as client:
        s = client.resume_session(*saved)
        third = s.complete(" And then?", max_tokens=8, **GREEDY)
        media = client.status().media
        assert media is not None and (media.prepared, media.encodes) == (0, 0)  # never saw the pixels again
        assert third.usage.prompt_tokens == len(client.tokenize(" And then?"))
        assert third.usage.context_tokens == second.usage.context_tokens + third.usage.prompt_tokens + 8
    with Client(daemon.address) as client, client.open_session() as alone:  # the same three turns from scratch
        alone.complete(prompt, max_tokens=8, **GREEDY)
        alone.complete(" Say more.", max_tokens=8, **GREEDY)
        assert alone.complete(" And then?", max_tokens=8, **GREEDY).tokens == third.tokens


def test_compressed_snapshots_of_an_mrope_model_keep_its_cells_positions(
    qwen_daemon: Callable[..., DaemonProcess],
) -> None:
    """An M-RoPE model's saved cells carry their x and y (llama_kv_cell_ext): the codec reads those records and
    a session restored from a q8_0 pool snapshot continues from where its image's text left off."""
    daemon = qwen_daemon(
        "--hot-slots", "1", model="wide_heads", config='pool_kv_type = "q8_0"\npool_kv_policy = "always"\n'
    )
    with Client(daemon.address) as client:
        s = client.open_session()
        s.complete([BEFORE, Image(WIDE), AFTER], max_tokens=4, **GREEDY)
        with client.open_session() as other:
            other.complete("Something else entirely.", max_tokens=4, **GREEDY)
        status = client.status()
        assert status.moves.compressions >= 1 and status.pool.compressed_snapshots >= 1
        computed = status.counters.prompt_tokens
        more = s.complete(" Say more.", max_tokens=4, **GREEDY)
        status = client.status()
        assert status.counters.prompt_tokens - computed == more.usage.prompt_tokens + 1  # restored, not recomputed
        assert status.moves.restores_decompressed >= 1 and status.moves.checksum_failures == 0
        s.close()


def test_another_image_is_another_conversation(qwen_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = qwen_daemon()
    with Client(daemon.address) as client, client.open_session() as a, client.open_session() as b:
        one = a.complete([BEFORE, Image(WIDE), AFTER], max_tokens=6, logprobs=1, **GREEDY)
        two = b.complete([BEFORE, Image(OTHER), AFTER], max_tokens=6, logprobs=1, **GREEDY)
    assert one.usage.prompt_tokens == two.usage.prompt_tokens
    assert abs(one.logprobs[0].logprob - two.logprobs[0].logprob) > LOGPROB_TOLERANCE or one.tokens != two.tokens


def test_an_image_session_restores_from_disk_and_roams_through_redis_as_the_session_that_never_left(
    qwen_daemon: Callable[..., DaemonProcess], redis_server: RedisServer
) -> None:
    # A snapshot larger than the 1 MiB pool goes to the spill directory (the tiny model's cell is ~256 bytes).
    story = "The robot rolled along the corridor and noted every door. " * 70  # ~4,100 tokens
    turns = [[story, Image(WIDE), AFTER], " And then?"]
    wide = ("--context-size", "8192", "--deterministic", "--threads", "2")
    remote = f'remote = "{redis_server.url}"\nremote_lease_ms = 1000\nremote_timeout_ms = 500\n'
    ref = qwen_daemon(*wide, name="ref")
    with Client(ref.address, timeout=120) as client, client.open_session() as stay:
        reference = [stay.complete(t, max_tokens=8, **GREEDY).tokens for t in turns]
    ref.stop()
    a = qwen_daemon(*wide, "--hot-slots", "1", "--cache-pool-size", "1MiB", config=remote, name="a")
    b = qwen_daemon(*wide, config=remote, name="b")
    with Client(a.address, timeout=120) as client:
        s = client.open_session()
        first = s.complete(turns[0], max_tokens=8, **GREEDY).tokens
        with client.open_session() as other:
            other.complete("Elsewhere.", max_tokens=4, **GREEDY)
        assert {x.session: x.tier for x in client.sessions()}[s.id] == "disk"
        restores = client.status().moves.restores_disk
        assert s.complete(turns[1], max_tokens=8, **GREEDY).tokens == reference[1]
        assert client.status().moves.restores_disk == restores + 1
        s.complete(" Once more.", max_tokens=8, **GREEDY)
        wait_until(
            lambda: next(i.remote for i in client.sessions() if i.session == s.id) == "current",
            "the remote tier to hold the newest checkpoint",
        )
        saved = (s.id, s.token)
    a.stop(signal.SIGKILL)
    with Client(b.address, timeout=120) as client:
        roamed = resume_when_free(client, *saved).complete(" Last.", max_tokens=8, **GREEDY)
        media = client.status().media
        assert media is not None and (media.prepared, media.encodes) == (0, 0)  # its KV came through Redis
        assert roamed.usage.prompt_tokens == len(client.tokenize(" Last."))
    with Client(b.address, timeout=120) as client, client.open_session() as again:
        for turn in [*turns, " Once more."]:
            again.complete(turn, max_tokens=8, **GREEDY)
        assert first == reference[0] and again.complete(" Last.", max_tokens=8, **GREEDY).tokens == roamed.tokens
