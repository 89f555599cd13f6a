"""Compiled kernels that come in two forms: one holding the GIL for its call, one releasing it.

A short call (microseconds) must hold the GIL: each release wakes a thread waiting for it,
the caller takes it back first, and the waiter sleeps again with its switch interval
restarted, so it starves (docs/directory.md, "Threads and the GIL"). A long call must release
it, so other threads run meanwhile. A kernel called both ways is written once, under
:func:`gil_twins`, which compiles the same Python function twice and registers the pair here;
the caller picks the form by the size of the call, and :func:`compile_releasing_twins` (run
by ``directory.warm_up_kernels``) compiles each releasing form for every signature its
holding form was warmed with. Both forms can never differ in code: they share one code object.

Both are cached on disk (``cache=True``). numba names a cached kernel by its file, the
function's ``__qualname__`` and its first line, and does not put the ``nogil`` flag in the
key: two forms under one name would load each other's machine code (the releasing one then
holding the GIL). The releasing form is therefore a copy of the function named
``<qualname>_releasing``: its own cache entry, stable across processes.

This module imports numba: only kernel modules import it.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, NamedTuple

import numba

RELEASING_SUFFIX = "_releasing"


class Twins(NamedTuple):
    """The two compiled forms of one kernel (numba dispatchers)."""

    holding: Any
    releasing: Any


_REGISTRY: dict[int, Twins] = {}
"""Every pair made by :func:`gil_twins`, by ``id`` of its holding form (kept alive here)."""


def gil_twins(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """Decorator: compile the function as a holding kernel (returned, so that compiled code
    calls it by its name) and as its releasing twin (:func:`releasing_twin`), both with
    ``numba.njit(cache=True, **options)``; the twin adds ``nogil=True``."""
    if "nogil" in options or "cache" in options:
        raise TypeError("gil_twins sets nogil and cache itself")

    def compile_twice(fn: Callable[..., Any]) -> Any:
        holding = numba.njit(cache=True, **options)(fn)
        copy = types.FunctionType(
            fn.__code__, fn.__globals__, fn.__name__ + RELEASING_SUFFIX, fn.__defaults__,
            fn.__closure__,
        )  # fmt: skip
        copy.__qualname__ = fn.__qualname__ + RELEASING_SUFFIX  # its own cache entry
        copy.__module__ = fn.__module__
        copy.__doc__ = fn.__doc__
        copy.__kwdefaults__ = fn.__kwdefaults__
        releasing = numba.njit(cache=True, nogil=True, **options)(copy)
        _REGISTRY[id(holding)] = Twins(holding, releasing)
        return holding

    return compile_twice


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
