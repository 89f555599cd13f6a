"""Benchmarks behind ``kvatlas bench NAME``: one module per NAME with ``add_arguments`` and ``run``."""

BENCHMARKS: tuple[str, ...] = ("keys", "blend", "directory", "service")
