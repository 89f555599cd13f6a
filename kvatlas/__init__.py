"""kvatlas: where every cached KV chunk of an LLM serving fleet lives.

The packages form layers, each importing only those below it (README.md, "Layout"):
keys → events → directory → coordinator → client → node, with ``errors``, ``checks``, ``web``,
``config_flags``, ``asgi_thread``, ``logs`` and ``processes`` shared underneath and ``bench``,
``demo`` and ``cli`` on top; ``tests/test_package_structure.py`` holds them to it.
``__version__`` is the one place the version is written (pyproject.toml reads it).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]

from kvatlas import kernel_cache

# numba's cache directory, keyed by the sources, chosen when numba is imported (kernel_cache)
kernel_cache.choose_before_numba()
