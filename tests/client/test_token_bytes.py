"""Token ids on the wire (uint32 little-endian): a token id that does not fit is the
project's InvalidInput naming it, never numpy's OverflowError or a silent wrap-around."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvatlas.checks import uint32_token_bytes
from kvatlas.cli import main
from kvatlas.client import EngineClient
from kvatlas.client.coordinator_client import encode_tokens_b64
from kvatlas.errors import InvalidInput


@pytest.mark.parametrize(
    "tokens",
    [
        [1, 2**32],
        [-1],
        np.array([5, 2**32 + 7], dtype=np.int64),  # would wrap to 7 silently
        np.array([-3], dtype=np.int32),
        [1.5],
        [True],
        [1, True, 3],
        [np.bool_(False), 2],
        ["12"],
    ],
    ids=[
        "list-2^32",
        "negative",
        "int64-wraps",
        "int32-negative",
        "float",
        "bool",
        "bool-among-ints",
        "numpy-bool-among-ints",
        "str",
    ],
)
def test_ids_outside_uint32_are_refused_by_name(tokens: object) -> None:
    with pytest.raises(InvalidInput, match="token id"):
        uint32_token_bytes(tokens)
    with pytest.raises(InvalidInput, match="token id"):
        encode_tokens_b64(tokens)


@pytest.mark.parametrize(
    "tokens",
    [
        [0, 1, 2**32 - 1],
        np.array([128_000, 7], dtype=np.int64),
        np.array([3], dtype=np.uint16),
        np.array([0, 2**32 - 1], dtype=np.uint32),  # in range by its type: no scan
        np.array([5, 2**32 - 2], dtype=">u4"),  # big-endian: swapped to the wire's order
        np.array([9, 2**32 - 1], dtype=np.uint64),
        [],
    ],
)
def test_valid_ids_round_trip(tokens: object) -> None:
    got = np.frombuffer(uint32_token_bytes(tokens), dtype="<u4")
    assert got.tolist() == list(np.asarray(tokens, dtype=np.int64).tolist())


def test_the_engine_client_refuses_before_any_call() -> None:
    client = EngineClient.__new__(EngineClient)  # no node needed: refused while packing
    with pytest.raises(InvalidInput, match="token id"):
        client._call("/engine/lookup", tokens=[2**32])


def test_kvatlas_route_with_an_id_over_uint32_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[1, 4294967296]")
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "route",
                "--url",
                "http://127.0.0.1:9",
                "--tokens-file",
                str(tokens),
                "--model-name",
                "m",
            ]
        )
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "token id 4294967296" in err and "Traceback" not in err
