"""Benchmarks behind ``kvatlas bench NAME``: one module per NAME with ``add_arguments`` and ``run``.

Each reports medians and the ratio to a naive reference measured in the same run
(``common``); the figures and the commands that produce them are in docs/performance.md. The
CLI finds each module by its name in ``BENCHMARKS``, the one name this package exports.
"""

BENCHMARKS: tuple[str, ...] = (
    "keys",
    "blend",
    "directory",
    "service",
    "route",
    "kv_events",
    "resync",
    "router",
    "fleet",
    "eviction",
)

__all__ = ["BENCHMARKS"]
