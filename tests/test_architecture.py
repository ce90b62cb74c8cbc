"""The tree's rules, checked statically (no model, no daemon): no import cycles anywhere in the package, type-only
ones included; only the model package imports llama_cpp; the client never imports the daemon."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "kvpool.daemon": ROOT / "daemon",
    "kvpool.client": ROOT / "client",
    "kvpool.protocol": ROOT / "protocol",
    "kvpool.gateway": ROOT / "gateway",
}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def imports_of(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """Every kvpool module ``name`` imports, wherever the import stands (TYPE_CHECKING blocks and functions too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def test_no_import_cycles() -> None:
    """In the daemon, the client, the gateway and the protocol alike."""
    known = modules()
    graph = {name: imports_of(path, name, known) for name, path in known.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*trail[trail.index(nxt) :], nxt])
            elif nxt in graph and not state.get(nxt):
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for start in sorted(graph):
        if not state.get(start):
            visit(start, [start])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_only_the_model_package_imports_llama_cpp() -> None:
    importers = set()
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "llama_cpp" or n.startswith("llama_cpp.") for n in names):
                importers.add(name)
    assert importers, "nothing imports llama_cpp: the rule checks nothing"
    outside = {name for name in importers if not name.startswith("kvpool.daemon.llama.model.")}
    assert not outside, f"only daemon/llama/model/ may import llama_cpp: {sorted(outside)}"
    # The rpc worker runs without libllama: ggml_rpc finds ggml's libraries without importing llama_cpp.
    assert "kvpool.daemon.llama.ggml_rpc" not in importers


def test_the_client_the_gateway_and_the_protocol_never_import_the_daemon() -> None:
    known = modules()
    for name, path in known.items():
        if not name.startswith("kvpool.daemon"):
            assert not {m for m in imports_of(path, name, known) if m.startswith("kvpool.daemon")}, name


def test_no_two_modules_share_a_name() -> None:
    """A name says which module it is, wherever it is quoted; the two programs' `main.py` are the exception
    (docs/architecture.md)."""
    folders = [*PACKAGES.values(), ROOT / "bench", ROOT / "examples"]
    seen: dict[str, list[str]] = {}
    for folder in folders:
        for path in folder.rglob("*.py"):
            if path.name not in ("__init__.py", "main.py"):
                seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_docs_architecture_names_every_module_bench_script_and_page() -> None:
    """docs/architecture.md is the map of the tree: each module of the package, each bench script and each page of
    docs/ is named in it by its file name, and every bench script or page it names exists."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    files = [path for folder in PACKAGES.values() for path in folder.rglob("*.py") if path.name != "__init__.py"]
    files += [*(ROOT / "bench").glob("*.py"), *(ROOT / "docs").glob("*.md")]
    missing = sorted(
        str(path.relative_to(ROOT))
        for path in files
        if not re.search(rf"(?<![\w.-]){re.escape(path.name)}(?![\w])", text)  # the name itself, not its end
    )
    assert missing == [], f"docs/architecture.md does not name: {missing}"
    rows = text[text.index("## The tree") :].splitlines()
    for folder, suffix in (("bench", ".py"), ("docs", ".md")):
        start = next(i for i, row in enumerate(rows) if row.startswith(f"{folder}/"))
        end = next(i for i in range(start + 1, len(rows)) if not rows[i].startswith(" "))
        for name in re.findall(rf"[\w.-]+{re.escape(suffix)}", " ".join(rows[start:end])):
            assert (ROOT / folder / name).exists(), f"docs/architecture.md names {folder}/{name}, which does not exist"


# The KV manager: its facade and the snapshot path behind it, and recovery rebuilding placement at a start.
KV_MANAGER = {
    "kvpool.daemon.kv.manager",
    "kvpool.daemon.kv.checkpoints",
    "kvpool.daemon.kv.room",
    "kvpool.daemon.kv.compression",
    "kvpool.daemon.kv.disk_writes",
    "kvpool.daemon.kv.recovery",
    "kvpool.daemon.kv.new_session",
    "kvpool.daemon.kv.prefix.cache",  # (a shared prefix's own place: its snapshot, its sequence)
}
PLACE_FIELDS = {
    *("slot", "n_kv", "snapshot", "prefix", "prefix_len", "shares_hot", "boundary", "saved_bytes", "cell_positions"),
}
# A session's conversation grows through the KV manager too (KvManager.append): its cells count in it; so do the
# media whose cells it holds uncomputed (they are pinned for it).
CONVERSATION_FIELDS = ("tokens", "media")
LIST_CHANGES = {
    *("append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "__setitem__", "__delitem__"),
    *("update", "setdefault", "popitem"),
}


def test_only_the_kv_manager_moves_a_session() -> None:
    """A session's place changes in kv/place.py only, through moves only the KV manager makes: no other module
    reaches a session's ``place``, imports the moves, or assigns a placement field of anything but itself."""
    known = modules()
    offenders = []
    for name, path in known.items():
        if name == "kvpool.daemon.kv.place":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "place" and name != "kvpool.daemon.kv.sessions":
                offenders.append(f"{name}:{node.lineno} reaches .place")
            if isinstance(node, ast.Assign | ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            else:
                targets = []
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("setattr", "delattr")
                and any(isinstance(a, ast.Constant) and a.value in PLACE_FIELDS for a in node.args)
            ):
                offenders.append(f"{name}:{node.lineno} sets a placement field by name")
            for target in targets:
                for t in ast.walk(target):
                    if (
                        name not in KV_MANAGER
                        and isinstance(t, ast.Attribute)
                        and t.attr in PLACE_FIELDS
                        and not (isinstance(t.value, ast.Name) and t.value.id == "self")
                    ):
                        offenders.append(f"{name}:{t.lineno} assigns .{t.attr}")
                    if name.startswith("kvpool.daemon.") and name not in KV_MANAGER and _session_tokens(t, target):
                        offenders.append(f"{name}:{t.lineno} changes a session's .{t.attr}")  # type: ignore[attr-defined]
            if (
                name.startswith("kvpool.daemon.")
                and name not in KV_MANAGER
                and isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in LIST_CHANGES
                and _is_session_tokens(node.func.value)
            ):
                offenders.append(
                    f"{name}:{node.lineno} changes a session's .{node.func.value.attr} ({node.func.attr})"  # type: ignore[attr-defined]
                )
        if "kvpool.daemon.kv.place" in imports_of(path, name, known) and name not in KV_MANAGER | {
            "kvpool.daemon.kv.sessions"
        }:
            offenders.append(f"{name} imports the moves (kv/place.py)")
    assert not offenders, "\n".join(offenders)


def _is_session_tokens(node: ast.AST) -> bool:
    """``<something>.session.tokens``, ``s.tokens``, ``session.tokens`` (how the daemon names a session), or its
    ``media``."""
    if not (isinstance(node, ast.Attribute) and node.attr in CONVERSATION_FIELDS):
        return False
    owner = node.value
    if isinstance(owner, ast.Name):
        return owner.id in ("s", "session", "victim", "giver", "r")
    return isinstance(owner, ast.Attribute) and owner.attr == "session"


def _session_tokens(node: ast.AST, target: ast.AST) -> bool:
    """An assignment to a session's tokens, whole or a slice of them."""
    if _is_session_tokens(node):
        return node is target or isinstance(target, ast.Subscript | ast.Tuple | ast.List)
    return False


def test_a_sessions_place_is_read_only_outside_the_kv_manager() -> None:
    from kvpool.daemon.kv.sessions import Session

    s = Session(id="s", token="t", task="default", entry=0, context_limit=64)
    for name in PLACE_FIELDS:
        try:
            setattr(s, name, 1)
        except AttributeError:
            continue
        raise AssertionError(f"Session.{name} can be assigned")


def test_the_scheduling_decision_is_pure() -> None:
    """engine/schedule.py decides from its view alone: it reaches no llama.cpp, pool, KV manager or queue."""
    known = modules()
    name = "kvpool.daemon.engine.schedule"
    allowed = {"kvpool.daemon.engine.cost_model", "kvpool.daemon.engine.step_work", "kvpool.daemon.kv.pool.layout"}
    assert imports_of(known[name], name, known) <= allowed
