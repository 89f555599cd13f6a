"""The shape of the package, read from the source with ``ast`` (nothing is imported):

* layers: keys → api → events → directory → coordinator → client → router → node → connector →
  engine_sim; a package imports only its own layer and those below it, never one above
  (function-level imports count too);
* shared modules (errors, checks, web, ...) sit underneath and import no layered package;
  bench, demo, soak and cli sit on top and nothing imports them;
* no import cycle between modules (module-level imports, ``TYPE_CHECKING`` blocks included:
  a type-only cycle still ties the two modules together);
* every package says what it exports (a docstring and ``__all__``), and the version is
  written once.

The rules name packages, not files, so a package can be reorganised freely inside itself.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import kvatlas

ROOT = Path(kvatlas.__file__).parent

LAYERS = (
    "keys",
    "api",  # the coordinator's wire types: under coordinator, client, router and node alike
    "events",
    "directory",
    "coordinator",
    "client",
    "router",
    "node",
    "connector",
    "engine_sim",
)
SHARED = (
    "kvatlas",  # the root package: __version__, and numba's cache directory chosen
    "lazy_exports",  # a package's names imported on first use (PEP 562)
    "errors",
    "auth",
    "checks",
    "web",
    "fields",  # how a request's bad fields are reported (422)
    "routing",  # a service's route table
    "dispatch",  # the one request stack serving a route table
    "openapi",  # a route table's documentation
    "http_limits",  # the HTTP guard's settings (--http-* flags) and its refusal counter
    "http_guard",
    "http_body",  # how the guard keeps a request body; a large one read straight into its bytes
    "http_coalescing",  # a transport whose writes of one event-loop turn leave in one send
    "memory_transport",  # an asyncio transport in memory: an HTTP protocol without sockets
    "config_flags",
    "asgi_thread",
    "logs",
    "processes",
    "backoff",
    "durable",  # a file's name made durable (its directory fsync'd)
    "kernel_twins",  # numba kernels compiled in a GIL-holding and a GIL-releasing form
    "kernel_cache",  # numba's cache directory, keyed by the sources (stdlib only)
    "c_heap",  # glibc's allocator through ctypes: room faulted in ahead of a burst
    "redis_clients",
    "rope_styles",  # which rotary style a model type uses: the node's and the connector's
    "chat_template",  # a chat template rendered as vLLM renders it: the router's and engine_sim's
    "vllm_limits",  # vLLM's refusals of a request's length: the router's and engine_sim's
    "vllm_requests",  # a request body read and refused as vLLM's server does: the same two's
    "vllm_request_models",  # vLLM's request models (the fields those two read)
    "workloads",  # benchmark inputs: numpy only
)
TOP = ("bench", "demo", "soak", "cli", "router_replica")  # router_replica: the router
# with a coordinator replica in its process (--scores-from replica), composed above both
# Below its place in the order, but still out of bounds: a client never imports server
# internals (and must stay light: no directory, hence no numba kernels). The vLLM connector
# runs inside an engine and reaches its node through the client only.
FORBIDDEN = {
    "client": ("directory", "coordinator"),
    "connector": ("directory", "coordinator", "node"),
    "router": ("directory", "coordinator"),  # a gateway: the coordinator only over HTTP
    # the simulated engine stands where vLLM stands: its KV events, and a node only as a client
    "engine_sim": ("directory", "coordinator", "router", "node", "connector"),
}

# Known gaps in packages still being restructured (issue 8). The tests fail on any new gap AND
# on an entry here that was fixed: delete the entry then.
PENDING_EXPORTS: set[str] = set()  # packages without a docstring + __all__ yet
PENDING_VERSION: set[str] = set()  # modules that write the version instead of reading it


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str  # dotted module name (a submodule when the import names one)
    line: int
    module_level: bool  # runs when the importer is imported (not in a function, not typing-only)
    type_only: bool = False  # in an ``if TYPE_CHECKING:`` block


def module_name(path: Path) -> str:
    parts = ("kvatlas", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(node: ast.Import | ast.ImportFrom, importer: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: resolve against the importer's package
        package = (
            importer if MODULES[importer].name == "__init__.py" else importer.rpartition(".")[0]
        )
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    # `from kvatlas.directory import gate` imports the submodule; `import X` names it directly.
    return [
        f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
        for alias in node.names
    ]


def imports_of(module: str) -> list[Import]:
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    found: list[Import] = []

    def visit(node: ast.AST, module_level: bool, type_only: bool = False) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            for target in _targets(node, module):
                if target == "kvatlas" or target.startswith("kvatlas."):
                    found.append(Import(module, target, node.lineno, module_level, type_only))
            return
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            module_level = False
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False, type_only=module_level)
            for child in node.orelse:
                visit(child, module_level)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, module_level, type_only)

    visit(tree, True)
    return found


@functools.cache
def all_imports() -> list[Import]:
    """Every import of every kvatlas module (parsed on first use, not at collection, where
    every pytest worker would parse all of them)."""
    return [imp for module in MODULES for imp in imports_of(module)]


def unit(module: str) -> str:
    """The layered unit a module belongs to: ``kvatlas.directory.gate`` → ``directory``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kvatlas"


def rank(name: str) -> int:
    if name in SHARED:
        return -1
    if name in TOP:
        return len(LAYERS)
    return LAYERS.index(name)


def test_every_package_and_module_has_a_place() -> None:
    units = {unit(m) for m in MODULES}
    unplaced = sorted(units - set(LAYERS) - set(SHARED) - set(TOP))
    assert not unplaced, f"place these in LAYERS, SHARED or TOP of {__file__}: {unplaced}"


def test_no_package_imports_a_higher_layer() -> None:
    bad = [
        f"{i.importer} (line {i.line}) imports {i.target}"
        for i in all_imports()
        if unit(i.importer) in LAYERS and rank(unit(i.target)) > rank(unit(i.importer))
    ]
    assert not bad, "layering: " + "; ".join(bad)


def test_shared_modules_import_no_layered_package() -> None:
    bad = [
        f"{i.importer} (line {i.line}) imports {i.target}"
        for i in all_imports()
        if unit(i.importer) in SHARED and unit(i.target) not in SHARED
    ]
    assert not bad, "shared modules sit underneath every layer: " + "; ".join(bad)


def test_nothing_imports_the_top() -> None:
    bad = [
        f"{i.importer} (line {i.line}) imports {i.target}"
        for i in all_imports()
        if unit(i.target) in TOP and unit(i.importer) not in TOP
    ]
    assert not bad, "bench, demo, soak and cli are entry points, not libraries: " + "; ".join(bad)


def test_forbidden_imports_below_the_order() -> None:
    bad = [
        f"{i.importer} (line {i.line}) imports {i.target}"
        for i in all_imports()
        if unit(i.target) in FORBIDDEN.get(unit(i.importer), ())
    ]
    assert not bad, "; ".join(bad)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                connect(w)
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
            if len(component) > 1 or v in edges[v]:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def test_cycle_finder_finds_cycles() -> None:
    edges: dict[str, set[str]] = defaultdict(set, {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles(defaultdict(set, {"a": {"b"}, "b": set()})) == []


def test_no_import_cycle_between_modules() -> None:
    edges: dict[str, set[str]] = defaultdict(set)
    for i in all_imports():
        if (i.module_level or i.type_only) and i.target != i.importer:
            edges[i.importer].add(i.target)
    assert _cycles(edges) == [], "module-level import cycles (type-only imports count)"


def test_every_package_says_what_it_exports() -> None:
    missing = []
    for module, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        has_all = any(
            isinstance(node, ast.Assign | ast.AnnAssign)
            and any(
                isinstance(t, ast.Name) and t.id == "__all__"
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            )
            for node in tree.body
        )
        if not ast.get_docstring(tree) or not has_all:
            missing.append(module)
    assert set(missing) <= PENDING_EXPORTS, (
        f"packages without a docstring or __all__: {sorted(set(missing) - PENDING_EXPORTS)}"
    )
    assert set(missing) == PENDING_EXPORTS, (
        f"fixed, delete from PENDING_EXPORTS: {sorted(PENDING_EXPORTS - set(missing))}"
    )


def test_the_version_is_written_once() -> None:
    assert importlib.metadata.version("kvatlas") == kvatlas.__version__
    repeated = [
        str(path.relative_to(ROOT.parent))
        for path in MODULES.values()
        if path.name != "__init__.py" or path.parent != ROOT
        if f'"{kvatlas.__version__}"' in path.read_text()
    ]
    assert set(repeated) <= PENDING_VERSION, (
        f"read kvatlas.__version__ instead of repeating it: {sorted(set(repeated) - PENDING_VERSION)}"
    )
    assert set(repeated) == PENDING_VERSION, (
        f"fixed, delete from PENDING_VERSION: {sorted(PENDING_VERSION - set(repeated))}"
    )
