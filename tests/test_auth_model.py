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


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({"token": "x" * 32, "roles": ["lookup"], "cache_salt": ["t1"]}, "cache_salt"),
        ({"token": "x" * 32, "roles": ["emit"], "instance_id": ["n1"]}, "instance_id"),
        ({"token": "x" * 32, "roles": ["cache"], "salts": ["t1"]}, "salts"),
    ],
)
def test_an_unknown_field_is_refused_naming_it(
    tmp_path: Path, entry: dict[str, object], field: str
) -> None:
    """A binding under a misspelt name was ignored: the token started unbound (``None``:
    any), so a tenant's token read every tenant's namespace, an emitter's acted for every
    instance. An entry's unknown field is refused, named; ``name`` is one of its fields."""
    path = write_tokens(tmp_path / "t.json", entry)
    with pytest.raises(ValueError, match=rf"tokens\[0\]: unknown field '{field}'"):
        TokenAuth.from_file(path)
    named = write_tokens(tmp_path / "n.json", {"token": "x" * 32, "role": "peer", "name": "ops"})
    assert TokenAuth.from_file(named).authenticate(f"Bearer {'x' * 32}").name == "ops"


def test_a_token_listed_twice_is_refused(tmp_path: Path) -> None:
    """A token listed twice took its *last* entry's roles and bindings: a tenant's
    salt-bound lookup token pasted again below as admin became admin for every salt, without
    a word, and which entry applied was the order of the file's lines. Refused, naming both
    entries (not the token)."""
    path = write_tokens(
        tmp_path / "t.json",
        {"token": NODE, "roles": ["lookup"], "cache_salts": ["t1"]},
        {"token": PEER, "role": "peer"},
        {"token": NODE, "roles": ["admin"]},
    )
    with pytest.raises(ValueError, match=r"tokens\[2\] repeats the token of tokens\[0\]") as err:
        TokenAuth.from_file(path)
    assert NODE not in str(err.value)
