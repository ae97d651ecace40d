"""The arrows between the project's packages point one way (docs/architecture.md, "Packages"):
``cli`` -> ``flows`` -> ``tasks`` -> ``runner`` -> ``retexo_core`` -> ``graphstore``, no two modules
import each other (directly or through others), tasks import neither flows nor the command line,
and the training core and the workers never load pymetis.

Read from the source: every import statement counts, those inside functions too; those under
``if TYPE_CHECKING:`` name types for annotations only and are left out.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from processes import REPO

LAYERS = ("graphstore", "retexo_core", "runner", "tasks", "flows", "cli")  # from the bottom up

Graph = dict[str, set[str]]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def runtime_imports(tree: ast.AST) -> list[str]:
    """The modules an AST imports when it runs (``from a import b`` imports ``a.b`` when ``b`` is
    a module, else ``a``), outside ``if TYPE_CHECKING:`` blocks."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.extend(f"{node.module}.{alias.name}" if is_module(f"{node.module}.{alias.name}") else node.module
                         for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def project_graph() -> Graph:
    """Every module of the project's packages -> the project modules it imports."""
    graph: Graph = {}
    for package in LAYERS:
        for path in sorted((REPO / package).rglob("*.py")):
            name = module_name(path)
            graph[name] = {target for target in runtime_imports(ast.parse(path.read_text()))
                           if target.split(".")[0] in LAYERS and target != name}
    return graph


def circles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = [stack.pop()]
            while component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(graph):
        if node not in index:
            connect(node)
    return found


def test_every_package_imports_only_the_packages_below_it() -> None:
    upward = sorted(f"{module} imports {target}" for module, targets in project_graph().items() for target in targets
                    if LAYERS.index(target.split(".")[0]) > LAYERS.index(module.split(".")[0]))
    assert upward == []


def test_no_modules_import_each_other() -> None:
    assert circles(project_graph()) == []


def test_the_circle_check_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_tasks_import_neither_flows_nor_the_command_line() -> None:
    graph = project_graph()
    assert sorted(t for m, targets in graph.items() if m.startswith("tasks") for t in targets
                  if t.split(".")[0] in ("flows", "cli")) == []


def test_the_training_core_and_the_workers_load_no_pymetis() -> None:
    """Only a METIS partitioning imports pymetis: not the site protocol of ``retexo_core``, nor
    anything a worker process imports (its entry point, the core, the result writer, the lookups)."""
    modules = ["retexo_core.sites", "runner.worker", "retexo_core.stages", "retexo_core.data", "runner.results",
               "retexo_core.comm.transport", "graphstore.lookup"]
    code = f"import sys, {', '.join(modules)}; print('pymetis' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
