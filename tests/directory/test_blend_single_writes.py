"""The blend index's single writes (``add``, ``remove_claim``, ``remove_chunk``, a batch of one
op: scalars, ``IndexState.apply_one``) against the column path (``IndexState.apply``) on the
same ops: the same state after every op, down to the kernels' arrays, and the same errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.directory import AddOp, BlendIndex, BlendOp, RemoveChunkOp, RemoveClaimOp
from kvatlas.directory.blend.kernels import REMOVE_CLAIM
from kvatlas.directory.blend.kernels.contents import content_count
from kvatlas.directory.blend.kernels.layout import TOKENS_U16
from kvatlas.directory.blend.op_columns import _sizes, single_op
from tests.directory.helpers import occupant_hashes
from tests.directory.test_blend_index_oracle import SPACES, canonical, workloads


def _tokens_as(form: str, tokens: list[int]) -> Any:
    """``tokens`` in one of the forms callers hand in: kept as they are, or copied, or
    converted (``form``)."""
    if form == "list":
        return list(tokens)
    if form == "wide":  # int64: converted and copied
        return np.array(tokens, np.int64)
    if form == "strided":  # a non-contiguous view: copied
        return np.repeat(np.array(tokens, np.uint32), 2)[::2]
    arr = np.array(tokens, np.uint16 if form == "u16" else np.uint32)
    if form != "writeable":
        arr.flags.writeable = False  # read-only and owning: kept by reference
    return arr


FORMS = st.sampled_from(["list", "wide", "strided", "u16", "u32", "writeable"])
BAD = st.sampled_from(
    [
        ("offset", -1),
        ("offset", 1 << 63),
        ("offset", "7"),
        ("hash", b"x" * 33),
        ("hash", 7),
        ("tokens", [[1, 2], [3, 4]]),
        ("tokens", [-1] * 4),
    ]
)


def _op(raw: tuple[Any, ...], form: str, bad: tuple[str, Any] | None) -> BlendOp:
    """A workload op with its tokens in ``form``, or made invalid by ``bad``."""
    kind, tokens, chunk_hash, *rest = raw
    fields: dict[str, Any] = {"tokens": _tokens_as(form, tokens), "hash": chunk_hash}
    if bad is not None:
        fields[bad[0]] = bad[1]
    if kind == "add":
        offset, ns = rest
        return AddOp(fields["tokens"], fields["hash"], fields.get("offset", offset), ns)
    if kind == "remove_claim":
        return RemoveClaimOp(fields["tokens"], fields["hash"], rest[0])
    return RemoveChunkOp(fields["tokens"], fields["hash"])


def _single(index: BlendIndex, op: BlendOp) -> None:
    """``op`` through the method of its name (a batch of one, applied with scalars)."""
    if isinstance(op, AddOp):
        index.add(*op)
    elif isinstance(op, RemoveClaimOp):
        index.remove_claim(*op)
    else:
        index.remove_chunk(*op)


def _state(index: BlendIndex) -> dict[str, Any]:
    """Everything an index holds, addresses aside (two indexes keep different objects): the
    kernels' arrays, what Python keeps for them, counters and namespace ids."""
    s = index._state
    a = s.arrays
    arrays = {n: arr.tolist() for n, arr in a._asdict().items() if n != "c_addr"}
    arrays["c_live"] = (a.c_addr != 0).tolist()
    arrays["c_u16"] = (a.c_addr & TOKENS_U16 != 0).tolist()
    return {
        "arrays": arrays,
        "tokens": [None if t is None else (t.dtype.str, t.tolist()) for t in s.tokens],
        "hashes": occupant_hashes(s),
        "owned": s.owned,
        "extra": s.extra_claims,
        "counts": (s.contents, s.occupants, s.claims, s.n_extra, s.owned_bytes, s.token_bytes),
        "namespaces": (s.namespaces._ids, s.namespaces.claims, s.namespaces._free),
        "stats": index.stats(),
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.data())
def test_single_writes_equal_the_column_path(
    workload: tuple[int, int, int | None, list[list[int]], list[tuple]], data: st.DataObject
) -> None:
    """Every op applied twice, to two indexes: by the single path and as a batch of one
    through the column path (an iterator, which ``apply`` never takes as a single op). The
    tokens come in every form a caller may hand in, some ops are invalid: after each op the
    two hold the same state, and an invalid op raises the same error in both and changes
    nothing."""
    chunk_size, stride, bits, pool, ops = workload
    # one fingerprint for both, so that their tables are alike slot by slot
    kwargs: dict[str, Any] = {"_fingerprint_base": data.draw(st.integers(2, (1 << 61) - 2))}
    if bits is not None:
        kwargs["_fingerprint_bits"] = bits
    single = BlendIndex(chunk_size=chunk_size, probe_stride=stride, **kwargs)
    columns = BlendIndex(chunk_size=chunk_size, probe_stride=stride, **kwargs)
    for raw in ops:
        if raw[0] == "match":
            query = [t for piece in raw[1] for t in piece]
            assert canonical(single.match(query, raw[2])) == canonical(columns.match(query, raw[2]))
            continue
        bad = data.draw(st.one_of(st.none(), st.none(), st.none(), BAD))
        op = _op(raw, data.draw(FORMS), bad)
        errors = []
        for index, write in ((single, _single), (columns, lambda i, o: i.apply(iter([o])))):
            try:
                write(index, op)
            except (ValueError, TypeError) as exc:
                errors.append((type(exc), str(exc)))
        assert len(errors) in (0, 2), errors
        assert errors[:1] == errors[1:]
        assert _state(single) == _state(columns)
    query = [t for c in pool for t in c]
    for ns in SPACES:
        assert canonical(single.match(query, ns)) == canonical(columns.match(query, ns))


def test_a_batch_of_one_op_takes_the_single_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``apply`` with a list or tuple of one op (what the directory's flush may hand in)
    applies it with scalars; an iterator, or two ops, go through the columns."""
    index = BlendIndex(chunk_size=2)
    calls: list[str] = []
    state = type(index._state)
    for name in ("apply", "apply_one"):
        real = getattr(state, name)
        monkeypatch.setattr(
            state, name, lambda self, x, real=real, name=name: calls.append(name) or real(self, x)
        )
    op = AddOp([1, 2], b"h", 0, SPACES[0])
    index.apply([op])
    index.apply((op,))
    index.apply(iter([op]))
    index.apply([op, op])
    assert calls == ["apply_one", "apply_one", "apply", "apply"]


def test_single_writes_equal_the_column_path_through_growth_and_rebuilds() -> None:
    """The write context (the arrays' addresses and sizes) must be made again whenever the
    index replaces an array: contents and occupants grown past their first capacity, the
    table doubled, the extra-claim set grown, the table and filter rebuilt after removals.
    (The workloads above stay within the first capacity.) Thousands of single writes, each
    also applied through the column path: the same state at every stage, the same matches."""
    rng = np.random.default_rng(7)
    chunk, n = 4, 3000
    contents = [rng.integers(0, 1 << 20, chunk, dtype=np.uint32) for _ in range(n)]
    hashes = [i.to_bytes(4, "little") for i in range(n)]
    base = {"_fingerprint_base": 1_000_003}
    single = BlendIndex(chunk_size=chunk, **base)
    columns = BlendIndex(chunk_size=chunk, **base)

    def both(op: BlendOp) -> None:
        _single(single, op)
        columns.apply(iter([op]))

    for i in range(n):  # contents, occupants and the table grow; extra claims from the 2nd
        for ns in SPACES[: 1 + i % len(SPACES)]:
            both(AddOp(contents[i], hashes[i], i, ns))
    before = single.stats()
    assert before.content_capacity > 1024 and before.table_slots > 2048
    assert _state(single) == _state(columns)
    for i in range(0, n, 2):  # enough removed contents to rebuild table and filter
        both(RemoveChunkOp(contents[i], hashes[i]))
    for i in range(1, n, 4):
        both(RemoveClaimOp(contents[i], hashes[i], SPACES[0]))
    assert _state(single) == _state(columns)
    for i in range(0, n, 2):  # free ids reused
        both(AddOp(contents[i], hashes[i], i + 1, SPACES[1]))
    assert _state(single) == _state(columns)
    for i in range(0, n, 7):
        for ns in SPACES:
            assert canonical(single.match(contents[i], ns)) == canonical(
                columns.match(contents[i], ns)
            )
    assert len(single.match(contents[0], SPACES[1])) == 1


@pytest.mark.parametrize("chunk", [1, 4, 16, 17, 256])
def test_a_single_writes_content_check_is_content_counts(chunk: int) -> None:
    """A ``bytes`` content of a single write is checked by one lookup of its header and
    length (``op_columns._sizes``) where ``content_count`` would say it holds ``chunk`` ids,
    else by ``content_count``: every header and every length near each form's is taken,
    skipped or refused exactly as ``content_count`` decides (negative control: a content one
    byte short of a listed length is not taken)."""
    ns = SPACES[0]
    lengths = {2 + 2 * chunk, 4 + 4 * chunk}
    lengths |= {2 + 2 * chunk + 2 * h * ((chunk + 15) // 16) for h in range(1, 10)}
    taken = 0
    for b0 in range(11):
        for b1 in range(7):
            for size in {0, 1, 2, 3} | {n + d for n in lengths for d in range(-3, 4)}:
                content = bytes([b0, b1][:size]) + bytes(max(0, size - 2))
                try:
                    want: str | int = content_count(content)
                except ValueError:
                    want = "refused"
                try:
                    op = single_op(REMOVE_CLAIM, content, b"h", 0, ns, chunk)
                    got: str | int = chunk if op is not None else "skipped"
                except ValueError:
                    got = "refused"
                if want == chunk:
                    taken += 1
                    assert got == chunk, (b0, b1, size)
                else:
                    assert got == ("refused" if want == "refused" else "skipped"), (b0, b1, size)
    assert taken == len(_sizes(chunk)) == 10
