"""How a request's bad fields are reported: a 422 whose ``errors`` list names each bad field as
``{"loc", "msg", "type"}`` and whose ``detail`` is the first one, ``where: what``. The request
bodies of LMCache's own routes (registration, chunk size, prefix lookup, the key listing's
query) are refused this way: the shape LMCache's (pydantic) coordinator answers, which its
clients may read. msgspec says the same in its own words; :func:`field_error` words it as they
expect. Shared by every service (the dispatcher decodes request bodies with :func:`decode_body`).

Strict unless a type says otherwise: ``"1"`` and ``1.0`` are not the integer 1, ``"NaN"`` is
not a number, and a key given twice in one object is refused rather than read as its last
value. A request type that LMCache reads laxly and whose laxness is part of the contract
(registration: ``"8000"`` is a port) sets ``LAX_NUMBERS``.
"""

from __future__ import annotations

import json
import re
import typing
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, TypeGuard, TypeVar

import msgspec

from kvatlas.errors import Unprocessable

T = TypeVar("T")
_decoders: dict[tuple[Any, bool], msgspec.json.Decoder[Any]] = {}


def _decoder(type_: type[T], strict: bool) -> msgspec.json.Decoder[T]:
    found = _decoders.get((type_, strict))
    if found is None:
        found = _decoders[type_, strict] = msgspec.json.Decoder(type_, strict=strict)
    return found


_EXPECTED = re.compile(r"Expected `([^`]*)`(?:, got `([^`]*)`)?(?: ([<>]=?) (\S+))?")
_MISSING = re.compile(r"Object missing required field `([^`]*)`")
_AT = re.compile(r" - at `\$(.*)`$")
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_TYPES = {
    "str": ("Input should be a valid string", "string_type"),
    "array": ("Input should be a valid list", "list_type"),
    "bool": ("Input should be a valid boolean", "bool_type"),
    "float": ("Input should be a valid number", "float_type"),
    "object": ("Input should be a valid dictionary", "dict_type"),
    "int": ("Input should be a valid integer", "int_type"),
}
_LAX_INT = {
    "str": ("Input should be a valid integer, unable to parse string as an integer", "int_parsing"),
    "float": (
        "Input should be a valid integer, got a number with a fractional part",
        "int_from_float",
    ),
}
_BOUNDS = {
    ">=": ("greater_than_equal", "greater than or equal to"),
    "<=": ("less_than_equal", "less than or equal to"),
    ">": ("greater_than", "greater than"),
    "<": ("less_than", "less than"),
}
ROOT_NOT_OBJECT = "Input should be a valid dictionary or object to extract fields from"


def field_errors(
    errors: Sequence[Mapping[str, Any]], prefix: tuple[str | int, ...] = ()
) -> Unprocessable:
    """Field errors (``loc``, ``msg``, ``type``) as one 422 whose ``detail`` names the first bad
    field (``where: what``, ``body`` left out) and whose ``errors`` lists them all (``prefix``
    leads every ``loc``)."""
    listed = [
        {
            "loc": [*prefix, *e.get("loc", ())],
            "msg": str(e.get("msg", "")),
            "type": str(e.get("type", "")),
        }
        for e in errors
    ]
    first = listed[0] if listed else {"loc": [], "msg": "invalid request"}
    where = ".".join(str(p) for p in first["loc"] if p != "body")
    return Unprocessable(f"{where}: {first['msg']}" if where else str(first["msg"]), errors=listed)


def field_error(exc: msgspec.ValidationError, type_: type, *, strict: bool) -> dict[str, Any]:
    """msgspec's refusal of a value for ``type_`` as a field error: where (``loc``), what
    (``msg``) and its kind (``type``). A nested Struct that is not an object is named by its
    class; a lax (``strict=False``) integer field says why a string or fraction is not one."""
    text = str(exc)
    at = _AT.search(text)
    loc: list[str | int] = []
    if at is not None:
        loc = [int(i) if i else name for name, i in _STEP.findall(at.group(1))]
        text = text[: at.start()]
    missing = _MISSING.fullmatch(text)
    if missing is not None:
        return {"loc": [*loc, missing.group(1)], "msg": "Field required", "type": "missing"}
    expected = _EXPECTED.fullmatch(text)
    if expected is None:
        bounds = _number_bounds(type_, loc) if text == "Number out of range" else None
        if bounds is not None:  # 1e400: no float holds it
            return {"loc": loc, "msg": f"Input should be a finite number {bounds}", "type": "finite_number"}  # fmt: skip
        return {"loc": loc, "msg": text, "type": "value_error"}
    want, got, op, bound = expected.groups()
    if want.startswith("float"):
        bounds = _number_bounds(type_, loc)
        if bounds is not None:  # a string ("NaN"), or out of range: say what a value may be
            kind = _BOUNDS[op][0] if op is not None else "float_type"
            return {"loc": loc, "msg": f"Input should be a finite number {bounds}", "type": kind}
    if op is not None:
        kind, words = _BOUNDS[op]
        return {"loc": loc, "msg": f"Input should be {words} {bound}", "type": kind}
    want = next((w for w in want.split(" | ") if w != "null"), want)
    if want == "object" and _is_struct(_type_at(type_, loc)):
        named = _type_at(type_, loc)
        msg = f"Input should be a valid dictionary or instance of {named.__name__}"
        return {"loc": loc, "msg": msg, "type": "model_type"}
    if want == "int" and not strict and got in _LAX_INT:
        msg, kind = _LAX_INT[got]
        return {"loc": loc, "msg": msg, "type": kind}
    msg, kind = _TYPES.get(want, (text, "value_error"))
    return {"loc": loc, "msg": msg, "type": kind}


def _is_struct(value: object) -> TypeGuard[type[msgspec.Struct]]:
    return isinstance(value, type) and issubclass(value, msgspec.Struct)


def _type_at(type_: Any, loc: Sequence[str | int]) -> Any:
    """The declared type at ``loc`` inside ``type_`` (Optional and Annotated unwrapped)."""
    for step in loc:
        type_ = _unwrap(type_)
        if isinstance(step, str) and _is_struct(type_):
            type_ = typing.get_type_hints(type_, include_extras=True).get(step)
        elif isinstance(step, int) and typing.get_origin(type_) is list:
            type_ = typing.get_args(type_)[0]
        else:
            return None
    return _unwrap(type_)


def _number_bounds(type_: Any, loc: Sequence[str | int]) -> str | None:
    """The bounds of the ``float`` field at ``loc`` inside ``type_`` as words (``>= 0 and <=
    8589934592``); ``None`` when it is no bounded float field."""
    if not loc or not isinstance(loc[-1], str):
        return None
    parent = _type_at(type_, loc[:-1])
    if not _is_struct(parent):
        return None
    declared = typing.get_type_hints(parent, include_extras=True).get(loc[-1])
    args = [a for a in typing.get_args(declared) if a is not type(None)]
    if type(None) in typing.get_args(declared) and len(args) == 1:
        declared = args[0]  # Optional: the number's bounds
    if typing.get_origin(declared) is not Annotated:
        return None
    base, *metas = typing.get_args(declared)
    if base is not float:
        return None
    words = [
        f"{op} {_plain(value)}"
        for meta in metas
        if isinstance(meta, msgspec.Meta)
        for op, value in ((">=", meta.ge), (">", meta.gt), ("<=", meta.le), ("<", meta.lt))
        if value is not None
    ]
    return " and ".join(words) or None


def _plain(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _unwrap(type_: Any) -> Any:
    if typing.get_origin(type_) is Annotated:
        type_ = typing.get_args(type_)[0]
    args = [a for a in typing.get_args(type_) if a is not type(None)]
    if type(None) in typing.get_args(type_) and len(args) == 1:
        return _unwrap(args[0])
    return type_


def decode_fields(raw: bytes, type_: type[T], *, strict: bool = True) -> T:
    """``raw`` JSON as a ``type_`` (``strict=False``: numbers in strings and integral floats
    are integers, as LMCache's lax models read them), or a 422 of :func:`field_errors` under
    ``body``: JSON that does not parse is ``json_invalid`` at its character offset."""
    try:
        return _decoder(type_, strict).decode(raw)
    except msgspec.ValidationError as exc:
        error = field_error(exc, type_, strict=strict)
        if not error["loc"] and error["type"] == "model_type":  # the body itself
            error = {"loc": [], "msg": ROOT_NOT_OBJECT, "type": "model_attributes_type"}
        raise field_errors([error], ("body",)) from None
    except msgspec.DecodeError:
        raise field_errors([json_invalid(raw)], ("body",)) from None


def decode_body(raw: bytes, content_type: str | None, type_: type[T]) -> T:
    """A request body of ``type_`` read as LMCache's coordinator reads one: JSON only when the
    request says so (``application/json`` or ``application/*+json``); an empty body is a
    missing one. Strict (:func:`decode_fields`) unless ``type_`` sets ``LAX_NUMBERS``; a key
    given twice in one object is a 422 naming it (:func:`check_unique_keys`)."""
    if not raw:
        raise field_errors([{"loc": [], "msg": "Field required", "type": "missing"}], ("body",))
    if not is_json(content_type):
        error = {"loc": [], "msg": ROOT_NOT_OBJECT, "type": "model_attributes_type"}
        raise field_errors([error], ("body",))
    body = decode_fields(raw, type_, strict=not getattr(type_, "LAX_NUMBERS", False))
    check_unique_keys(raw)
    return body


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return found


def check_unique_keys(raw: bytes) -> None:
    """A 422 naming the first key given twice in one object of the JSON ``raw`` (which
    msgspec, as most decoders, reads as its last value: a body that says ``world_size`` twice
    does not say which it means). A parse by the standard library's C scanner with a check per
    object: for the routes whose bodies are small or rare (registration, cache control,
    quotas), not for the hot ones (``POST /events``, the lookups; docs/coordinator.md)."""
    try:
        json.loads(raw, object_pairs_hook=_unique_pairs)
    except _DuplicateKey as dup:
        msg = f"Duplicate key {dup.key!r:.80}: a key may be given once per object"
        raise field_errors(
            [{"loc": [dup.key], "msg": msg, "type": "duplicate_key"}], ("body",)
        ) from None
    except (ValueError, RecursionError):  # msgspec read it: what it took stands
        pass


_INTEGER = re.compile(r"-?[0-9]+")
_int_params: dict[type, frozenset[str]] = {}


def check_query_pairs(pairs: Sequence[tuple[str, str]], type_: type) -> None:
    """A 422 for a query parameter given twice (``limit=1&limit=2``: which one?) or, for an
    integer field of ``type_``, not written as an integer's digits: a query string is text,
    converted laxly, which reads ``limit=1.0`` and ``limit=1e3`` as numbers."""
    names = _int_params.get(type_)
    if names is None:
        names = _int_params[type_] = frozenset(
            f.encode_name for f in msgspec.structs.fields(type_) if _unwrap(f.type) is int
        )
    seen: set[str] = set()
    for name, value in pairs:
        if name in seen:
            msg = f"Duplicate query parameter {name!r:.80}: a parameter may be given once"
            raise field_errors([{"loc": [name], "msg": msg, "type": "duplicate_key"}], ("query",))
        seen.add(name)
        if name in names and _INTEGER.fullmatch(value) is None:
            msg, kind = _LAX_INT["str"]
            raise field_errors([{"loc": [name], "msg": msg, "type": kind}], ("query",))


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type names JSON (``application/json``, ``application/<x>+json``)."""
    if content_type is None:
        return False
    media = content_type.partition(";")[0].strip().lower()
    kind, _, subtype = media.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def json_invalid(raw: bytes) -> dict[str, Any]:
    """The field error of a body that is not JSON: where it stops being JSON (a character
    offset, as Python's parser counts it)."""
    try:
        json.loads(raw)
        offset = 0
    except json.JSONDecodeError as exc:
        offset = exc.pos
    except (UnicodeDecodeError, RecursionError):
        offset = 0
    return {"loc": [offset], "msg": "JSON decode error", "type": "json_invalid"}
