"""A tiny random-weight Qwen2-VL pair for the test suite: a ``qwen2vl`` text model (M-RoPE, 4 positions per cell)
and its ``qwen2vl_merger`` projector (mmproj), both loadable by the llama.cpp vendored in llama-cpp-python 0.3.36.

Text model (``build_tiny_qwen2vl``): tests/tinymodel.py's vocabulary (``<unk> <s> </s>`` + 256 byte tokens,
tokenizer model "llama") plus, by default, the two control tokens ``<|vision_start|>`` (259) and
``<|vision_end|>`` (260): mtmd wraps every image of a qwen2vl projector in those two strings and tokenizes them
with parse_special, so with them in the vocabulary each marker is one token (as in the real Qwen2-VL), without
them each is a run of byte tokens. Output rows of the special tokens are zero; weights F32, large output scale.
Qwen2 layout: attention q/k/v biases (optional for llama.cpp, present in real files), no output bias.
``qwen2vl.rope.dimension_sections`` is required (4 ints, in rotary pairs: their sum must be <= head_dim/2, the
real models use [16, 24, 24, 0] of head_dim 128; here the same proportions of head_dim/2), and
rope.dimension_count must equal head_dim (the graph asserts n_embd_head == n_rot).

Projector (``build_tiny_qwen2vl_mmproj``): a Qwen2-VL ViT (two patch-embedding convs, the halves of the
temporal-patch-2 conv3d, no patch bias, no position embedding -- 2D M-RoPE inside the ViT), LayerNorm blocks
with attention biases and a quick-GELU FFN, the merger's LayerNorm (``v.post_ln``) and its MLP ``mm.0`` /
``mm.2`` over 2x2-merged patches (4 * width inputs). Constraints in clip.cpp: spatial merge must be 2, the
(resized) image must be a multiple of patch_size*2, and the image token count is held in [8, 4096] by resizing
(Qwen2-VL's "smart resize": dims rounded to multiples of patch_size*2, scaled up to >= 8 tokens or down to
<= 4096; not settable in the GGUF, only by mtmd_context_params.image_min_tokens / image_max_tokens).

With patch_size 8: a 64x64 RGB image stays 64x64 -> 8x8 patches -> 4x4 = 16 image tokens (nx = ny = 4); the
chunk's n_pos (how far the text position advances) is max(nx, ny) = 4. A 32x32 image is scaled up to 48x48 -> 9.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np

from .tiny_mmproj import V_EMBD, V_FF, V_HEAD, _ones, _Rng, _vision_keys, _vit_layers, _zeros
from .tinymodel import (
    CONTEXT,
    N_EMBD,
    N_FF,
    N_HEAD,
    N_HEAD_KV,
    N_LAYER,
    add_blocks_and_write,
    add_tokenizer,
    vocabulary,
)

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"

PATCH_SIZE = 8
MERGE = 2  # clip.cpp's qwen2vl graph hard-codes 2x2 merging (n_pos / 4)
IMAGE_SIZE = 64  # the documented input: 64x64 -> 16 tokens
MIN_TOKENS, MAX_TOKENS = 8, 4096  # clip.cpp load_hparams: set_limit_image_tokens(8, 4096) for qwen2vl


def mrope_sections(head_dim: int) -> list[int]:
    """Qwen2-VL's [16, 24, 24, 0] (of head_dim 128) scaled to ``head_dim``: t, h, w rotary pairs, summing to
    head_dim/2. 16 -> [2, 3, 3, 0]; 32 -> [4, 6, 6, 0]."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h, 0]


def qwen2vl_vocabulary(markers: bool = True) -> tuple[list[str], list[float], list[int]]:
    tokens, scores, types = vocabulary()
    if markers:
        tokens += [VISION_START, VISION_END]
        scores += [0.0, 0.0]
        types += [int(gguf.TokenType.CONTROL)] * 2
    return tokens, scores, types


def build_tiny_qwen2vl(
    path: Path, seed: int = 0, heads: tuple[int, int] = (N_HEAD, N_HEAD_KV), markers: bool = True
) -> Path:
    """``heads``: attention and KV heads; (4, 2) gives heads of 16 values, (2, 1) heads of 32 (a quantized KV
    cache fits those). ``markers``: add ``<|vision_start|>`` / ``<|vision_end|>`` as control tokens."""
    rng = np.random.default_rng(seed)
    tokens, scores, types = qwen2vl_vocabulary(markers)
    n_vocab = len(tokens)
    n_head, n_head_kv = heads
    head_dim = N_EMBD // n_head
    n_kv = n_head_kv * head_dim

    def w(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(np.float32)

    def b(n: int) -> np.ndarray:
        return (rng.standard_normal(n) * 0.02).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "qwen2vl")
    writer.add_name("kvpool-tiny-qwen2vl")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)  # must equal head_dim (qwen2vl graph: n_embd_head == n_rot)
    writer.add_rope_dimension_sections(mrope_sections(head_dim))  # qwen2vl.rope.dimension_sections, required
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_tokenizer(writer, tokens, scores, types)

    writer.add_tensor("token_embd.weight", w(n_vocab, N_EMBD, scale=np.sqrt(N_EMBD)))
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    output = w(n_vocab, N_EMBD, scale=8.0)  # large logits: a clear argmax, no near-ties in greedy runs
    output[:3] = 0.0
    if markers:
        output[-2:] = 0.0  # the markers are never generated either
    writer.add_tensor("output.weight", output)
    add_blocks_and_write(writer, w, n_kv, bias=b)  # (Qwen2 layout: q/k/v biases)
    return path


def image_grid(width: int, height: int, patch_size: int = PATCH_SIZE) -> tuple[int, int]:
    """The (nx, ny) token grid mtmd makes of a ``width`` x ``height`` image (mtmd-image.cpp
    calc_size_preserved_ratio with align patch_size*2, min 8 / max 4096 tokens). Tokens: nx * ny; n_pos:
    max(nx, ny)."""
    align = patch_size * MERGE
    area = align * align
    min_px, max_px = MIN_TOKENS * area, MAX_TOKENS * area
    w_bar = max(align, math.floor(width / align + 0.5) * align)  # std::round: halves away from zero
    h_bar = max(align, math.floor(height / align + 0.5) * align)
    if w_bar * h_bar > max_px:
        beta = math.sqrt(height * width / max_px)
        h_bar = max(align, math.floor(height / beta / align) * align)
        w_bar = max(align, math.floor(width / beta / align) * align)
    elif w_bar * h_bar < min_px:
        beta = math.sqrt(min_px / (height * width))
        h_bar = math.ceil(height * beta / align) * align
        w_bar = math.ceil(width * beta / align) * align
    return w_bar // align, h_bar // align


def build_tiny_qwen2vl_mmproj(
    path: Path,
    n_embd_lm: int = 64,
    seed: int = 0,
    *,
    n_layer: int = 1,
    patch_size: int = PATCH_SIZE,
    image_size: int = IMAGE_SIZE,
) -> dict[str, int]:
    """Write a ``qwen2vl_merger`` projector; returns {"image_tokens": n} for an ``image_size`` square input
    (64x64 with the defaults -> 16 tokens; for other sizes use ``image_grid``)."""
    r = _Rng(seed)
    width, ff, heads = V_EMBD, V_FF, V_HEAD  # ViT head 16: its 2D rope uses sections of head/4
    hidden = 4 * width  # the merger MLP's hidden width (context_dim * merge**2, as in Qwen2-VL)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_name("kvpool-tiny-mmproj-qwen2vl")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_string("clip.projector_type", "qwen2vl_merger")
    # image_size only seeds the warmup size, which qwen2vl overrides (a 46x46-token image, reserved at load)
    _vision_keys(w, image_size, patch_size, n_layer, n_embd_lm, width, ff, heads)
    w.add_uint32("clip.vision.spatial_merge_size", MERGE)  # optional (default 2); other values break the graph
    # no clip.use_gelu / use_silu: quick-GELU FFN, as Qwen2-VL's ViT
    # conv3d (temporal patch 2) split into two conv2d kernels, numpy (n_embd, 3, p, p); the graph asserts no bias
    w.add_tensor("v.patch_embd.weight", r.w(width, 3, patch_size, patch_size))
    w.add_tensor("v.patch_embd.weight.1", r.w(width, 3, patch_size, patch_size))
    # blocks: ln1/ln2 (weight+bias, LayerNorm for qwen2vl), q/k/v/out with biases (the graph adds q_b/k_b/v_b
    # unconditionally), ffn_up/ffn_down with biases; ffn_down ne[0] = n_ff != n_embd, so no legacy up/down swap
    _vit_layers(w, r, "v", n_layer, width, ff)
    w.add_tensor("v.post_ln.weight", _ones(width))  # the merger's ln_q (optional in clip.cpp)
    w.add_tensor("v.post_ln.bias", _zeros(width))
    w.add_tensor("mm.0.weight", r.w(hidden, 4 * width))  # required, over 2x2 merged patches
    w.add_tensor("mm.0.bias", r.b(hidden))
    w.add_tensor("mm.2.weight", r.w(n_embd_lm, hidden))
    w.add_tensor("mm.2.bias", r.b(n_embd_lm))  # clip_n_mmproj_embd(qwen2vl) = mm.2.bias ne[0]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    nx, ny = image_grid(image_size, image_size, patch_size)
    return {"image_tokens": nx * ny}


if __name__ == "__main__":
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    print(build_tiny_qwen2vl(out / "tiny-qwen2vl.gguf"))
    print(build_tiny_qwen2vl_mmproj(out / "tiny-qwen2vl-mmproj.gguf"))
