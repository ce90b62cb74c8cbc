"""Memory is planned, not discovered: what the daemon will use, computed from the GGUF metadata and the
config before anything is loaded, and refused at start when it exceeds `memory_limit`.

    weights   the GGUF file (memory-mapped; every page is read while decoding)
    hot KV    K and V (at cache_type_k/_v) for the unified cells of every layer; sliding-window layers
              hold only the window per slot plus one batch (llama.cpp's non-full SWA cache)
    compute   llama.cpp's graph buffer for one batch, plus one logits row per slot
    pool      the shared-memory segment (reserved in full at start)
    runtime   the Python process itself: interpreter, numpy, pyzmq, llama.cpp's code (measured)
The spill directory is on disk: it is shown, not counted.

With RPC workers (docs/rpc.md) the layers placed on them take their weights, their part of the KV and a graph
buffer there: the plan then has a remote part per worker, and memory_limit applies to the local part only. The
weights of a remote layer are read from the local file once, at load, to be sent (page cache, not resident).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvpool.daemon.config import Config, sequence_count
from kvpool.daemon.kv.codec.kv_types import kv_type
from kvpool.daemon.llama.gguf_meta import read_metadata, read_tensor_sizes
from kvpool.daemon.llama.projector import plan_projector
from kvpool.daemon.rpc.placement import LOCAL, layer_of, place_layers

F32 = 4
RUNTIME_BYTES = 64 << 20  # measured: a kvpoold with the tiny test model, before its pool, is ~60 MiB PSS
GLOBAL_LAYER_EVERY = {"gemma3": 6}
# libmtmd, its warm-up encode and the frames being read and prepared, beside the projector's file, its encoder's
# buffer and the media cache. Measured (bench/vision.py, configs/edge-2gb.toml, a SigLIP-base-sized projector):
# PSS 954 MiB with a full 16 MiB cache, against 907 MiB planned without this.
MEDIA_RUNTIME_BYTES = 48 << 20  # sliding-window architectures: every Nth layer attends globally


@dataclass(frozen=True)
class RemotePart:
    """What one worker holds: its share of the weights, of the hot KV, and its graph buffer."""

    endpoint: str
    layers: int  # repeating layers placed on it (the output layer is counted in `output`)
    output: bool
    weights: int
    hot_kv: int
    compute: int

    @property
    def total(self) -> int:
        return self.weights + self.hot_kv + self.compute


@dataclass(frozen=True)
class MemoryPlan:
    weights: int
    hot_kv: int
    compute: int
    pool: int
    runtime: int
    spill_cap: int
    limit: int
    remote: tuple[RemotePart, ...] = ()
    media: int = 0  # the projector's weights and compute buffer, and the media cache (mmproj)

    @property
    def total(self) -> int:
        return self.weights + self.hot_kv + self.compute + self.pool + self.runtime + self.media

    @property
    def fits(self) -> bool:
        return not self.limit or self.total <= self.limit

    def table(self) -> str:
        def mib(n: int) -> str:
            return f"{n / 2**20:9.1f} MiB"

        rows = [
            ("weights", self.weights),
            ("hot KV", self.hot_kv),
            ("compute", self.compute),
            ("pool", self.pool),
            ("runtime", self.runtime),
            *([("media", self.media)] if self.media else []),
        ]
        lines = [f"  {name:<8} {mib(n)}" for name, n in rows]
        lines.append(
            f"  {'total':<8} {mib(self.total)}"
            + (f"   (memory_limit {mib(self.limit).strip()})" if self.limit else "   (no memory_limit)")
        )
        lines.append(f"  {'spill':<8} {mib(self.spill_cap)}   (on disk, not counted)")
        for part in self.remote:
            where = f"{part.layers} layers" + (" + output" if part.output else "")
            lines.append(
                f"  {'remote':<8} {mib(part.total)}   on {part.endpoint} ({where}: weights {mib(part.weights).strip()}"
                f", hot KV {mib(part.hot_kv).strip()}, compute {mib(part.compute).strip()})"
            )
        return "\n".join(lines)


def sliding_window_cells(context: int, window: int, sequences: int, batch: int) -> int:
    """The cells of a sliding-window layer's cache (llama-kv-cache-iswa.cpp): a window per sequence id and a batch,
    in steps of 256, never more than the context's."""
    return min(context, _round_up(window * sequences + batch, 256))


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


@dataclass(frozen=True)
class ModelShape:
    """What the plan and the KV settings need of a GGUF's metadata."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_k: int
    head_v: int
    n_ff: int
    n_vocab: int
    window: int


def model_shape(model_path: Path) -> ModelShape:
    meta = read_metadata(model_path)
    arch = meta.get("general.architecture", "llama")

    def key(name: str, default: int = 0) -> int:
        value = meta.get(f"{arch}.{name}", default)
        return int(value[0] if isinstance(value, list) else value)

    n_embd = key("embedding_length")
    n_head = max(1, key("attention.head_count", 1))
    tokens = meta.get("tokenizer.ggml.tokens")
    return ModelShape(
        arch=arch,
        n_layer=key("block_count"),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=key("attention.head_count_kv", n_head) or n_head,
        head_k=key("attention.key_length", n_embd // n_head),
        head_v=key("attention.value_length", n_embd // n_head),
        n_ff=key("feed_forward_length", 4 * n_embd),
        n_vocab=len(tokens) if isinstance(tokens, list) else 32000,
        window=key("attention.sliding_window"),
    )


def plan_memory(
    model_path: Path, config: Config, proportions: list[float] | None = None, devices: list[str] | None = None
) -> MemoryPlan:
    """``proportions``: the workers' devices' shares of the offloaded layers when known (their free memory);
    ``devices``: the endpoint of each device once registered (before: one device per rpc_servers entry). With
    ``mmproj``, the projector counts (its file, its encoder's buffer) and the media cache (ProjectorError when
    the setting names no projector)."""
    projector = plan_projector(config.mmproj)
    media = 0
    if projector is not None:
        media = projector.weights + projector.compute + config.media_cache_size + MEDIA_RUNTIME_BYTES
    shape = model_shape(model_path)
    type_k, type_v = kv_type(config.cache_type_k), kv_type(config.cache_type_v)
    arch, n_layer, n_embd, n_head = shape.arch, shape.n_layer, shape.n_embd, shape.n_head
    n_head_kv, n_ff, n_vocab, window = shape.n_head_kv, shape.n_ff, shape.n_vocab, shape.window
    cells = _round_up(config.context_size, 256)
    per_cell_layer = type_k.row_bytes(n_head_kv * shape.head_k) + type_v.row_bytes(n_head_kv * shape.head_v)
    layer_cells = [cells] * n_layer
    if window and arch in GLOBAL_LAYER_EVERY:
        every = GLOBAL_LAYER_EVERY[arch]
        # llama.cpp keeps a window of cells per sequence id: hot slots, shared prefixes and the scratch sequence
        sequences = sequence_count(config.hot_slots, config.prefix_slots, config.determinism.extra_sequences)
        swa_cells = sliding_window_cells(cells, window, sequences, config.batch_size)
        layer_cells = [cells if (il + 1) % every == 0 else swa_cells for il in range(n_layer)]
    layer_kv = [per_cell_layer * c for c in layer_cells]
    # The graph buffer holds a batch's activations (the widest are the feed-forward and the attention rows)
    # and the logits of the rows that are sampled.
    batch = config.batch_size
    activations = F32 * batch * (8 * n_embd + 3 * n_ff + n_head * min(cells, 4096))
    logits = F32 * (config.hot_slots + config.draft_rows) * n_vocab
    weights = model_path.stat().st_size
    remote: list[RemotePart] = []
    if config.rpc_servers:
        placement = place_layers(n_layer, config.rpc_layers, proportions or _shares(config, devices))
        sizes = read_tensor_sizes(model_path)
        # An output layer tied to the token embeddings (no output.weight) is a second copy of them where it runs.
        output_bytes = sizes.get("output.weight", sizes.get("token_embd.weight", 0)) + sizes.get(
            "output_norm.weight", 0
        )
        for device, endpoint in enumerate(devices or config.rpc_servers):
            mine = [il for il in range(n_layer) if placement[il] == device]
            output = placement[n_layer] == device
            part_weights = sum(n for name, n in sizes.items() if layer_of(name) in mine)
            part_weights += output_bytes if output else 0
            remote.append(
                RemotePart(
                    endpoint=endpoint,
                    layers=len(mine),
                    output=output,
                    weights=part_weights,
                    hot_kv=sum(layer_kv[il] for il in mine),
                    compute=(activations if mine or output else 0) + (logits if output else 0),
                )
            )
        local_layers = {il for il in range(n_layer) if placement[il] == LOCAL}
        weights = sum(n for name, n in sizes.items() if layer_of(name) is None or layer_of(name) in local_layers)
        if placement[n_layer] != LOCAL and "output.weight" in sizes:
            weights -= sizes["output.weight"] + sizes.get("output_norm.weight", 0)
        layer_kv = [kv for il, kv in enumerate(layer_kv) if il in local_layers]
    return MemoryPlan(
        weights=weights,
        hot_kv=sum(layer_kv),
        compute=activations + logits,
        pool=config.cache_pool_size,
        runtime=RUNTIME_BYTES,
        spill_cap=config.spill_max_bytes,
        limit=config.memory_limit,
        remote=tuple(remote),
        media=media,
    )


def _shares(config: Config, devices: list[str] | None) -> list[float]:
    """The workers' shares of the offloaded layers before they can be asked for their free memory: tensor_split,
    else equal (kvpoold plans again with the free memory they report once it has reached them)."""
    if config.tensor_split:
        return list(config.tensor_split)
    return [1.0] * len(devices or config.rpc_servers)
