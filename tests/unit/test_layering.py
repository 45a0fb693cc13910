"""The import graph of src/dsakv: no cycle between modules, and no import against the layer order

    util, errors < spec < plan < config < cache < model < engine < pipeline
        < disagg.protocol < disagg.transfer < {disagg.prefill | disagg.decode} < disagg.router
        < serve < testing < cli < api (and __main__; dsakv itself, the public API's lazy names, sits with api)

(a module may import its own layer and the layers below it; config/ slots in when it exists). Inside disagg:
prefill and decode never import each other (they share one rank), and the router imports neither disagg.transfer
nor pipeline. Every `import` counts, at module level, inside functions and under TYPE_CHECKING alike: a lazy
import hides a dependency from the interpreter, not from the design. Read with ast; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = next(p / "src" for p in Path(__file__).resolve().parents if (p / "src" / "dsakv").is_dir())
# one entry per rank; layers in one tuple share a rank and may not import each other
ORDER: tuple[tuple[str, ...], ...] = (
    ("util",),
    ("spec",),
    ("plan",),
    ("config",),
    ("cache",),
    ("model",),
    ("engine",),
    ("pipeline",),
    ("disagg.protocol",),
    ("disagg.transfer",),
    ("disagg.prefill", "disagg.decode"),
    ("disagg.router",),
    ("serve",),
    ("testing",),
    ("cli",),
    ("api",),
)
LAYERS = tuple(name for rank in ORDER for name in rank)
RANK = {name: i for i, rank in enumerate(ORDER) for name in rank} | {"errors": 0, "__main__": len(ORDER)}
# (importer layer, imported layer) pairs refused even though the order allows them
FORBIDDEN = {("disagg.router", "disagg.transfer"), ("disagg.router", "pipeline")}
# (module, module) imports against the order that are allowed, each for its reason (not edges of the graph)
FACADE = {("dsakv.plan", "dsakv.api.plan"): "the planner package is callable: dsakv.plan(...) is the API's plan()"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / "dsakv").rglob("*.py"))}


def layer(mod: str) -> str:
    """The layer of dsakv.X.Y... is X, of dsakv.disagg.S.Y... is disagg.S (dsakv itself, the version string and the
    public API's lazy names, sits with api at the top; dsakv.disagg itself, a docstring, at disagg.protocol's rank)."""
    parts = mod.split(".")
    if len(parts) == 1:
        return "api"
    if parts[1] == "disagg":
        return f"disagg.{parts[2]}" if len(parts) > 2 else "disagg.protocol"
    return parts[1]


def refused(src: str, dst: str) -> bool:
    """Whether layer `src` may not import layer `dst`: a higher rank, a sibling of the same rank, or FORBIDDEN."""
    siblings = RANK[dst] == RANK[src] and dst != src and {src, dst} <= set(LAYERS)
    return RANK[dst] > RANK[src] or siblings or (src, dst) in FORBIDDEN


def imports_of(mod: str, path: Path, known: set[str]) -> set[tuple[str, int]]:
    """(imported dsakv module, line) for every import statement in the file, resolved to the deepest module."""
    tree = ast.parse(path.read_text(), str(path))
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[tuple[str, int]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import sub` imports the submodule pkg.sub where it is one
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        else:
            continue
        for name in names:
            if name == "dsakv" or name.startswith("dsakv."):
                while name not in known and "." in name:  # `import dsakv.x.y.Class`-like spellings
                    name = name.rpartition(".")[0]
                out.add((name, node.lineno))
    return out


def graph() -> tuple[dict[str, set[str]], list[str]]:
    mods = modules()
    known = set(mods)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    violations = []
    for mod, path in mods.items():
        for target, line in sorted(imports_of(mod, path, known)):
            if target == mod or (mod, target) in FACADE:
                continue
            edges[mod].add(target)
            src_layer, dst_layer = layer(mod), layer(target)
            if refused(src_layer, dst_layer):
                violations.append(
                    f"{path.relative_to(SRC)}:{line}: {mod} ({src_layer}) imports {target} ({dst_layer}), "
                    f"against the order {' < '.join('|'.join(r) for r in ORDER)} (refused too: {sorted(FORBIDDEN)})"
                )
    return edges, violations


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_module_is_in_a_layer():
    unknown = sorted({layer(m) for m in modules()} - set(RANK))
    assert not unknown, f"packages {unknown} are in no layer: add them to LAYERS in {Path(__file__).name}"


def test_no_import_against_the_layer_order():
    _edges, violations = graph()
    assert not violations, "\n".join(violations)


def test_no_import_cycle_between_modules():
    edges, _ = graph()
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_rules_refuse_siblings_and_the_router_edges():
    """The order as data: decode and prefill are siblings (neither imports the other), the router sits above both
    yet may not import transfer or pipeline, and config slots in between plan and cache."""
    assert refused("disagg.decode", "disagg.prefill") and refused("disagg.prefill", "disagg.decode")
    assert not refused("disagg.decode", "disagg.transfer") and not refused("disagg.prefill", "pipeline")
    assert refused("disagg.router", "disagg.transfer") and refused("disagg.router", "pipeline")
    assert not refused("disagg.router", "disagg.protocol") and not refused("disagg.router", "engine")
    assert refused("pipeline", "disagg.protocol") and not refused("disagg.protocol", "pipeline")
    assert refused("plan", "config") and not refused("cache", "config") and not refused("config", "plan")
    assert layer("dsakv.disagg.decode.stage") == "disagg.decode" and layer("dsakv.pipeline.runner") == "pipeline"
    assert refused("cli", "api") and not refused("api", "cli") and layer("dsakv") == "api"


def test_the_checker_sees_lazy_relative_and_from_imports(tmp_path):
    """The walk finds function-level, `from pkg import submodule` and relative imports (so the tests above can
    fail), and the cycle finder reports a two-module cycle."""
    known = {"dsakv.cli.serve_cmd", "dsakv.cli.disagg_roles", "dsakv.cli", "dsakv.engine.engine", "dsakv.cli.x"}
    f = tmp_path / "x.py"
    f.write_text(
        "from dsakv.cli import disagg_roles\n"
        "from . import serve_cmd\n"
        "def run():\n"
        "    import dsakv.engine.engine\n"
        "    from dsakv.engine.engine import Engine\n"
    )
    got = imports_of("dsakv.cli.x", f, known)
    assert got == {
        ("dsakv.cli.disagg_roles", 1),
        ("dsakv.cli.serve_cmd", 2),
        ("dsakv.engine.engine", 4),
        ("dsakv.engine.engine", 5),
    }
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_cli_backend_choices_are_the_registry():
    """cli/options.py takes the --transfer-backend choices from dsakv.config's lazy table ("name" ->
    "module:Class"), without importing the transfer layer (so `dsakv --help` stays light); they must be the
    registry's names, each resolving to the class registered under it."""
    from dsakv.cli.options import BACKEND_CHOICES
    from dsakv.config import TRANSFER_BACKENDS
    from dsakv.disagg.transfer.backends import backend_class, backend_names

    assert set(BACKEND_CHOICES) == set(TRANSFER_BACKENDS) == set(backend_names()) == {"local", "mooncake", "nixl"}
    for name, where in TRANSFER_BACKENDS.items():
        cls = backend_class(name)
        assert cls.name == name and f"{cls.__module__}:{cls.__qualname__}" == where
