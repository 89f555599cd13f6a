"""Key schemes: a mismatch between two components is refused as a Conflict, naming both sides."""

from __future__ import annotations

import pytest

from kvatlas.errors import Conflict
from kvatlas.keys import SCHEME_BLAKE3, SCHEME_BLAKE3_X1, KeyScheme, KeySchemeMismatch


def test_compatible_scheme_passes() -> None:
    KeyScheme(SCHEME_BLAKE3, 256).check_compatible(SCHEME_BLAKE3, 256)


@pytest.mark.parametrize(("name", "chunk_size"), [(SCHEME_BLAKE3_X1, 256), (SCHEME_BLAKE3, 128)])
def test_mismatch_is_a_conflict(name: str, chunk_size: int) -> None:
    with pytest.raises(KeySchemeMismatch) as info:
        KeyScheme(SCHEME_BLAKE3, 256).check_compatible(name, chunk_size)
    exc = info.value
    assert isinstance(exc, Conflict) and isinstance(exc, RuntimeError)
    assert exc.status == 409
    assert f"{SCHEME_BLAKE3}/256" in exc.detail and f"{name}/{chunk_size}" in exc.detail
