"""The house by job (docs/architecture.md): imports go one way, no module imports itself back, small modules.

Every import counts, a function-level one or one under ``TYPE_CHECKING`` too: a cycle hidden in a function is
still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "blockpred"

#: Each part of the package and the layer it stands on: a module may import its own part and any lower layer,
#: never a higher one, nor another part of its own layer.
LAYERS = {
    "core": 0,       # geometry, errors, choices, cache, events, progress, normalize: the shared vocabulary
    "io": 1, "models": 2, "pipeline": 3, "config": 4, "tuning": 5, "cluster": 5, "run": 6, "bench": 7, "serve": 7,
    "entry": 8,      # cli, process, demo, __init__, __main__
}
CORE = {"geometry", "errors", "choices", "cache", "events", "progress", "normalize"}
ENTRY = {"cli", "process", "demo", "__init__", "__main__"}
MAX_TOP_LEVEL = 12
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def part_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "entry"  # blockpred itself: its __init__
    if len(parts) == 2 and parts[1] in CORE:
        return "core"
    if len(parts) == 2 and parts[1] in ENTRY:
        return "entry"
    if len(parts) == 2 and parts[1] == "config":
        return "config"
    return parts[1]


def imports() -> dict[str, set[str]]:
    """Module -> the modules of blockpred it imports (anywhere in it)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    found: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                candidates = [f"{target}.{alias.name}" for alias in node.names]
                hits = [c for c in candidates if c in modules]
                targets.update(hits or ([target] if target in modules else []))
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name in modules)
        found[name] = {t for t in targets if t != name and t.startswith("blockpred")}
    return found


def test_imports_go_down_the_layers_never_up_or_across():
    wrong = []
    for module, targets in imports().items():
        here = part_of(module)
        for target in targets:
            there = part_of(target)
            if there == here or target == "blockpred":
                continue
            if LAYERS[there] >= LAYERS[here]:
                wrong.append(f"{module} ({here}) imports {target} ({there})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_module_imports_itself_back_through_others():
    graph = imports()
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if target == "blockpred":
                continue
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [node, target]) if target in path
                              else f"{node} -> {target}")
            elif target not in state:
                visit(target, path + [node])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "\n".join(cycles)


def test_at_most_twelve_modules_at_the_top_and_none_over_five_hundred_lines():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long
