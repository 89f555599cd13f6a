"""The shared token model (kvatlas/auth.py): roles as a set, bindings per token."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvatlas.auth import ANONYMOUS_ADMIN, TokenAuth
from kvatlas.errors import Forbidden, Unauthorized
from tests.helpers import write_tokens

NODE = "n" * 32
ENGINE = "e" * 32
PEER = "p" * 32
NO_SALTS = "s" * 32


def _auth(tmp_path: Path) -> TokenAuth:
    path = write_tokens(
        tmp_path / "tokens.json",
        {
            "token": NODE,
            "roles": ["emit", "lookup"],
            "instance_ids": ["node-a"],
            "cache_salts": ["t1"],
        },
        {"token": ENGINE, "roles": ["engine"], "cache_salts": ["t1"]},
        {"token": PEER, "role": "peer"},
        {"token": NO_SALTS, "roles": ["lookup", "engine"], "cache_salts": []},
    )
    return TokenAuth.from_file(path)


def test_roles_and_bindings(tmp_path: Path) -> None:
    auth = _auth(tmp_path)
    node = auth.authenticate(f"Bearer {NODE}")
    node.require_instance("node-a")
    node.require_salts(["t1"])
    node.require_salts(["t1"], role="emit")
    with pytest.raises(Forbidden):
        node.require_instance("node-b")
    with pytest.raises(Forbidden):
        node.require_salts(["t2"])
    with pytest.raises(Forbidden):
        node.require("admin")
    with pytest.raises(Forbidden):
        node.require_salts(["t1"], role="engine")
    assert not node.sees_everything
    engine = auth.authenticate(f"bearer {ENGINE}")
    engine.require_salts(["t1"], role="engine")
    with pytest.raises(Forbidden):
        engine.require_salts(["t1"])  # lookup is not engine
    peer = auth.authenticate(f"Bearer {PEER}")
    peer.require("peer")
    with pytest.raises(Forbidden):
        peer.require("engine")
    assert ANONYMOUS_ADMIN.may("emit", "peer") and ANONYMOUS_ADMIN.sees_everything


def test_a_token_bound_to_no_salts_may_use_none(tmp_path: Path) -> None:
    """``[]`` is a binding to no salt at all, not the unbound ``None`` (any salt)."""
    bound = _auth(tmp_path).authenticate(f"Bearer {NO_SALTS}")
    assert bound.cache_salts == frozenset()
    for salt in ("", "t1"):
        for role in ("lookup", "engine"):
            with pytest.raises(Forbidden):
                bound.require_salts([salt], role=role)
    assert bound.foreign_salts(["t1"]) == {"t1"}
    assert not bound.sees_everything
    bound.require_salts([])  # nothing asked: nothing refused


def test_unknown_and_malformed_tokens(tmp_path: Path) -> None:
    auth = _auth(tmp_path)
    for header in (None, "", "Basic abc", "Bearer ", f"Bearer {NODE}x"):
        with pytest.raises(Unauthorized):
            auth.authenticate(header)


@pytest.mark.parametrize(
    "entry",
    [
        {"token": "x" * 32, "roles": []},
        {"token": "x" * 32, "roles": ["root"]},
        {"token": "x" * 32, "role": "admin", "roles": ["admin"]},
        {"token": "x" * 32, "roles": "admin"},
        {"token": "x" * 32, "roles": ["lookup"], "cache_salts": "t1"},
        {"token": "short", "roles": ["admin"]},
    ],
)
def test_bad_entries_refused(tmp_path: Path, entry: dict[str, object]) -> None:
    path = write_tokens(tmp_path / "t.json", entry)  # private: refused for the entry, not the mode
    with pytest.raises(ValueError):
        TokenAuth.from_file(path)
