"""Run a Python script so that ``perf`` names kvatlas's compiled kernels: the script runs with a
fresh numba cache (kernels loaded from a cache keep no module to read their symbols from), and
at exit ``/tmp/perf-PID.map`` lists each compiled function's address, size and name, which
``perf report`` reads for the process's JIT code. Without it a kernel's samples show as bare
addresses.

    perf record -g -- python scripts/perf_map.py HARNESS.py [ARGS...]
    perf report --no-children --sort dso,sym

Compiling every kernel afresh takes tens of seconds: start ``perf record`` after the warm-up
(``-D -1 --control=fifo:...`` with the harness writing ``enable``), or filter by time.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import tempfile
from typing import Any


def demangled(name: str) -> str:
    """A numba symbol's dotted name (``_ZN`` and length-prefixed parts), or the name itself."""
    at = name.find("_ZN")
    if at < 0:
        return name
    i, parts = at + 3, []
    while i < len(name) and name[i].isdigit():
        j = i
        while name[j].isdigit():
            j += 1
        size = int(name[i:j])
        parts.append(name[j : j + size])
        i = j + size
    return ".".join(parts)


def compiled_functions() -> dict[int, str]:
    """The address and name of each function numba compiled in this process for a kvatlas
    module's dispatchers."""
    from numba.core.registry import CPUDispatcher

    found: dict[int, str] = {}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("kvatlas") or module is None:
            continue
        for value in list(vars(module).values()):
            if not isinstance(value, CPUDispatcher):
                continue
            for result in value.overloads.values():
                library: Any = getattr(result, "library", None)
                final = getattr(library, "_final_module", None)  # (None: loaded from a cache)
                for fn in [] if final is None else final.functions:
                    if not fn.is_declaration:
                        address = library.get_pointer_to_function(fn.name)
                        if address:
                            found.setdefault(address, demangled(fn.name))
    return found


def write_perf_map(path: str | None = None) -> int:
    """Write the map ``perf`` reads for this process (each function up to the next one's
    address, at most 1 MiB); returns how many functions it names."""
    found = compiled_functions()
    addresses = sorted(found)
    with open(path or f"/tmp/perf-{os.getpid()}.map", "w") as out:
        for address, following in zip(addresses, [*addresses[1:], None], strict=True):
            size = min((following or address + (1 << 20)) - address, 1 << 20)
            out.write(f"{address:x} {size:x} {found[address]}\n")
    return len(addresses)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvatlas-perf-numba-")
    atexit.register(lambda: print(f"perf map: {write_perf_map()} functions", file=sys.stderr))
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
