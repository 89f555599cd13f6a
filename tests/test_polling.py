"""The tests poll services on one HTTP client (``tests/conftest.py``, ``HTTP``): a predicate
given to ``wait_for`` never builds a client per call (``httpx.get``: ≈40–60 ms of CPU, every
10 ms while a service starts), directly or through a function of its own module."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PER_CALL = {"get", "post", "put", "delete", "head", "request", "stream"}


def _builds_a_client(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "httpx"
        and n.func.attr in PER_CALL
        for n in ast.walk(node)
    )


def _called_names(predicate: ast.AST) -> set[str]:
    """The names of the functions ``predicate`` calls, or is (``wait_for(ready)``)."""
    called = [n.func for n in ast.walk(predicate) if isinstance(n, ast.Call)]
    return {
        f.id if isinstance(f, ast.Name) else f.attr
        for f in [predicate, *called]
        if isinstance(f, ast.Name | ast.Attribute)
    }


def polls_building_clients(source: str) -> list[int]:
    """Lines of ``wait_for(...)`` calls in ``source`` whose predicate builds a client."""
    tree = ast.parse(source)
    building = {
        n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and _builds_a_client(n)
    }
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id == "wait_for"
        and n.args
        and (_builds_a_client(n.args[0]) or _called_names(n.args[0]) & building)
    ]


def test_the_check_finds_a_poll_building_a_client() -> None:
    direct = "wait_for(lambda: httpx.get(url).status_code == 200)"
    through = "def ready():\n    return httpx.get(url).json()\nwait_for(lambda: ready(), 5)"
    passed = "def ready() -> bool:\n    return httpx.post(url).is_success\nwait_for(ready)"
    shared = "wait_for(lambda: HTTP.get(url).status_code == 200)"
    assert [polls_building_clients(s) for s in (direct, through, passed, shared)] == [
        [1], [3], [3], []
    ]  # fmt: skip


def test_no_test_polls_with_a_client_per_call() -> None:
    found = {
        str(path.relative_to(TESTS)): lines
        for path in sorted(TESTS.rglob("*.py"))
        if (lines := polls_building_clients(path.read_text()))
    }
    assert found == {}
