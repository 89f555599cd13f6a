"""docs/security.md lists, at its end ("## Tests"), the test that checks each of its statements
(issue 25). Every ``tests/<path>.py::<test>`` named there must exist, so the list cannot rot:
a renamed or deleted test fails here, not silently in the docs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "security.md"
# `tests/a/b.py::test_name` or `tests/a/b.py::test_name[param-id]`
REFERENCE = re.compile(r"`(tests/[\w/]+\.py)::(\w+)(?:\[[^\]`]*\])?`")


def section_of(text: str) -> str:
    """The page's "## Tests" section (to the next level-2 heading or the end)."""
    start = text.index("\n## Tests\n")
    end = text.find("\n## ", start + 1)
    return text[start : None if end < 0 else end]


def references(section: str) -> list[tuple[str, str]]:
    return REFERENCE.findall(section)


def defined_tests(path: Path) -> set[str]:
    """The test functions ``path`` defines (module level or in a test class)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
    return {n for n in names if n.startswith("test_")}


def missing(refs: list[tuple[str, str]]) -> list[str]:
    """The references whose file or test function does not exist."""
    gone = []
    for file, name in refs:
        path = ROOT / file
        if not path.is_file() or name not in defined_tests(path):
            gone.append(f"{file}::{name}")
    return gone


def test_every_test_the_security_page_names_exists() -> None:
    refs = references(section_of(PAGE.read_text()))
    assert len(refs) > 100, len(refs)  # the section was parsed, not skipped
    assert missing(refs) == []


def test_the_check_catches_a_renamed_test_and_a_moved_file() -> None:
    section = (
        "## Tests\n- x: `tests/test_security_doc.py::test_no_such_test`,"
        " `tests/no_such_file.py::test_x`,"
        " `tests/test_security_doc.py::test_every_test_the_security_page_names_exists[id-1]`.\n"
    )
    refs = references(section_of("\n" + section))
    assert len(refs) == 3
    assert missing(refs) == [
        "tests/test_security_doc.py::test_no_such_test",
        "tests/no_such_file.py::test_x",
    ]


def test_the_tests_written_for_the_page_are_listed_on_it() -> None:
    listed = {name for file, name in references(section_of(PAGE.read_text()))}
    claims = defined_tests(ROOT / "tests" / "test_security_claims.py")
    assert claims and claims <= listed, claims - listed
