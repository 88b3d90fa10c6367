"""sinklab's imports run one way (core -> models -> seam -> probe -> stream -> ablate -> lab ->
claims -> report -> serve -> commands -> cli) and form no cycle.

The graph is read from the source with ``ast`` (no import is executed): module-level imports (what
runs when a module is imported), every import but ``TYPE_CHECKING`` ones (a function-level import
hides a cycle, it does not break it), or every import, ``TYPE_CHECKING`` ones too (a type-only
import still makes two modules know each other: no circle of any kind).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "sinklab"

# Layers, lowest first (docs/layout.md#layers): a module may import its own package or a
# lower layer, never a higher one. Every top-level module but the CLI's is core.
ORDER = (
    "core",
    "models",
    "seam",
    "probe",
    "stream",
    "ablate",
    "lab",
    "claims",
    "report",
    "serve",
    "commands",
    "cli",
)
LAYERS = {name: rank for rank, name in enumerate(ORDER)}
# The claims rule (the verdict of an effect's samples, the effects, the sentence that quotes
# them): pure modules an experiment may quote, since they import nothing above probe.
CLAIMS_RULE = {
    "sinklab.claims",
    "sinklab.claims.rules",
    "sinklab.claims.registry",
    "sinklab.claims.effects",
    "sinklab.claims.quote",
}
# The documented exceptions: (importer, imported, why).
ALLOWED_UPWARD = {
    ("sinklab.__main__", "sinklab.cli"): "python -m sinklab runs the CLI",
    ("sinklab.models.loading", "sinklab.seam"): (
        "a model class without SDPA (Gemma 2, gpt-oss) loads with sinklab's attention, which must "
        "be registered with transformers before from_pretrained"
    ),
    **{
        (importer, rule): (
            "an experiment's finding quotes its claim's verdict by the claims rule; the rule's "
            "modules import nothing above probe (test_the_claims_rule_stands_below_ablate)"
        )
        for importer in ("sinklab.ablate.experiments", "sinklab.ablate.density")
        for rule in sorted(CLAIMS_RULE)
    },
}


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def layer(name: str) -> str:
    """The layer of module ``name``: its package under sinklab (models, seam, ...), else core."""
    parts = name.split(".")
    if parts[1:2] == ["__main__"]:
        return "cli"
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "core"


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(body: list[ast.stmt], module_level: bool, typing: bool = False):
    """Yield (import node, at module level) outside ``if TYPE_CHECKING`` blocks (``typing``:
    inside them too, never at module level)."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, module_level
        elif isinstance(node, ast.If) and _is_type_checking(node):
            if typing:
                yield from _walk(node.body, False, typing)
            yield from _walk(node.orelse, module_level, typing)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield from _walk(node.body, module_level and isinstance(node, ast.ClassDef), typing)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from _walk(getattr(node, field, None) or [], module_level, typing)


def _ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def imports(name: str, path: Path, known: set[str], typing: bool = False) -> list[tuple[str, bool]]:
    """(imported sinklab module, at module level) for every import in ``name`` (``typing``:
    ``TYPE_CHECKING`` ones too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_pkg = path.name == "__init__.py"
    out: list[tuple[str, bool]] = []
    for node, top in _walk(tree.body, True, typing):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative import
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            names_only = len(subs) < len(node.names)
            # `from pkg import sub` inside pkg needs only sub; any other name needs pkg's __init__
            if names_only or base not in _ancestors(name) | {name}:
                targets.append(base)
            targets += subs
        for t in targets:
            if t.split(".")[0] != "sinklab":
                continue
            # importing a.b.c runs a, a.b first: the ones not already being imported count
            chain = [a for a in sorted(_ancestors(t)) if a not in _ancestors(name) | {name}]
            out += [(m, top) for m in [*chain, t] if m in known and m != name]
    return out


def graph(module_level: bool, typing: bool = False) -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {
        name: {m for m, top in imports(name, path, known, typing) if top or not module_level}
        for name, path in mods.items()
    }


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@pytest.mark.parametrize(
    ("module_level", "typing"),
    [(True, False), (False, False), (False, True)],
    ids=["module-level", "deferred-too", "type-checking-too"],
)
def test_no_import_cycle(module_level, typing):
    """No cycle at import time, nor via imports deferred into functions (they hide one), nor via
    ``TYPE_CHECKING`` imports (two modules that know each other's types are one module)."""
    cycle = find_cycle(graph(module_level=module_level, typing=typing))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_run_one_way():
    """Every import, deferred and ``TYPE_CHECKING`` ones too, goes down the layer order (or stays
    in its package): ``ablate`` never reaches into ``claims``, ``models`` never into ``seam``."""
    bad = [
        f"{a} ({layer(a)}) imports {b} ({layer(b)})"
        for a, targets in graph(module_level=False, typing=True).items()
        for b in sorted(targets)
        if LAYERS[layer(b)] > LAYERS[layer(a)] and (a, b) not in ALLOWED_UPWARD
    ]
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_the_claims_rule_stands_below_ablate():
    """What ``ablate`` may import of ``claims`` (the rule) imports, deferred and TYPE_CHECKING
    imports too, only the rule itself and packages below ``ablate``: so quoting a verdict in an
    experiment's finding is not a reach into the claims package's measuring half."""
    edges = graph(module_level=False, typing=True)
    for name in sorted(CLAIMS_RULE):
        above = [b for b in edges[name] - CLAIMS_RULE if LAYERS[layer(b)] >= LAYERS["ablate"]]
        assert not above, f"{name} imports {above}"


def test_the_walker_sees_what_it_checks():
    """The checks above can fail: the graph has the known edges, and a planted cycle is found."""
    edges = graph(module_level=True)
    assert "sinklab.probe" in edges["sinklab.ablate.experiments"]
    assert "sinklab.probe.metrics" in edges["sinklab.probe.spec"]
    assert "sinklab.errors" in edges["sinklab.models.rotary"]
    assert "sinklab.models.loading" not in edges["sinklab.meta"]  # TYPE_CHECKING only
    assert "sinklab.corpus" in graph(module_level=False, typing=True)["sinklab.meta"]
    deferred = graph(module_level=False)
    assert "sinklab.probe.run" in deferred["sinklab.commands.probe"]  # inside the command
    assert "sinklab.lab.model" not in edges["sinklab.models.loading"]
    planted = {**edges, "sinklab.errors": edges["sinklab.errors"] | {"sinklab.models.arch"}}
    assert find_cycle(planted) == ["sinklab.errors", "sinklab.models.arch", "sinklab.errors"]
    assert layer("sinklab.report.html") == "report" and layer("sinklab.probe.core") == "probe"
    assert layer("sinklab.corpus") == "core" and layer("sinklab") == "core"
    assert LAYERS[layer("sinklab.claims.registry")] > LAYERS[layer("sinklab.ablate.experiments")]


@pytest.mark.parametrize("name", ["sinklab.models.rotary", "sinklab.meta"])
def test_core_modules_import_no_model_loader(name):
    assert "sinklab.models.loading" not in graph(module_level=False)[name]
