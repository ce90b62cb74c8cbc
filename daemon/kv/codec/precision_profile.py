"""A model's precision profile: the codings a compressed tier stores its K and V rows at, with the K layers whose
precision the model's answers need at codings of their own, measured once for that model by `kvpool-kv-profile`
(llama/profile_command.py) and refused for any other model.

A profile is a JSON file. The daemon looks for it where ``kv_profile`` says, else beside the model
(``MODEL.gguf.kvprofile.json``, where the command writes it), else among the profiles kvpool ships for the
models it knows (``profiles/``, by the model's fingerprint). Its K layers are named by their order among a saved
state's K layers (cache after cache: a sliding-window model's full-attention layers first), which is how the
codec meets them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import msgspec

from kvpool.daemon.kv.codec.kv_types import StoreType, coding_named

FORMAT = 1
SHIPPED = Path(__file__).resolve().parent / "profiles"
SUFFIX = ".kvprofile.json"


class ProfileError(Exception):
    """A profile that cannot be used: the message names the file and what to do."""


class Measured(msgspec.Struct, kw_only=True):
    """What the command measured (llama/kv_sensitivity.py), kept for people and for docs: the daemon reads none of
    it. KLD is the mean over the scored positions against the f16 KV; the floor is llama.cpp's other f16 attention
    path against it."""

    positions: int  # scored positions
    context: int  # tokens of context each scored turn followed (the snapshot that was compressed)
    floor_kld: float
    floor_top1: float
    kld: float
    top1: float
    vs_f16: float  # a snapshot of ``context`` tokens: its bytes at f16 over its bytes at this profile
    base_kld: float  # every K layer at the profile's k
    lowered: str  # the coding the insensitive K layers were lowered to
    layer_kld: dict[int, float]  # KLD with one K layer alone lowered, by the K layer's order
    layer_saving: dict[int, int]  # bytes lowering it saves in a snapshot of ``context`` tokens


class PrecisionProfile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    kvpool_kv_profile: int  # the file's format (FORMAT)
    model: str  # the model file's name, for people
    fingerprint: str  # the weights it was measured on (llama/model/loading.py fingerprint)
    k: str  # the coding of K layers not named below
    v: str  # the coding of every V layer
    k_layers: dict[int, str] = msgspec.field(default_factory=dict)  # K layers at codings of their own
    measured: Measured | None = None

    def store_type(self) -> StoreType:
        """Raises ValueError for a coding kvpool does not know."""
        base = StoreType(coding_named(self.k), coding_named(self.v))
        return base.with_k_layers({j: coding_named(name) for j, name in self.k_layers.items()})

    def describe(self) -> str:
        layers = ", ".join(f"#{j} {c}" for j, c in sorted(self.k_layers.items())) or "none"
        text = f"K {self.k}, V {self.v}, K layers of their own: {layers}"
        if self.measured:
            m = self.measured
            text += (
                f" (measured: {m.vs_f16:.2f}x f16's conversations at {m.kld / max(m.floor_kld, 1e-12):.2f}x the noise "
                "floor's KLD, "
                f"top-1 {100 * m.top1:.1f} % against the floor's {100 * m.floor_top1:.1f} %)"
            )
        return text


class _Format(msgspec.Struct):
    kvpool_kv_profile: int


def read_profile(path: Path) -> PrecisionProfile:
    """Raises ProfileError naming the file and what is wrong with it (another format first: its fields may be new)."""
    try:
        data = path.read_bytes()
        version = msgspec.json.decode(data, type=_Format).kvpool_kv_profile
        if version != FORMAT:
            raise ProfileError(f"{path} is a precision profile of format {version}; this kvpool reads {FORMAT}")
        profile = msgspec.json.decode(data, type=PrecisionProfile)
    except FileNotFoundError:
        raise ProfileError(f"the precision profile {path} does not exist") from None
    except (OSError, msgspec.DecodeError) as exc:  # (ValidationError is a DecodeError)
        raise ProfileError(f"{path} is no precision profile kvpool can read: {exc}") from None
    try:
        profile.store_type()
    except ValueError as exc:
        raise ProfileError(f"{path}: {exc}") from None
    return profile


def write_profile(profile: PrecisionProfile, path: Path) -> None:
    text = msgspec.json.format(msgspec.json.encode(profile), indent=2)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(text + b"\n")
    partial.replace(path)


def beside(model_path: Path) -> Path:
    """Where the command writes a model's profile by default, and where the daemon looks first."""
    return model_path.with_name(model_path.name + SUFFIX)


def find_profile(configured: str, model_path: Path, fingerprint: str, k_layer_count: int) -> PrecisionProfile:
    """The profile for the model at ``model_path``: the file ``configured`` names, else the one beside the model,
    else the one kvpool ships for it. Raises ProfileError saying what was looked for and how to make one."""
    make = f"measure one with `kvpool-kv-profile --model {model_path}` (it writes {beside(model_path)})"
    if configured:
        path = Path(configured).expanduser()
        candidates = [path] if path.is_file() else []
        if not candidates:
            raise ProfileError(f"kv_profile = {configured!r}: the file does not exist; {make}, or name another file")
    else:
        candidates = [p for p in (beside(model_path),) if p.is_file()]
        candidates += sorted(SHIPPED.glob("*" + SUFFIX)) if SHIPPED.is_dir() else []
    for path in candidates:
        profile = read_profile(path)
        if profile.fingerprint == fingerprint:
            _check_layers(profile, path, k_layer_count)
            return profile
        if configured or path == beside(model_path):
            raise ProfileError(
                f"the precision profile {path} was measured for another model ({profile.model}, fingerprint "
                f"{profile.fingerprint}), not {model_path.name} (fingerprint {fingerprint}); {make}"
            )
    raise ProfileError(
        f"a tier stores by the precision profile, and there is none for {model_path.name} (fingerprint {fingerprint}): "
        f"none at {beside(model_path)}, and kvpool ships none for it; {make}, or choose a store type"
    )


def _check_layers(profile: PrecisionProfile, path: Path, k_layer_count: int) -> None:
    beyond = sorted(j for j in profile.k_layers if not 0 <= j < k_layer_count)
    if beyond:
        raise ProfileError(f"{path} names K layers {beyond}, and the model has {k_layer_count}")


def added_kld(base_kld: float, layer_kld: Mapping[int, float]) -> dict[int, float]:
    """The KLD lowering each K layer alone adds over the base's (none below zero: that is noise)."""
    return {j: max(0.0, kld - base_kld) for j, kld in layer_kld.items()}


def by_price(base_kld: float, layer_kld: Mapping[int, float], saving: Mapping[int, int]) -> list[int]:
    """The K layers that save bytes lowered, cheapest first: the KLD lowering each adds alone per byte it saves."""
    cost = {j: c for j, c in added_kld(base_kld, layer_kld).items() if saving.get(j, 0) > 0}
    return sorted(cost, key=lambda j: (cost[j] / saving[j], j))


def choose_lowered(
    base_kld: float, layer_kld: Mapping[int, float], saving: Mapping[int, int], most_kld: float
) -> list[int]:
    """The K layers to lower, cheapest in KLD per byte saved first, while the KLDs their lowering adds, each
    measured alone, sum to at most ``most_kld`` over the base's (lowering two layers costs about what each costs
    alone; the command measures the sum it chose)."""
    cost = added_kld(base_kld, layer_kld)
    chosen, total = [], base_kld
    for j in by_price(base_kld, layer_kld, saving):
        if total + cost[j] > most_kld:
            continue
        chosen.append(j)
        total += cost[j]
    return chosen
