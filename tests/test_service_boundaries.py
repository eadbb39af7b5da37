"""The services are peers: none imports another, what they share lives in chorus/, a
frontend process does not load torch, and no module imports itself back through others."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("scheduler_svc", "gpu_worker", "vocoder_svc", "gateway_svc")
PACKAGES = ("chorus", *SERVICES)
# These compose the services (start them, bench them) or are generated: they may import any of them.
COMPOSERS = ("chorus.v1", "chorus.cli", "chorus.colocate", "chorus.launcher", "chorus.layout", "chorus.bench")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imported(module: str) -> set[str]:
    """Every project module `module` imports, at module level or inside a function (imports only
    a type checker runs are left out): `from a import b` names a.b where that is a module."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node)
            for child in node.body for n in ast.walk(child)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {n for n in names if n in MODULES and n != module}


GRAPH = {m: _imported(m) for m in MODULES}


def _package(module: str) -> str:
    return module.split(".")[0]


def _composes(module: str) -> bool:
    return any(module == c or module.startswith(c + ".") for c in COMPOSERS)


def _crossings(package: str) -> list[str]:
    return sorted(f"{m} imports {t}" for m, targets in GRAPH.items()
                  if _package(m) == package and not _composes(m)
                  for t in targets if _package(t) in SERVICES and _package(t) != package)


@pytest.mark.parametrize("package", [*SERVICES, "chorus"])
def test_no_package_imports_a_service_package_but_its_own(package):
    crossings = _crossings(package)
    assert not crossings, "\n".join(crossings)


def _cycles() -> list[tuple[list[str], set[str]]]:
    """One cycle per strongly connected component of the import graph (Tarjan), as a path, with
    the component's modules."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(set(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(GRAPH)))
    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:  # a shortest way back to the first module, within the component
        start = min(component)
        paths, seen, queue = {start: [start]}, {start}, [start]
        while queue:
            v = queue.pop(0)
            for w in sorted(GRAPH[v] & component):
                if w == start:
                    cycles.append((paths[v] + [start], component))
                    queue = []
                    break
                if w not in seen:
                    seen.add(w)
                    paths[w] = paths[v] + [w]
                    queue.append(w)
    return cycles


CYCLES = _cycles()


@pytest.mark.parametrize("package", [*SERVICES, "chorus"])
def test_no_import_cycles(package):
    mine = [" -> ".join(cycle) + (f" (with {', '.join(sorted(set(component) - set(cycle)))})"
                                  if set(component) - set(cycle) else "")
            for cycle, component in CYCLES if any(_package(m) == package for m in component)]
    assert not mine, "import cycles:\n" + "\n".join(mine)


def _run_isolated(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_frontend_process_does_not_import_torch():
    assert _run_isolated("import sys, scheduler_svc.frontend_process; print('torch' in sys.modules)") == "False"


def test_the_gateway_does_not_import_torch():
    assert _run_isolated("import sys, gateway_svc.server; print('torch' in sys.modules)") == "False"


def test_a_checkpoint_tokenizer_loads_without_torch(tmp_path):
    """A frontend serving a real checkpoint loads its tokenizer.json; transformers would bring torch."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(tmp_path / "tokenizer.json"))
    code = (f"import sys; from chorus.tokenizer import load_tokenizer; "
            f"print(load_tokenizer({str(tmp_path)!r}).encode('hello world'), 'torch' in sys.modules)")
    assert _run_isolated(code) == "[1, 2] False"
