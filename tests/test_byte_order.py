"""kvatlas reads words little-endian (the base64 kernel, a snapshot's token section): one check
refuses a big-endian host, with the error each reader raises."""

from __future__ import annotations

import sys

import pytest

from kvatlas.checks import refuse_big_endian
from kvatlas.directory.snapshot.format import SnapshotError


def test_a_big_endian_host_is_refused_with_the_callers_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refuse_big_endian("the base64 kernel")  # this host: little-endian
    monkeypatch.setattr(sys, "byteorder", "big")
    with pytest.raises(ImportError, match="the base64 kernel reads words little-endian"):
        refuse_big_endian("the base64 kernel")
    with pytest.raises(SnapshotError, match="big-endian hosts are not supported"):
        refuse_big_endian("a snapshot's token section", SnapshotError)
