"""Tiny random-weight projector GGUFs (mmproj) that llama.cpp's clip.cpp (libmtmd) loads, for the test suite's
tiny language model (tests/tinymodel.py: n_embd 64), as the suite builds that model: nothing is downloaded.

- ``gemma3``: vision, a SigLIP ViT, 2x2 average pooling and a projection. mtmd wraps each image in the text
  ``<start_of_image>`` ... ``<end_of_image>`` and decodes its embeddings non-causally. 64x64 input: 16 tokens.
- ``mlp``: vision, LLaVA-1.5 (causal, no text around the image). 32x32 input: 16 tokens.
- ``ultravox``: audio, a Whisper encoder, frame stacking and a SwiGLU projector (causal). 16 kHz; any clip of up
  to 30 s is one chunk of 25 tokens.
- ``gemma3+ultravox``: both in one file.

Shapes are numpy's (ggml's ne is the reverse). The constraints that keep clip.cpp from aborting the process: the
patch grid must divide by the pooling, and the audio stack factor must divide 1500.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

# vision defaults: 64x64 input, 8x8 patches -> 8x8 = 64 patches; gemma3 pools 2x2 -> 16 image tokens;
# mlp uses 32x32 input -> 4x4 = 16 patches = 16 image tokens
V_EMBD, V_FF, V_HEAD = 32, 64, 2
A_EMBD, A_FF, A_HEAD = 32, 64, 2
A_MEL = 16  # clip.audio.num_mel_bins, any value in [1, 256]
A_STACK = 60  # must divide 1500 and 3000: 30 s chunk = 3000 mel frames -> 1500 after conv -> 1500/60 = 25 tokens
A_PROJ_HIDDEN = 128  # ultravox mm.a.mlp.1 output; SwiGLU halves it


class _Rng:
    def __init__(self, seed: int, f16: bool = False) -> None:
        self.rng = np.random.default_rng(seed)
        self.dtype = np.float16 if f16 else np.float32  # of the weight matrices (real projector files are F16)

    def w(self, *shape: int, scale: float = 1.0) -> np.ndarray:
        fan_in = shape[-1] if len(shape) > 1 else 1
        return (self.rng.standard_normal(shape, dtype=np.float32) * scale / np.sqrt(fan_in)).astype(self.dtype)

    def b(self, *shape: int) -> np.ndarray:
        return (self.rng.standard_normal(shape) * 0.02).astype(np.float32)


def _ones(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


def _zeros(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.float32)


def _common_hparams(
    w: gguf.GGUFWriter, prefix: str, n_embd: int, n_ff: int, n_layer: int, n_head: int, proj_dim: int, eps: float
) -> None:
    # clip.cpp load_hparams(): all six are read with get_u32/get_f32(..., required=true)
    w.add_uint32(f"clip.{prefix}.embedding_length", n_embd)
    w.add_uint32(f"clip.{prefix}.feed_forward_length", n_ff)
    w.add_uint32(f"clip.{prefix}.block_count", n_layer)
    w.add_uint32(f"clip.{prefix}.projection_dim", proj_dim)  # required key; its value is unused by these types
    w.add_uint32(f"clip.{prefix}.attention.head_count", n_head)
    w.add_float32(f"clip.{prefix}.attention.layer_norm_epsilon", eps)


def _vit_layers(
    w: gguf.GGUFWriter, r: _Rng, prefix: str, n_layer: int, n_embd: int, n_ff: int, k_bias: bool = True
) -> None:
    for i in range(n_layer):
        p = f"{prefix}.blk.{i}."
        w.add_tensor(p + "ln1.weight", _ones(n_embd))
        w.add_tensor(p + "ln1.bias", _zeros(n_embd))
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(p + name + ".weight", r.w(n_embd, n_embd))
            if name != "attn_k" or k_bias:
                w.add_tensor(p + name + ".bias", r.b(n_embd))
        w.add_tensor(p + "ln2.weight", _ones(n_embd))
        w.add_tensor(p + "ln2.bias", _zeros(n_embd))
        # up: numpy (n_ff, n_embd) -> ne [n_embd, n_ff]; down: numpy (n_embd, n_ff) -> ne [n_ff, n_embd].
        # (clip.cpp swaps up/down for mlp/gemma3 when ffn_down's ne[0] == n_embd, i.e. legacy-transposed files)
        w.add_tensor(p + "ffn_up.weight", r.w(n_ff, n_embd))
        w.add_tensor(p + "ffn_up.bias", r.b(n_ff))
        w.add_tensor(p + "ffn_down.weight", r.w(n_embd, n_ff))
        w.add_tensor(p + "ffn_down.bias", r.b(n_embd))


def _vision_keys(
    w: gguf.GGUFWriter,
    image_size: int,
    patch_size: int,
    n_layer: int,
    n_embd_lm: int,
    width: int = V_EMBD,
    ff: int = V_FF,
    heads: int = V_HEAD,
) -> None:
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.image_size", image_size)
    w.add_uint32("clip.vision.patch_size", patch_size)
    _common_hparams(w, "vision", width, ff, n_layer, heads, n_embd_lm, 1e-6)
    # effectively required: load_hparams throws when either has fewer than 3 elements
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])


def add_gemma3(
    w: gguf.GGUFWriter,
    r: _Rng,
    n_embd_lm: int,
    *,
    image_size: int = 64,
    patch_size: int = 8,
    merge: int = 2,
    n_layer: int = 1,
    width: int = V_EMBD,
    ff: int = V_FF,
    heads: int = V_HEAD,
) -> int:
    """Returns the number of image tokens: (image_size / patch_size / merge) ** 2. ``width``, ``ff``, ``heads``:
    the ViT's (the defaults make a tiny one; bench/vision.py makes a SigLIP-base-sized one)."""
    side = image_size // patch_size
    assert side * patch_size == image_size and side % merge == 0, "pool_2d must tile the patch grid exactly"
    _vision_keys(w, image_size, patch_size, n_layer, n_embd_lm, width, ff, heads)
    w.add_uint32("clip.vision.projector.scale_factor", merge)  # optional, default 4 for gemma3
    w.add_bool("clip.use_gelu", True)  # optional; default is gelu_quick
    w.add_tensor("v.patch_embd.weight", r.w(width, 3, patch_size, patch_size))  # conv2d kernel, ne [p, p, 3, n_embd]
    w.add_tensor("v.patch_embd.bias", r.b(width))
    w.add_tensor(
        "v.position_embd.weight", r.w(side * side, width, scale=0.02).astype(np.float32)
    )  # (added: F32)  # optional for gemma3
    _vit_layers(w, r, "v", n_layer, width, ff)
    w.add_tensor("v.post_ln.weight", _ones(width))  # optional
    w.add_tensor("v.post_ln.bias", _zeros(width))
    w.add_tensor("mm.soft_emb_norm.weight", _ones(width))
    # siglip.cpp: mul_mat(transpose(mm_input_proj_w), cur); output dim = ne[0] = n_embd_lm
    w.add_tensor("mm.input_projection.weight", r.w(width, n_embd_lm))
    return (side // merge) ** 2


def add_mlp(
    w: gguf.GGUFWriter,
    r: _Rng,
    n_embd_lm: int,
    *,
    image_size: int = 32,
    patch_size: int = 8,
    n_layer: int = 2,
    hidden: int = 64,
) -> int:
    """LLaVA-1.5 projector. llava.cpp runs n_layer - 1 layers (the penultimate-layer feature), so n_layer=2
    exercises one attention block. Returns the number of image tokens: (image_size / patch_size) ** 2."""
    side = image_size // patch_size
    assert side * patch_size == image_size
    _vision_keys(w, image_size, patch_size, n_layer, n_embd_lm)
    w.add_tensor("v.patch_embd.weight", r.w(V_EMBD, 3, patch_size, patch_size))
    w.add_tensor(
        "v.position_embd.weight", r.w(side * side, V_EMBD, scale=0.02).astype(np.float32)
    )  # required: get_rows(positions)
    w.add_tensor("v.pre_ln.weight", _ones(V_EMBD))  # optional
    w.add_tensor("v.pre_ln.bias", _zeros(V_EMBD))
    _vit_layers(w, r, "v", n_layer, V_EMBD, V_FF)
    w.add_tensor("mm.0.weight", r.w(hidden, V_EMBD))
    w.add_tensor("mm.0.bias", r.b(hidden))
    w.add_tensor("mm.2.weight", r.w(n_embd_lm, hidden))  # clip_n_mmproj_embd(mlp) = mm.2.weight ne[1]
    w.add_tensor("mm.2.bias", r.b(n_embd_lm))
    return side * side


def add_ultravox(w: gguf.GGUFWriter, r: _Rng, n_embd_lm: int, *, n_layer: int = 1, stack: int = A_STACK) -> int:
    """Returns audio tokens per 30-second chunk (every clip up to 30 s is one chunk of 3000 mel frames)."""
    assert 1500 % stack == 0 and 3000 % stack == 0, "else the graph and clip_n_output_tokens disagree -> GGML_ABORT"
    w.add_bool("clip.has_audio_encoder", True)
    _common_hparams(w, "audio", A_EMBD, A_FF, n_layer, A_HEAD, n_embd_lm, 1e-5)
    w.add_uint32("clip.audio.num_mel_bins", A_MEL)
    w.add_uint32("clip.audio.projector.stack_factor", stack)  # required for ultravox
    # whisper conv stem: conv1d kernels numpy (OC, IC, K); biases numpy (OC, 1) so they broadcast over time
    w.add_tensor("a.conv1d.1.weight", r.w(A_EMBD, A_MEL, 3))
    w.add_tensor("a.conv1d.1.bias", r.b(A_EMBD, 1))
    w.add_tensor("a.conv1d.2.weight", r.w(A_EMBD, A_EMBD, 3))
    w.add_tensor("a.conv1d.2.bias", r.b(A_EMBD, 1))
    w.add_tensor("a.position_embd.weight", r.w(1500, A_EMBD, scale=0.02).astype(np.float32))  # ne[1] >= 1500 asserted
    _vit_layers(w, r, "a", n_layer, A_EMBD, A_FF, k_bias=False)  # whisper-enc asserts: ln1/ln2 w+b, q_b, v_b, no k_b
    w.add_tensor("a.post_ln.weight", _ones(A_EMBD))  # optional
    w.add_tensor("a.post_ln.bias", _zeros(A_EMBD))
    w.add_tensor("mm.a.norm_pre.weight", _ones(A_EMBD * stack))
    w.add_tensor("mm.a.mlp.1.weight", r.w(A_PROJ_HIDDEN, A_EMBD * stack))
    w.add_tensor("mm.a.norm_mid.weight", _ones(A_PROJ_HIDDEN // 2))
    w.add_tensor("mm.a.mlp.2.weight", r.w(n_embd_lm, A_PROJ_HIDDEN // 2))  # output dim = ne[1] = n_embd_lm
    return 1500 // stack


def build_tiny_mmproj(
    path: Path,
    kind: str = "gemma3",
    n_embd_lm: int = 64,
    seed: int = 0,
    vision: dict[str, int] | None = None,
    f16: bool = False,
) -> dict[str, int]:
    """Write the projector; returns {"image_tokens": n} and/or {"audio_tokens_per_chunk": n}. ``vision``: the
    gemma3 ViT's shape (add_gemma3's keywords) instead of the tiny one; ``f16``: weight matrices in F16."""
    r = _Rng(seed, f16)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_name(f"kvpool-tiny-mmproj-{kind}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    out: dict[str, int] = {}
    if kind == "gemma3":
        w.add_string("clip.projector_type", "gemma3")
        out["image_tokens"] = add_gemma3(w, r, n_embd_lm, **(vision or {}))
    elif kind == "mlp":
        w.add_string("clip.projector_type", "mlp")
        out["image_tokens"] = add_mlp(w, r, n_embd_lm)
    elif kind == "ultravox":
        w.add_string("clip.projector_type", "ultravox")
        out["audio_tokens_per_chunk"] = add_ultravox(w, r, n_embd_lm)
    elif kind == "gemma3+ultravox":
        # mixed modalities: no clip.projector_type (it would apply to both); one type key per modality
        w.add_string("clip.vision.projector_type", "gemma3")
        w.add_string("clip.audio.projector_type", "ultravox")
        out["image_tokens"] = add_gemma3(w, r, n_embd_lm)
        out["audio_tokens_per_chunk"] = add_ultravox(w, r, n_embd_lm)
    else:
        raise ValueError(kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
