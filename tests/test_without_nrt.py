"""Helpers called per field (the JSON entry parser) or per op (the index write loop) are
compiled without numba's reference counting (``kernel_twins.njit_without_nrt``): with it, each
call took and dropped a reference on every array argument, a third of those kernels' compiled
time (docs/performance.md).

* ``njit_without_nrt`` really compiles without it (negative control: such a helper cannot
  allocate an array), and a call leaves its arguments' reference counts as they were;
* no such helper hands an array back (its caller would drop a reference never taken);
* the hot helpers are compiled so (a regression would be a silent slowdown, nothing else).
"""

from __future__ import annotations

import sys
from typing import Any

import numba
import numpy as np
import pytest

from kvatlas.coordinator.warm_up import warm_up_lookup_kernels
from kvatlas.directory.blend.kernels import anchors, modhash, occupants, planes, table, writes
from kvatlas.directory.warm_up import warm_up_kernels
from kvatlas.events import _json_entries, _json_tokens
from kvatlas.kernel_twins import njit_without_nrt

HOT_HELPERS = [
    _json_entries.parse_entries,
    _json_entries.same_bytes,
    _json_entries._is_name,
    _json_entries._field_of,
    _json_entries._key,
    _json_entries._entry,
    _json_entries._string,
    _json_entries._integer,
    _json_tokens.parse_array,
    _json_tokens.skip_space,
    _json_tokens.string_end,
    modhash.fingerprint_at,
    modhash.power_table,
    planes.planes_equal,
    planes.planes_load,
    table.find_content,
    table.fp_listed,
    table.equal_at,
    table.claims_insert,
    occupants.claimed,
    occupants.find_occupant,
    occupants.link_occupant,
    occupants.unlink_occupant,
    occupants.add_claim,
    occupants.drop_claim,
    writes._take_id,
    writes._release_id,
    anchors._insert,
    anchors._walk,
]


def test_a_helper_compiled_without_reference_counts_cannot_allocate() -> None:
    @njit_without_nrt()
    def allocates(n):  # type: ignore[no-untyped-def]
        return np.empty(n, np.int64)

    with pytest.raises(numba.core.errors.TypingError):
        allocates(3)


def test_calls_from_counting_code_leave_the_arrays_counts_as_they_were() -> None:
    @njit_without_nrt()
    def total(a, b):  # type: ignore[no-untyped-def]
        return a.sum() + b[0]

    @numba.njit
    def calls(a, b, n):  # type: ignore[no-untyped-def]
        s = 0
        for _ in range(n):
            s += total(a, b)
        return s

    a, b = np.arange(4, dtype=np.int64), np.ones(1, np.int64)
    before = sys.getrefcount(a), sys.getrefcount(b)
    assert calls(a, b, 1000) == 1000 * 7
    assert (sys.getrefcount(a), sys.getrefcount(b)) == before


def _hands_back_an_array(t: Any) -> bool:
    if isinstance(t, numba.types.Array):
        return True
    return isinstance(t, numba.types.BaseTuple) and any(map(_hands_back_an_array, t.types))


def test_no_helper_without_reference_counts_hands_back_an_array() -> None:
    """A counting caller drops a reference on an array it gets back; a helper that never took
    one would free it under the caller (tried: the process aborts on a corrupted heap at
    exit). Every helper so compiled, as the kernels' warm-up compiles them, returns none."""
    warm_up_kernels()
    warm_up_lookup_kernels()
    helpers = {
        id(obj): (module.__name__, name, obj)
        for module in list(sys.modules.values())
        if module is not None and module.__name__.startswith("kvatlas.")
        for name, obj in vars(module).items()
        if (getattr(obj, "targetoptions", None) or {}).get("_nrt") is False
    }
    assert len(helpers) >= len(HOT_HELPERS)
    handing_back = [
        (module, name, sig.return_type)
        for module, name, obj in helpers.values()
        for sig in obj.nopython_signatures
        if _hands_back_an_array(sig.return_type)
    ]
    assert handing_back == []


@pytest.mark.parametrize("helper", HOT_HELPERS, ids=lambda h: h.py_func.__qualname__)
def test_the_hot_helpers_are_compiled_without_reference_counts(helper: object) -> None:
    assert helper.targetoptions.get("_nrt") is False  # type: ignore[attr-defined]
