"""Kernels called both short and long get both forms from one definition
(``kvatlas/kernel_twins.py``): never a second, hand-written entry point that could drift or
miss the warm-up.

* no module of kvatlas defines a GIL-releasing twin by hand: no function named
  ``*_releasing``, no compiled function whose whole body calls another with its own arguments;
* every ``*_releasing`` name is bound to the registered twin of its kernel;
* the releasing form of each kernel only calls the holding one with its own arguments, both
  have one set of compile options but ``nogil``, and distinct cache names (numba's cache key has no ``nogil``: under one name
  they would load each other's machine code).

``tests/directory/test_warm_up.py`` checks that warm-up compiles every registered twin and
that a fresh process loads both forms from the cache; ``tests/directory/test_gil_holding.py``
that the releasing forms do release the GIL.
"""

from __future__ import annotations

import ast
import dis
import importlib
import inspect
from pathlib import Path

import pytest
from numba.core.caching import FunctionCache

import kvatlas
from kvatlas import kernel_twins

ROOT = Path(kvatlas.__file__).parent
SUFFIX = kernel_twins.RELEASING_SUFFIX


def _sources(naming: str = "") -> list[tuple[str, ast.Module]]:
    """Every kvatlas module's name and tree; with ``naming``, only those whose text has it (the
    others are not parsed: this runs at collection, in every worker)."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        if naming in text:
            module = ".".join(("kvatlas", *path.relative_to(ROOT).with_suffix("").parts))
            out.append((module.removesuffix(".__init__"), ast.parse(text)))
    return out


def _twin_modules() -> list[str]:
    """The modules that compile kernels with ``gil_twins``."""
    return [
        module
        for module, tree in _sources("gil_twins")
        if module != "kvatlas.kernel_twins"
        and any(isinstance(n, ast.Name) and n.id == "gil_twins" for n in ast.walk(tree))
    ]


def _params(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]


def _forwards_its_arguments(fn: ast.FunctionDef) -> bool:
    """Whether the body (its docstring aside) is one call passing the parameters on in order."""
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    if len(body) != 1 or not isinstance(body[0], ast.Return | ast.Expr):
        return False
    call = body[0].value
    if not isinstance(call, ast.Call) or call.keywords:
        return False
    args = [a.id if isinstance(a, ast.Name) else None for a in call.args]
    return bool(args) and args == _params(fn)


def _compiled(fn: ast.FunctionDef) -> bool:
    """Whether a decorator compiles it (``numba.njit(...)``, ``jit``, ``releasing``, ...)."""
    return any(
        word in ast.unparse(d) for d in fn.decorator_list for word in ("jit", "numba", "releasing")
    )


def hand_written_twins(sources: list[tuple[str, ast.Module]]) -> list[str]:
    found = []
    for module, tree in sources:
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef):
                continue
            if node.name.endswith(SUFFIX) or (_compiled(node) and _forwards_its_arguments(node)):
                found.append(f"{module}.{node.name}")
    return found


def test_no_kernel_twin_is_written_by_hand() -> None:
    assert hand_written_twins(_sources()) == []


def test_the_check_finds_a_hand_written_twin() -> None:
    """Negative control: the shape every twin had before ``gil_twins`` (``_json_tokens``)."""
    old = ast.parse(
        "@numba.njit(cache=True, nogil=True, boundscheck=False)\n"
        "def _parse_lists_releasing(buf, starts, ends, arena, lengths):\n"
        '    """:func:`_parse_lists`, the GIL released for the call."""\n'
        "    return _parse_lists(buf, starts, ends, arena, lengths)\n"
        "@releasing\n"
        "def go_long(ops, chunk, out):\n"
        "    apply_ops(ops, chunk, out)\n"
    )
    assert hand_written_twins([("m", old)]) == ["m._parse_lists_releasing", "m.go_long"]


TWIN_MODULES = _twin_modules()
for _name in TWIN_MODULES:  # registers their twins before the tests below are parametrized
    importlib.import_module(_name)


def test_every_releasing_name_is_a_registered_twin() -> None:
    modules = TWIN_MODULES
    assert len(modules) >= 4  # the blend writes and scan, the two JSON token parsers
    registered = {id(t.releasing): t for t in kernel_twins.registered()}
    named = 0
    for name in modules:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if attr.endswith(SUFFIX):
                twins = registered.get(id(value))
                assert twins is not None, f"{name}.{attr} is not a registered twin"
                assert getattr(module, attr.removesuffix(SUFFIX)) is twins.holding
                named += 1
    assert named >= 4


@pytest.mark.parametrize("twins", kernel_twins.registered(), ids=lambda t: t.holding.__name__)
def test_the_two_forms_of_a_kernel_cannot_diverge(twins: kernel_twins.Twins) -> None:
    """The releasing form has no body of its own: it calls the holding form with its own
    arguments, in order, and returns what that returns."""
    holding, releasing = twins.holding.py_func, twins.releasing.py_func
    assert releasing.__globals__ == {"_holding": twins.holding, **releasing.__globals__}
    assert releasing.__code__.co_names == ("_holding",)
    params = list(inspect.signature(holding).parameters)
    assert list(inspect.signature(releasing).parameters) == params
    loaded = [i.argval for i in dis.get_instructions(releasing) if i.opname == "LOAD_FAST"]
    assert loaded == params
    assert [i.opname for i in dis.get_instructions(releasing)][-1] == "RETURN_VALUE"
    assert inspect.getfile(releasing) == inspect.getfile(holding)
    assert releasing.__code__.co_firstlineno == holding.__code__.co_firstlineno
    assert releasing.__module__ == holding.__module__
    holding_options, releasing_options = (
        dict(twins.holding.targetoptions),
        dict(twins.releasing.targetoptions),
    )
    assert releasing_options.pop("nogil") is True
    assert not holding_options.pop("nogil", False)
    assert holding_options == releasing_options
    for form in twins:  # each cached on disk, in its own entry, named:
        assert isinstance(form._cache, FunctionCache)
    assert releasing.__qualname__ == holding.__qualname__ + SUFFIX


def test_registered_kernels_cover_the_twin_modules() -> None:
    modules = {t.holding.py_func.__module__ for t in kernel_twins.registered()}
    assert set(TWIN_MODULES) <= modules
    assert len(kernel_twins.registered()) >= 4


def test_only_a_twin_compiled_by_gil_twins_has_a_releasing_form() -> None:
    from kvatlas.directory.blend import kernels

    with pytest.raises(TypeError, match="not compiled by gil_twins"):
        kernel_twins.releasing_twin(kernels.fingerprint)
    with pytest.raises(TypeError, match="sets nogil"):
        kernel_twins.gil_twins(nogil=True)
