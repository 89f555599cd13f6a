"""LMCache's golden coordinator exchanges (``data/``, copied from ``shared/wire/``) and the
shape comparison both directions use: replies kvatlas answers (tests/coordinator/
test_lmcache_conformance.py) and requests kvatlas's clients send (tests/client/
test_wire_shapes.py). See shared/spec/lmcache-conformance.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).with_name("data")
GOLDENS = sorted(DATA.glob("lmcache-*-coordinator.json"))


def load(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def shape_problems(
    want: Any,
    got: Any,
    where: str = "$",
    names: tuple[str, str] = ("LMCache", "kvatlas"),
    open_defaults: bool = False,
) -> list[str]:
    """Every field of ``want`` present in ``got`` with the same JSON type; each item of a
    list has the shape of some item of ``got``'s list (counts and order are semantic, not
    shape). ``names`` say whose each side is. With ``open_defaults`` a ``null`` or ``{}`` in
    ``got`` accepts anything (an optional or free-form field of a pydantic model)."""
    theirs, ours = names
    if open_defaults and (got is None or got == {}):
        return []
    if json_type(want) != json_type(got):
        return [f"{where}: {theirs} {json_type(want)} {want!r:.60}, {ours} {got!r:.60}"]
    if isinstance(want, dict):
        out = []
        for name, value in want.items():
            if name not in got:
                out.append(f"{where}.{name}: {ours} has no such field ({theirs} {value!r:.60})")
            else:
                out += shape_problems(value, got[name], f"{where}.{name}", names, open_defaults)
        return out
    if isinstance(want, list):
        out = []
        for i, item in enumerate(want):
            tries = [shape_problems(item, g, f"{where}[{i}]", names, open_defaults) for g in got]
            if not tries:
                out.append(f"{where}[{i}]: {ours} has no items here")
            elif all(tries):
                out += min(tries, key=len)
        return out
    return []


def request_template(method: str, route: str) -> Any:
    """Every request body LMCache's clients sent to ``method route`` and LMCache accepted
    (both versions), merged into one: objects by field, lists concatenated. A field LMCache
    sent as ``null`` or ``{}`` is open (any value: optional, or free-form)."""
    bodies = [
        e["body"]
        for golden in GOLDENS
        for e in load(golden)["exchanges"]
        if e["method"] == method
        and path_route(e["path"]) == route
        and 200 <= e["lmcache_status"] < 300
        and isinstance(e["body"], dict)
    ]
    if not bodies:
        raise KeyError(f"no golden request for {method} {route}")
    merged: Any = bodies[0]
    for body in bodies[1:]:
        merged = _merge(merged, body)
    return merged


def _merge(a: Any, b: Any) -> Any:
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _merge(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in a | b}
    if isinstance(a, list) and isinstance(b, list):
        return a + b
    return b if a is None else a


def request_problems(body: Any, template: Any) -> list[str]:
    """What of a kvatlas client's request LMCache's clients never send (name or type)."""
    return shape_problems(body, template, names=("kvatlas", "LMCache"), open_defaults=True)


def path_route(path: str) -> str:
    """The route of a golden path: ``/instances/mp-a/heartbeat`` -> ``/instances/{id}/heartbeat``."""
    parts = path.split("?")[0].split("/")
    if len(parts) >= 3 and parts[1] == "instances" and parts[2] != "usage":
        parts[2] = "{id}"
    return "/".join(parts)
