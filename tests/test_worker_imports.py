"""gpu_worker's modules import each other without a cycle, counting imports inside functions too: a
function-level import that dodges a cycle hides a module split in the wrong place."""

import ast
from pathlib import Path

PACKAGE = "gpu_worker"
ROOT = Path(__file__).resolve().parent.parent


def import_graph(package: str) -> dict[str, set[str]]:
    """module -> the package's modules it imports, anywhere in its source."""
    folder = ROOT / package
    modules = {f"{package}.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for module in sorted(modules):
        tree = ast.parse((folder / f"{module.split('.')[1]}.py").read_text())
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
        graph[module] = {n for n in names if n in modules and n != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles a depth-first walk meets (empty exactly when the graph has none)."""
    found, done = [], set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in path:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                walk(nxt, path + [nxt])
        done.add(node)

    for module in sorted(graph):
        if module not in done:
            walk(module, [module])
    return found


def test_import_graph_sees_function_level_imports():
    graph = import_graph(PACKAGE)
    assert "gpu_worker.kernels" in graph["gpu_worker.model"]  # `from gpu_worker import kernels`
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]


def test_gpu_worker_has_no_import_cycle():
    assert cycles(import_graph(PACKAGE)) == []
