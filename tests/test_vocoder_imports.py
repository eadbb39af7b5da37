"""vocoder_svc has no import cycles: every import counts, at module level or inside a function."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "vocoder_svc"


def import_graph() -> dict[str, set[str]]:
    mods = {p.stem for p in PKG.glob("*.py")}
    graph = {}
    for name in mods:
        deps = set()
        for node in ast.walk(ast.parse((PKG / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "vocoder_svc":
                deps |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vocoder_svc."):
                deps.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("vocoder_svc.")}
        graph[name] = deps - {name}
    return graph


def test_no_import_cycles():
    graph = import_graph()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, path + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
