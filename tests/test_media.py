"""Images and audio in sessions, on a real kvpoold with the tiny model and tiny projectors built by the suite
(tests/tiny_mmproj.py): frames through shared memory, media by content, tiers, restarts, determinism, refusals."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import struct
import wave
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvpool import protocol as p
from kvpool.client import Audio, Client, Image
from kvpool.client.aio import AsyncClient
from kvpool.client.errors import BadRequest, KvpoolError

from .daemon_process import DaemonProcess, kvpoold_command, run_until_exit, wait_until
from .redis_server import RedisServer, resume_when_free

FRAME = (np.arange(40 * 48 * 3) % 251).astype(np.uint8).reshape(40, 48, 3)  # 48 wide, 40 high: resized by llama.cpp
OTHER = np.ascontiguousarray(FRAME[::-1])
GREEDY = {"temperature": 0.0}


def png(width: int, height: int) -> bytes:
    rows = b"".join(b"\x00" + bytes((x * 7 + y) % 256 for x in range(width * 3)) for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def jpeg(width: int, height: int, fill: bool = False) -> bytes:
    """A minimal baseline grayscale JPEG (all-zero entropy data: a gray picture); ``fill``: a 0xFF fill byte
    before its first segment, which decoders skip."""

    def segment(marker: int, body: bytes) -> bytes:
        return bytes([0xFF, marker]) + struct.pack(">H", len(body) + 2) + body

    tables = segment(0xDB, b"\x00" + bytes([1]) * 64)
    frame = segment(0xC0, struct.pack(">BHHB", 8, height, width, 1) + b"\x01\x11\x00")
    counts = bytes([1] + [0] * 15)
    huffman = segment(0xC4, b"\x00" + counts + b"\x00") + segment(0xC4, b"\x10" + counts + b"\x00")
    scan = segment(0xDA, b"\x01\x01\x00\x00\x3f\x00")
    return b"\xff\xd8" + (b"\xff" if fill else b"") + tables + frame + huffman + scan + bytes(16) + b"\xff\xd9"


def os2_bmp(width: int, height: int) -> bytes:
    """A 24-bit BMP with the 12-byte OS/2 header, whose sizes are 16-bit."""
    stride = (width * 3 + 3) // 4 * 4
    pixels = bytes(stride * height)
    header = struct.pack("<IHHHH", 12, width, height, 1, 24)
    return b"BM" + struct.pack("<IHHI", 14 + 12 + len(pixels), 0, 0, 26) + header + pixels


def test_an_image_files_size_is_read_from_its_header_as_its_decoder_reads_it() -> None:
    from kvpool.daemon.llama.model.mtmd import image_size

    assert image_size(png(5, 3)) == (5, 3)
    assert image_size(jpeg(4200, 4100)) == (4200, 4100)
    assert image_size(jpeg(4200, 4100, fill=True)) == (4200, 4100)  # (a fill byte hid it: decoded unchecked)
    assert image_size(os2_bmp(8, 6)) == (8, 6)  # (read as 32-bit sizes: 524296x1572865, refused)
    odd = bytearray(png(1, 1))
    odd[12:16] = b"CgBI"  # a chunk before IHDR, then no IHDR: what lies at IHDR's offset is not the size
    assert image_size(bytes(odd)) is None
    # An Apple PNG (a CgBI chunk first, which the decoder reads) is sized by the IHDR after it, not its own bytes.
    cgbi = png(4200, 1)[:8] + struct.pack(">I", 4) + b"CgBI" + b"\x50\x00\x20\x06" + b"\x00" * 4 + png(4200, 1)[8:33]
    assert image_size(cgbi) == (4200, 1)
    padded = jpeg(64, 32).replace(b"\xff\xc0", b"\x00\x00\xff\xc0", 1)  # padding between segments: scanned past
    assert image_size(padded) == (64, 32)


def wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((samples * 32767).astype("<i2").tobytes())
    return out.getvalue()


def tone(seconds: float = 1.0) -> np.ndarray:
    return (np.sin(np.arange(int(16000 * seconds)) * 0.05) * 0.3).astype(np.float32)


@pytest.fixture
def media_daemon(
    start_daemon: Callable[..., DaemonProcess], tiny_mmproj: dict[str, Path]
) -> Callable[..., DaemonProcess]:
    def start(*args: str, projector: str = "vision+audio", name: str = "d") -> DaemonProcess:
        return start_daemon("--mmproj", str(tiny_mmproj[projector]), "--context-size", "2048", *args, name=name)

    return start


def media_of(client: Client) -> p.MediaStatus:
    media = client.status().media
    assert media is not None
    return media


def test_a_frame_goes_through_shared_memory_not_the_socket(media_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = media_daemon()
    frame = np.zeros((480, 640, 3), dtype=np.uint8)  # a VGA camera frame: 921,600 bytes
    frame[::7] = 200
    with Client(daemon.address) as client, client.open_session() as s:
        before = client.status().counters.received_bytes
        through_area = s.complete(["What is this? ", Image(frame)], max_tokens=4, **GREEDY)
        area_bytes = client.status().counters.received_bytes - before
        assert media_of(client).frame_areas == 1
        with client.open_session() as inline:
            before = client.status().counters.received_bytes
            medium = p.Medium(kind="image", format="rgb", width=640, height=480, data=frame.tobytes())
            in_message = inline.complete(["What is this? ", medium], max_tokens=4, **GREEDY)
            message_bytes = client.status().counters.received_bytes - before
    assert through_area.text == in_message.text  # the same frame, whichever way it came
    # (each span also holds the two status requests' few hundred bytes)
    assert area_bytes < 4096 and message_bytes > frame.nbytes, (area_bytes, message_bytes)
    assert through_area.usage.prompt_tokens == in_message.usage.prompt_tokens


def test_a_medium_is_read_and_encoded_once_and_a_system_prompt_with_an_image_is_shared(
    media_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = media_daemon()
    system = ["You describe the kitchen camera. ", Image(FRAME), " Be brief."]
    with Client(daemon.address) as client:
        with client.open_session(system_prompt=system) as first:
            a = first.complete(" What is new?", max_tokens=6, **GREEDY)
        media = media_of(client)
        assert (media.prepared, media.encodes) == (1, 1)
        prompt_before = client.status().counters.prompt_tokens
        with client.open_session(system_prompt=system) as second:
            b = second.complete(" What is new?", max_tokens=6, **GREEDY)
        computed = client.status().counters.prompt_tokens - prompt_before
        media = media_of(client)
        assert (media.prepared, media.encodes, media.cache_hits) == (1, 1, 1)  # found by its content, not re-read
        assert client.status().prefixes.hits >= 1
        # The second session computed only its own question: the system prompt and its image came shared.
        assert computed == b.usage.prompt_tokens and b.usage.context_tokens > 16 + computed, (computed, b.usage)
        assert a.text == b.text
        with client.open_session(system_prompt=["You describe the kitchen camera. ", Image(OTHER), " Be brief."]) as c:
            c.complete(" What is new?", max_tokens=6, **GREEDY)
        assert media_of(client).encodes == 2  # another picture is another medium


def test_a_session_with_an_image_hibernates_restores_and_survives_a_restart_without_recomputing(
    media_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = media_daemon("--hot-slots", "1", "--deterministic", "--threads", "2")
    prompt = ["Look: ", Image(FRAME), " and listen: ", Audio(tone()), " What do you notice?"]
    with Client(daemon.address) as client:
        with client.open_session() as alone:  # the reference: the same turns with nothing in between
            ref1 = alone.complete(prompt, max_tokens=8, **GREEDY)
            ref2 = alone.complete(" Say more.", max_tokens=8, **GREEDY)
        s = client.open_session()
        first = s.complete(prompt, max_tokens=8, **GREEDY)
        with client.open_session() as other:  # takes the only slot: the image session hibernates to the pool
            other.complete("Something else entirely.", max_tokens=4, **GREEDY)
        assert {x.session: x.tier for x in client.sessions()}[s.id] == "pool"
        encodes = media_of(client).encodes
        computed = client.status().counters.prompt_tokens
        second = s.complete(" Say more.", max_tokens=8, **GREEDY)
        assert media_of(client).encodes == encodes  # restored, not encoded again
        # Only the new text was computed, and the first answer's last token (sampled, not fed yet).
        assert client.status().counters.prompt_tokens - computed == second.usage.prompt_tokens + 1
        saved = (s.id, s.token)
    assert (first.tokens, second.tokens) == (ref1.tokens, ref2.tokens)  # deterministic: bit for bit as alone
    daemon.stop(signal.SIGKILL)
    daemon.start()
    with Client(daemon.address) as client:
        s = client.resume_session(*saved)
        third = s.complete(" And then?", max_tokens=8, **GREEDY)
        media = media_of(client)
        assert (media.prepared, media.encodes) == (0, 0)  # the restarted daemon never saw the pixels
        assert third.usage.prompt_tokens == len(client.tokenize(" And then?"))
        assert third.usage.context_tokens == second.usage.context_tokens + third.usage.prompt_tokens + 8


def test_deterministic_answers_with_media_do_not_depend_on_the_sessions_beside_them(
    media_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = media_daemon("--hot-slots", "4", "--deterministic", "--threads", "2")
    prompt = ["Look: ", Image(FRAME), " Describe it."]
    with Client(daemon.address) as client:
        with client.open_session() as s:
            alone = s.complete(prompt, max_tokens=16, **GREEDY).tokens

        def beside() -> list[int]:
            with Client(daemon.address) as c, c.open_session() as s:
                return s.complete(prompt, max_tokens=16, **GREEDY).tokens

        async def neighbours() -> None:
            async with await AsyncClient.connect(daemon.address) as ac:
                sessions = [await ac.open_session() for _ in range(2)]
                texts = [
                    sessions[0].complete(["Other: ", Image(OTHER), " go on"], max_tokens=24, **GREEDY),
                    sessions[1].complete("A long unrelated story about boats " * 4, max_tokens=24, **GREEDY),
                ]
                await asyncio.gather(*texts)

        async def together() -> list[int]:
            running = asyncio.ensure_future(neighbours())
            tokens = await asyncio.to_thread(beside)
            await running
            return tokens

        assert asyncio.run(together()) == alone


def test_audio_as_pcm_or_a_wav_file_and_images_as_png(media_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = media_daemon()
    with Client(daemon.address) as client, client.open_session() as s:
        pcm = s.complete(["Hear: ", Audio(tone())], max_tokens=4, **GREEDY)
        with client.open_session() as t:
            from_file = t.complete(["Hear: ", Audio(wav(tone()))], max_tokens=4, **GREEDY)
        # A WAV is decoded to the same number of cells (one 30 s chunk), its samples rounded to 16 bits.
        assert pcm.usage.prompt_tokens == from_file.usage.prompt_tokens
        picture = s.complete([" See: ", Image(png(20, 10))], max_tokens=4, **GREEDY)
        assert picture.usage.completion_tokens == 4
        rgba = np.concatenate([FRAME, np.full((*FRAME.shape[:2], 1), 255, np.uint8)], axis=2)
        with client.open_session() as u, client.open_session() as v:
            assert (
                u.complete([Image(rgba)], max_tokens=4, **GREEDY).text
                == v.complete([Image(FRAME)], max_tokens=4, **GREEDY).text
            )


def test_a_causal_projector_and_a_prompt_that_ends_with_its_image(media_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = media_daemon(projector="vision")
    with Client(daemon.address) as client, client.open_session() as s:
        media = media_of(client)
        assert media.vision and not media.audio
        ended = s.complete(["Describe: ", Image(FRAME)], max_tokens=4, **GREEDY)  # the last cell is the image's
        assert ended.usage.completion_tokens == 4 and ended.usage.prompt_tokens > 16
        with pytest.raises(KvpoolError) as refused:
            s.complete(["Hear: ", Audio(tone())], max_tokens=4)
        assert refused.value.code == "MEDIA_UNSUPPORTED" and "reads images only" in refused.value.message
        assert s.complete(" and then", max_tokens=4, **GREEDY).usage.completion_tokens == 4  # nothing was lost


def test_media_refused_with_a_sentence_and_the_daemon_serves_on(
    start_daemon: Callable[..., DaemonProcess], media_daemon: Callable[..., DaemonProcess]
) -> None:
    text_only = start_daemon(name="text")
    with Client(text_only.address) as client, client.open_session() as s:
        assert client.status().media is None
        with pytest.raises(KvpoolError) as refused:
            s.complete(["Look: ", Image(FRAME)], max_tokens=4)
        assert refused.value.code == "MEDIA_UNSUPPORTED" and "--mmproj" in refused.value.message
        assert s.complete("still here", max_tokens=2).usage.completion_tokens == 2
    daemon = media_daemon()
    with Client(daemon.address) as client, client.open_session() as s:
        bad = [
            (p.Medium(kind="image", format="rgb", width=48, height=40, data=FRAME.tobytes()[:-1]), "5760 bytes"),
            (p.Medium(kind="image", format="encoded", data=b"not a picture at all"), "no file"),
            (p.Medium(kind="audio", format="pcm_f32", data=b"\x00\x00\x80"), "4-byte samples"),
            (p.Medium(kind="audio", format="encoded", data=png(4, 4)), "no file"),
            (
                p.Medium(kind="image", format="rgb", width=2, height=2, area="/kvpool-frames-elsewhere", length=12),
                "not this connection's",
            ),
            (p.Medium(kind="image", format="rgb", width=2, height=2), "no bytes"),
        ]
        for medium, said in bad:
            with pytest.raises(BadRequest) as refused:
                s.complete(["Look: ", medium], max_tokens=2)
            assert said in refused.value.message, refused.value.message
        with pytest.raises(BadRequest):  # a frame of the wrong shape is refused before it is sent
            s.complete([Image(FRAME[:, :, :2])], max_tokens=2)
        nan = np.full(160, np.nan, dtype=np.float32)
        with pytest.raises(BadRequest) as refused:
            s.complete([Audio(nan)], max_tokens=2)
        assert "finite" in refused.value.message
        assert s.history() == []  # nothing refused was applied
        assert s.complete(["Look: ", Image(FRAME)], max_tokens=2, **GREEDY).usage.completion_tokens == 2
        media = media_of(client)
        assert media.cached == 1  # the refused media left nothing pinned behind


def test_check_config_and_status_say_what_is_served(
    short_tmp: Path, tiny_model: Path, tiny_mmproj: dict[str, Path]
) -> None:
    address = f"ipc://{short_tmp}/k.sock"
    check = run_until_exit(
        kvpoold_command(tiny_model, address, "--mmproj", str(tiny_mmproj["vision+audio"]), "--check-config")
    )
    assert check.returncode == 0 and "images and audio served" in check.stderr
    assert "media" in check.stderr  # the memory plan counts the projector and the media cache
    plain = run_until_exit(kvpoold_command(tiny_model, address, "--check-config"))
    assert plain.returncode == 0 and "no projector (mmproj): text only" in plain.stderr
    missing = run_until_exit(kvpoold_command(tiny_model, address, "--mmproj", str(short_tmp / "nope.gguf")))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    not_a_projector = run_until_exit(kvpoold_command(tiny_model, address, "--mmproj", str(tiny_model)))
    assert not_a_projector.returncode == 2 and "not a projector" in not_a_projector.stderr


def test_the_asyncio_client_sends_frames_through_its_area(media_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = media_daemon()

    async def run() -> tuple[str, str, int]:
        async with await AsyncClient.connect(daemon.address) as client:
            async with await client.open_session(system_prompt=["Camera: ", Image(FRAME)]) as s:
                first = await s.complete(" what now?", max_tokens=4, **GREEDY)
                frames = [s.generate([" next: ", Image(OTHER)], max_tokens=2, **GREEDY)]
                async for _ in frames[0]:
                    pass
            status = await client.status()
            assert status.media is not None
            return first.text, str(frames[0].final.finish_reason if frames[0].final else ""), status.media.frame_areas

    text, reason, areas = asyncio.run(run())
    with Client(daemon.address) as client, client.open_session(system_prompt=["Camera: ", Image(FRAME)]) as s:
        assert s.complete(" what now?", max_tokens=4, **GREEDY).text == text
    assert reason == "length" and areas >= 1


def first_logprobs(client: Client, parts: list) -> dict[int, float]:
    with client.open_session() as s:
        done = s.complete(parts, max_tokens=1, logprobs=8, **GREEDY)
    return {entry.token: entry.logprob for entry in done.logprobs[0].top}


def test_the_same_image_gives_the_same_logits_and_another_image_other_ones(
    media_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = media_daemon()
    with Client(daemon.address) as client:
        once = first_logprobs(client, ["Look: ", Image(FRAME), " Now."])
        again = first_logprobs(client, ["Look: ", Image(FRAME.copy()), " Now."])  # another array, the same pixels
        other = first_logprobs(client, ["Look: ", Image(OTHER), " Now."])
        assert once.keys() == again.keys() and all(abs(once[k] - again[k]) < 1e-4 for k in once)
        shared = once.keys() & other.keys()
        differ = once.keys() != other.keys() or any(abs(once[k] - other[k]) > 1e-2 for k in shared)
        assert differ, (once, other)


def test_an_image_session_restored_from_the_disk_tier_continues_as_the_session_that_never_left(
    media_daemon: Callable[..., DaemonProcess],
) -> None:
    # A snapshot larger than the 1 MiB pool goes to the spill directory (the tiny model's cell is ~256 bytes).
    daemon = media_daemon(
        "--hot-slots", "1", "--deterministic", "--threads", "2", "--cache-pool-size", "1MiB", "--context-size", "8192"
    )
    story = "The robot rolled along the corridor and noted every door. " * 70  # ~4,100 tokens
    turns = [[story, Image(FRAME), " What is in the picture?"], " And then?"]
    with Client(daemon.address, timeout=120) as client:
        with client.open_session() as stay:
            reference = [stay.complete(t, max_tokens=8, **GREEDY).tokens for t in turns]
        restores = client.status().moves.restores_disk
        with client.open_session() as s:
            first = s.complete(turns[0], max_tokens=8, **GREEDY).tokens
            with client.open_session() as other:
                other.complete("Elsewhere.", max_tokens=4, **GREEDY)
            assert {x.session: x.tier for x in client.sessions()}[s.id] == "disk"
            second = s.complete(turns[1], max_tokens=8, **GREEDY).tokens
        assert client.status().moves.restores_disk > restores
    assert [first, second] == reference


def test_an_image_session_roams_through_redis_and_continues_as_the_session_that_never_left(
    start_daemon: Callable[..., DaemonProcess], tiny_mmproj: dict[str, Path], redis_server: RedisServer
) -> None:
    projector = str(tiny_mmproj["vision+audio"])
    config = f'remote = "{redis_server.url}"\nremote_lease_ms = 1000\nremote_timeout_ms = 500\n'
    common = ("--mmproj", projector, "--hot-slots", "2", "--context-size", "2048", "--threads", "1")
    turns = [["Look: ", Image(FRAME), " What is it?"], " Go on."]
    ref = start_daemon(*common, name="ref")
    with ref.client() as client, client.open_session() as s:
        reference = [s.complete(t, max_tokens=8, **GREEDY).tokens for t in turns]
    ref.stop()
    a = start_daemon(*common, config=config, name="a")
    b = start_daemon(*common, config=config, name="b")
    with a.client() as client:
        s = client.open_session()
        first = s.complete(turns[0], max_tokens=8, **GREEDY).tokens
        wait_until(
            lambda: next(i.remote for i in client.sessions() if i.session == s.id) == "current",
            "the remote tier to hold the newest checkpoint",
        )
        saved = (s.id, s.token)
    a.stop(signal.SIGKILL)
    with b.client() as client:
        second = resume_when_free(client, *saved).complete(turns[1], max_tokens=8, **GREEDY).tokens
        media = media_of(client)
        assert (media.prepared, media.encodes) == (0, 0)  # node B never saw the picture: its KV came through Redis
    assert [first, second] == reference


def test_bad_media_leave_the_session_and_the_daemon_intact(media_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = media_daemon()
    with Client(daemon.address) as client, client.open_session() as s:
        kept = s.complete(["Look: ", Image(FRAME)], max_tokens=2, **GREEDY).usage.context_tokens
        cut = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01" + bytes(40)  # a JPEG cut off after its header
        huge = p.Medium(kind="image", format="rgb", width=1 << 15, height=1 << 15, data=b"\x00" * 12)
        apple = bytearray(png(4, 4))
        apple[12:16] = b"CgBI"
        cases = [
            (p.Medium(kind="image", format="encoded", data=cut), "does not say its size"),
            (p.Medium(kind="image", format="encoded", data=bytes(apple)), "does not say its size"),
            (p.Medium(kind="image", format="encoded", data=jpeg(4200, 4200, fill=True)), "4200x4200"),
            (p.Medium(kind="image", format="encoded", data=png(4, 4)[:30]), "no file llama.cpp"),
            (p.Medium(kind="image", format="rgb", width=0, height=4, data=b""), "0x4 rgb frame"),
            (huge, "32768x32768 rgb frame"),
        ]
        for medium, said in cases:
            with pytest.raises(BadRequest) as refused:
                s.complete(["Look: ", medium], max_tokens=2)
            assert said in refused.value.message, refused.value.message
        # Empty media are refused by the client with a sentence (a TypeError, or the daemon's frame area named).
        for empty, said in (
            (Image(b""), "of no bytes"),
            (Image(np.zeros((0, 5, 3), dtype=np.uint8)), "5x0 pixels"),
            (Audio(np.zeros(0, dtype=np.float32)), "no samples"),
        ):
            with pytest.raises(BadRequest, match=said):
                s.complete(["Look: ", empty], max_tokens=2)
        with pytest.raises(BadRequest) as refused:  # 100 MB: more than any message or frame area carries
            s.complete([Image(np.zeros((5000, 7000, 3), dtype=np.uint8))], max_tokens=2)
        assert "more than a message" in refused.value.message
        assert len(s.history()) == kept  # none of it was applied
        # The task rewrites its frame area after an answer (its region is free then): the next frame is the new one.
        area = client._frame_area()
        assert area is not None
        a = s.complete([" and ", Image(FRAME)], max_tokens=2, **GREEDY)
        area.mapping[: FRAME.nbytes] = OTHER.tobytes()  # where the last frame was
        b = s.complete([" and ", Image(FRAME)], max_tokens=2, **GREEDY)
        assert a.usage.prompt_tokens == b.usage.prompt_tokens
        # The task shrinks its area under the daemon: a refusal, never a SIGBUS; the client then asks for another.
        import posix_ipc

        segment = posix_ipc.SharedMemory(area.name)
        os.ftruncate(segment.fd, 4096)
        segment.close_fd()
        placed = p.Medium(
            kind="image", format="rgb", width=48, height=40, area=area.name, offset=0, length=FRAME.nbytes
        )
        with pytest.raises(BadRequest) as refused:  # (named by hand: writing there would be the task's own SIGBUS)
            s.complete([" and ", placed], max_tokens=2)
        assert "truncated" in refused.value.message
        assert s.complete([" again ", Image(FRAME)], max_tokens=2, **GREEDY).usage.completion_tokens == 2
        assert client._frame_area() is not area  # a new one
        # Audio over 30 s: the projector splits it in two pieces of 25 cells; both are fed, in order.
        long = s.complete([" hear: ", Audio(tone(31.0))], max_tokens=2, **GREEDY)
        assert long.usage.prompt_tokens >= 50 and sum(1 for t in s.history() if t < 0) >= 50
        bomb = bytearray(png(4, 4))
        bomb[16:24] = (60000).to_bytes(4, "big") * 2  # a PNG whose header says 60000 x 60000 pixels
        with pytest.raises(BadRequest) as refused:
            s.complete([Image(bytes(bomb))], max_tokens=2)
        assert "60000x60000" in refused.value.message
        assert s.complete(" still?", max_tokens=2, **GREEDY).usage.completion_tokens == 2
    with Client(daemon.address) as client:
        assert client.status().media is not None  # the daemon serves on


def test_a_client_gets_a_new_frame_area_from_a_restarted_daemon(media_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = media_daemon()
    with Client(daemon.address, reconnect_wait=30) as client:
        s = client.open_session()
        s.complete(["Look: ", Image(FRAME)], max_tokens=2, **GREEDY)
        old = client._frame_area()
        assert old is not None
        daemon.stop()
        daemon.start()
        s = client.resume_session(s.id, s.token)  # (the first request on the new connection)
        after = s.complete([" and: ", Image(OTHER)], max_tokens=2, **GREEDY)
        area = client._frame_area()
        assert area is not None and area.name != old.name  # the old one went with the old daemon
        assert after.usage.completion_tokens == 2 and media_of(client).frame_areas == 1


def test_a_frame_area_taken_back_for_other_connections_costs_the_client_nothing(
    media_daemon: Callable[..., DaemonProcess],
) -> None:
    """Past 64 connections with areas the least recently used area goes: its client's next frame was refused as if
    it had named another's area (BAD_REQUEST; through the gateway, a 400 for a valid image). The daemon says the area
    was taken back, and the clients send once more, through a new area."""
    daemon = media_daemon()

    async def later(client: AsyncClient, session: str, token: str) -> str:
        s = await client.resume_session(session, token)
        return (await s.complete([" and: ", Image(OTHER)], max_tokens=2, **GREEDY)).finish_reason

    with Client(daemon.address) as first, first.open_session() as s:
        s.complete(["Look: ", Image(FRAME)], max_tokens=2, **GREEDY)
        old = first._frame_area()
        aio_session: list[tuple[str, str]] = []

        async def aio_first(client: AsyncClient) -> None:
            t = await client.open_session()
            await t.complete(["Look: ", Image(FRAME)], max_tokens=1, **GREEDY)
            aio_session.append((t.id, t.token))

        async def scenario() -> str:
            async with await AsyncClient.connect(daemon.address) as aio:
                await aio_first(aio)
                others = [Client(daemon.address) for _ in range(64)]
                try:
                    for other in others:  # each asks for an area: the two oldest are taken back
                        with other.open_session() as t:
                            t.complete(["x", Image(FRAME)], max_tokens=1, **GREEDY)
                    assert media_of(first).frame_areas == 64
                    reason = s.complete([" and: ", Image(OTHER)], max_tokens=2, **GREEDY).finish_reason
                    assert reason == "length" and first._frame_area() is not old
                    return await later(aio, *aio_session[0])
                finally:
                    for other in others:
                        other.close()

        assert asyncio.run(scenario()) == "length"


def test_a_media_cache_of_no_bytes_keeps_nothing_once_its_session_lets_go(
    media_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = media_daemon("--media-cache-size", "0")
    with Client(daemon.address) as client:
        with client.open_session() as s:
            s.complete(["Look: ", Image(FRAME)], max_tokens=1, **GREEDY)
        media = media_of(client)  # (it said 1 medium of 4096 bytes past a cache of 0, until the next request)
        assert (media.cached, media.cached_bytes, media.cache_max_bytes) == (0, 0, 0)


def test_threads_sharing_a_client_each_get_the_answer_to_their_own_frame(
    media_daemon: Callable[..., DaemonProcess],
) -> None:
    import threading

    # (deterministic: batched together, the sessions answer bit for bit as alone, so any difference is a mixup)
    daemon = media_daemon("--hot-slots", "4", "--deterministic", "--threads", "2")
    frames = [np.ascontiguousarray(np.roll(FRAME, 7 * i, axis=1)) for i in range(4)]
    with Client(daemon.address) as client:
        alone = []
        for f in frames:
            with client.open_session() as s:
                alone.append(s.complete(["Look: ", Image(f)], max_tokens=6, **GREEDY).tokens)
        together: dict[int, list[int]] = {}

        def ask(i: int) -> None:
            for _ in range(3):
                with client.open_session() as s:
                    together[i] = s.complete(["Look: ", Image(frames[i])], max_tokens=6, **GREEDY).tokens

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
    assert [together[i] for i in range(4)] == alone


def test_the_vision_example_sends_frames_when_the_daemon_sees_and_says_when_it_does_not(
    media_daemon: Callable[..., DaemonProcess], start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    scenes = tmp_path / "scenes.jsonl"
    scenes.write_text('{"scene": "a cat on a chair"}\n{"scene": "a cup on the table"}\n')

    def run(address: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, str(root / "examples" / "vision_captioner.py"), "--address", address,
               "--scenes", str(scenes), "--max-tokens", "8", "--task", "default"]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)

    seeing = media_daemon()
    sent = run(seeing.address)
    assert sent.returncode == 0, sent.stderr
    assert "sending synthetic frames as images" in sent.stdout and sent.stdout.count("[vision] frame") == 2
    with Client(seeing.address) as client:
        media = media_of(client)
        assert media.encodes == 2 and media.frame_areas >= 1  # two frames, through shared memory
    blind = start_daemon(name="blind")
    fallback = run(blind.address)
    assert (
        fallback.returncode == 0
        and "reads text only" in fallback.stdout
        and "describing the scenes as text" in fallback.stdout
    )
