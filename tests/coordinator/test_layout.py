"""The coordinator package's shape: no import cycle, small modules (the directory's and the
node's too), the stream consumer independent of the service, routes free of the layers above
them."""

from __future__ import annotations

import ast
from pathlib import Path

import kvatlas
from kvatlas.coordinator.app import create_app
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.service import CoordinatorService

PACKAGE = Path(kvatlas.__file__).parent / "coordinator"
MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every kvatlas.coordinator module -> the kvatlas.coordinator modules it imports
    (anywhere in the file, including imports deferred into functions)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def test_no_import_cycle() -> None:
    graph = _imports()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = [*path[path.index(module) :], module]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for dep in sorted(graph[module]):
            visit(dep, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_stream_consumer_does_not_know_the_service() -> None:
    deps = _imports()["kvatlas.coordinator.stream_consumer"]
    assert "kvatlas.coordinator.service" not in deps


def test_routes_import_nothing_above_them() -> None:
    graph = _imports()
    for module, deps in graph.items():
        if module.startswith("kvatlas.coordinator.routes"):
            assert not deps & {"kvatlas.coordinator.app", "kvatlas.coordinator.server"}, module


def test_modules_are_small() -> None:
    """Every module of the package reads in one sitting."""
    sizes = {
        str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines())
        for path in PACKAGE.parent.rglob("*.py")
    }
    assert len(sizes) > 100  # the whole package, not a folder of it
    assert {name: n for name, n in sorted(sizes.items()) if n > MAX_LINES} == {}


def test_version_is_the_package_version() -> None:
    app = create_app(CoordinatorService(CoordinatorConfig(chunk_size=4)))
    assert app.version == kvatlas.__version__
    assert app.openapi()["info"]["version"] == kvatlas.__version__
