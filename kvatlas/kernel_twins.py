"""Compiled kernels that come in two forms: one holding the GIL for its call, one releasing it.

A short call must hold the GIL: each release wakes a thread waiting for it, the caller takes
it back first, and the waiter sleeps again with its switch interval restarted, so it starves
(docs/directory.md, "Threads and the GIL"). A long call must release it, so that other
threads run meanwhile. A kernel called both ways is written once, under :func:`gil_twins`,
which compiles it as the holding form and generates the releasing form, a call of the holding
one behind an entry point that releases the GIL; the pair is registered here. The caller
picks the form by the size of the call; :func:`compile_releasing_twins` (run by
``directory.warm_up_kernels``) compiles each releasing form for every signature its holding
form was warmed with. The two cannot diverge: the releasing form has no body of its own.

Both are cached on disk (``cache=True``). numba names a cached kernel by its file, its
``__qualname__`` and its first line, and its key has no ``nogil`` flag: two forms under one
name would load each other's machine code (the releasing one then holding the GIL). The
releasing form is named ``<qualname>_releasing`` at the kernel's file and line: its own
cache entry, the same in every process.

:func:`njit_without_nrt` is the other way kernels are compiled here: a helper that allocates
nothing, without numba's reference counting.

This module imports numba: only kernel modules import it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numba

if TYPE_CHECKING:  # numba's stubs name what njit(**options) returns
    from numba.core.decorators import _JITWrapper

RELEASING_SUFFIX = "_releasing"


def njit_without_nrt(**options: Any) -> _JITWrapper:
    """``numba.njit(**options)`` for a helper that allocates nothing: compiled without
    numba's reference counting. With it, a call from compiled code takes and drops a reference
    on each array argument (two atomic updates each, a call into the runtime each); in the
    JSON entry parser and the index write loop, whose helpers are called per field or per op,
    that was a third of their compiled time (docs/performance.md). The caller holds every
    array for the call. A helper compiled so that allocated an array would fail to compile;
    one must not return an array either (its counting caller would drop a reference the helper
    never took, and free the array under it: ``tests/test_without_nrt.py``)."""
    jit: _JITWrapper = numba.njit(**options, _nrt=False)  # type: ignore[call-overload]
    return jit


class Twins(NamedTuple):
    """The two compiled forms of one kernel (numba dispatchers)."""

    holding: Any
    releasing: Any


_REGISTRY: dict[int, Twins] = {}
"""Every pair made by :func:`gil_twins`, by ``id`` of its holding form (kept alive here)."""


def gil_twins(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """Decorator: compile the function as a holding kernel (returned, so that compiled code
    calls it by its name) and register its releasing twin (:func:`releasing_twin`), both
    with ``numba.njit(cache=True, **options)``; the twin adds ``nogil=True``."""
    if "nogil" in options or "cache" in options:
        raise TypeError("gil_twins sets nogil and cache itself")

    def compile_twice(fn: Callable[..., Any]) -> Any:
        holding = numba.njit(cache=True, **options)(fn)
        forward = _forwarding(fn, holding)
        releasing = numba.njit(cache=True, nogil=True, **options)(forward)
        _REGISTRY[id(holding)] = Twins(holding, releasing)
        return holding

    return compile_twice


def _forwarding(fn: Callable[..., Any], holding: Any) -> Callable[..., Any]:
    """``def <name>_releasing(<fn's parameters>): return holding(<the same>)``, placed at
    ``fn``'s file and line (the cache entry's name) under ``<qualname>_releasing``.

    A call from compiled code into ``holding`` runs its compiled body: the twin compiles
    only this call, not the kernel a second time (a cold start compiles each kernel once)."""
    params = inspect.signature(fn).parameters
    if any(
        p.kind is not p.POSITIONAL_OR_KEYWORD or p.default is not p.empty for p in params.values()
    ):
        raise TypeError(f"gil_twins: {fn.__qualname__} takes plain positional parameters only")
    name = fn.__name__ + RELEASING_SUFFIX
    args = ", ".join(params)
    source = f"def {name}({args}):\n    return _holding({args})\n"
    scope: dict[str, Any] = {"_holding": holding, "__name__": fn.__module__}
    exec(compile(source, fn.__code__.co_filename, "exec"), scope)  # text of names only
    forward: Any = scope[name]
    forward.__code__ = forward.__code__.replace(co_firstlineno=fn.__code__.co_firstlineno)
    forward.__qualname__ = fn.__qualname__ + RELEASING_SUFFIX
    forward.__doc__ = f"{fn.__qualname__}, the GIL released for the call."
    return forward  # type: ignore[no-any-return]


def releasing_twin(holding: Any) -> Any:
    """The GIL-releasing form of a kernel made by :func:`gil_twins`."""
    twins = _REGISTRY.get(id(holding))
    if twins is None or twins.holding is not holding:
        raise TypeError(f"{holding!r} was not compiled by gil_twins")
    return twins.releasing


def registered() -> tuple[Twins, ...]:
    """Every pair made so far (those of the kernel modules imported)."""
    return tuple(_REGISTRY.values())


def compile_releasing_twins() -> int:
    """Compile (or load from the cache) each releasing form for every signature its holding
    form has been compiled for; returns how many signatures that was. Run after the holding
    forms were exercised: a long call then finds its form ready."""
    count = 0
    for twins in registered():
        for signature in twins.holding.signatures:
            twins.releasing.compile(signature)
            count += 1
    return count
