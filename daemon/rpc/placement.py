"""Which device holds each layer of a model split across RPC workers: llama.cpp's rule (llama-model.cpp,
load_tensors), restated so that the memory plan can be made before anything is loaded, and tested.

llama.cpp counts offloaded layers from the end: with ``n_gpu_layers = k`` the output layer and the last ``k - 1``
repeating layers go to the devices, the input embeddings never do. The offloaded layers are spread over the
devices by ``tensor_split`` proportions (or by each device's free memory when none are given), in device order.
"""

from __future__ import annotations

import bisect

LOCAL = -1


def offloaded_layers(rpc_layers: int, n_layer: int) -> int:
    """llama.cpp's ``n_gpu_layers`` for the config's ``rpc_layers`` (-1: every layer and the output)."""
    return n_layer + 1 if rpc_layers < 0 else min(rpc_layers, n_layer + 1)


def place_layers(n_layer: int, rpc_layers: int, proportions: list[float]) -> list[int]:
    """Device index (into the workers' devices, in order) of layers 0..n_layer-1 and of the output layer (index
    n_layer); LOCAL for the ones that stay on this machine's CPU. No devices: everything is local."""
    if not proportions:
        return [LOCAL] * (n_layer + 1)
    offloaded = offloaded_layers(rpc_layers, n_layer)
    first = max(n_layer + 1 - offloaded, 0)
    total = sum(proportions) or float(len(proportions))
    weights = proportions if sum(proportions) else [1.0] * len(proportions)
    bounds, running = [], 0.0
    for w in weights:
        running += w
        bounds.append(running / total)
    placement = []
    for layer in range(n_layer + 1):
        if layer < first or layer - first >= offloaded:
            placement.append(LOCAL)
        else:
            device = bisect.bisect_right(bounds, (layer - first) / offloaded)  # std::upper_bound
            placement.append(min(device, len(bounds) - 1))
    return placement


def layer_of(tensor: str) -> int | None:
    """The repeating layer a tensor belongs to ("blk.7.attn_q.weight" -> 7); None for the others."""
    if tensor.startswith("blk."):
        index = tensor.split(".", 2)[1]
        if index.isdigit():
            return int(index)
    return None
