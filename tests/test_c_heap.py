"""The heap room a restore allocates its contents in (``kvatlas/c_heap.py``): what it asks of
glibc, with fakes; and, in a fresh process with the real glibc, that the range it faults in
is where the contents then land, and that it costs no resident memory beyond them."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest

from kvatlas import c_heap
from kvatlas.c_heap import (
    DEFAULT_TOP_PAD,
    M_MMAP_THRESHOLD,
    M_TOP_PAD,
    M_TRIM_THRESHOLD,
    MADV_POPULATE_WRITE,
    MMAP_THRESHOLD,
    PAGE,
    ROOM_MIN,
    TRIM_THRESHOLD,
    HeapRoom,
)
from kvatlas.directory.snapshot.token_section import ALLOCATE_PIECE, allocated_contents
from kvatlas.directory.token_store import content_sizes

LEFT = [  # what a room leaves: glibc's pad, and its thresholds pinned (they no longer slide)
    (M_TOP_PAD, DEFAULT_TOP_PAD),
    (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
    (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
]


class FakeGlibc:
    """``mallopt``, ``sbrk`` and ``madvise`` recorded; the break moves when told."""

    def __init__(self, brk: int = 100 * PAGE + 123) -> None:
        self.brk = brk
        self.options: list[tuple[int, int]] = []
        self.advised: list[tuple[int, int, int, str]] = []

    def mallopt(self, option: int, value: int) -> int:
        self.options.append((option, value))
        return 1

    def sbrk(self, increment: int) -> int:
        assert increment == 0
        return self.brk

    def madvise(self, address: int, length: int, advice: int) -> int:
        self.advised.append((address, length, advice, threading.current_thread().name))
        return 0

    def room(self, nbytes: int) -> HeapRoom:
        return HeapRoom(nbytes, mallopt=self.mallopt, sbrk=self.sbrk, madvise=self.madvise)


def test_the_room_pads_the_next_growth_and_faults_in_what_the_rest_of_the_burst_takes() -> None:
    glibc = FakeGlibc()
    start = glibc.brk
    with glibc.room(50 * PAGE * 1000) as room:
        assert glibc.options == [(M_TOP_PAD, 50 * PAGE * 1000)]
        room.made(40 * PAGE * 1000)  # not grown: the piece fitted in free blocks
        assert room.faulted is None
        glibc.brk = start + 60 * PAGE * 1000  # grown by the request and the pad
        room.made(30 * PAGE * 1000 + 17)
        glibc.brk += PAGE * 1000
        room.made(20 * PAGE * 1000)  # once only
    lo = -(-start // PAGE) * PAGE
    hi = (start + 30 * PAGE * 1000 + 17) // PAGE * PAGE
    assert room.faulted == (lo, hi)
    assert [a[:3] for a in glibc.advised] == [(lo, hi - lo, MADV_POPULATE_WRITE)]
    assert glibc.advised[0][3] == "kvatlas-heap-room"  # not the allocating thread
    assert glibc.options[1:] == LEFT


def test_the_room_ends_at_the_heaps_break() -> None:
    glibc = FakeGlibc(brk=64 * PAGE)
    with glibc.room(10**9) as room:
        glibc.brk = 64 * PAGE + 5 * PAGE + 100
        room.made(10**9)
    assert room.faulted == (64 * PAGE, 69 * PAGE)


def test_a_small_burst_or_a_missing_function_asks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    glibc = FakeGlibc()
    with glibc.room(ROOM_MIN - 1) as room:  # (its faults cost little: no process-wide change)
        glibc.brk += 10**6
        room.made(10**5)
    assert glibc.options == [] and glibc.advised == []
    monkeypatch.setattr(c_heap, "glibc", lambda name, *types: None)  # a C library without sbrk
    with HeapRoom(10**8, mallopt=glibc.mallopt, madvise=glibc.madvise) as room:
        room.made(10**5)
    assert glibc.options == [] and glibc.advised == []


def test_the_pad_is_glibcs_default_again_whatever_the_burst_raised() -> None:
    glibc = FakeGlibc()
    with pytest.raises(MemoryError), glibc.room(10**8):
        raise MemoryError
    assert glibc.options == [(M_TOP_PAD, 10**8), *LEFT]


def test_allocated_contents_are_the_zeroed_contents_piece_by_piece() -> None:
    n = 2 * ALLOCATE_PIECE + 77
    rng = np.random.default_rng(5)
    lens = rng.integers(0, 300, n).astype(np.int64)
    lens[rng.random(n) < 0.3] = 0
    forms = rng.choice(np.array([2, 4, 17, 18], np.int64), n)
    got = allocated_contents(lens, forms)
    sizes = content_sizes(lens, forms)
    assert len(got) == n
    for c, size, length in zip(got, sizes.tolist(), lens.tolist(), strict=True):
        if length == 0:
            assert c is None
        else:
            assert type(c) is bytes and len(c) == size and not any(c)


_FRESH = """
import json, resource, sys
import numpy as np
import kvatlas.c_heap as c_heap
from kvatlas.directory.snapshot import token_section
rooms = []
class Seen(c_heap.HeapRoom):
    def __exit__(self, *exc):
        rooms.append(self)
        return super().__exit__(*exc)
token_section.HeapRoom = Seen if sys.argv[1] == "room" else c_heap.HeapRoom
n = 200_000
lens = np.full(n, 256, np.int64)
forms = np.full(n, 17, np.int64)  # the planes form of Llama 3 ids: 546 bytes
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
token_section.allocated_contents(lens[:10], forms[:10])  # (kernels loaded: not counted)
rooms.clear()
before = rss()
contents = token_section.allocated_contents(lens, forms)
grown = rss() - before
at = np.fromiter(map(id, contents), np.int64)
lo, hi = rooms[0].faulted if rooms and rooms[0].faulted else (0, 0)
inside = float(((at >= lo) & (at + 546 <= hi)).mean())
print(json.dumps({"grown": grown, "inside": inside, "span": int(at.max() - at.min())}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap on Linux")
def test_in_a_fresh_process_the_room_is_where_the_contents_land_and_costs_no_memory() -> None:
    """With the real glibc: the faulted range holds most contents (those allocated after the
    heap grew), and the process grows by what the contents take, as it does without the room
    (the second run, the baseline: pages faulted in and never used would show here)."""
    runs = {}
    for mode in ("room", "none"):
        out = subprocess.run(
            [sys.executable, "-c", _FRESH, mode], capture_output=True, text=True, check=True
        )
        runs[mode] = json.loads(out.stdout)
    assert runs["room"]["inside"] >= 0.8, runs
    contents = 200_000 * 592  # glibc's block for a bytes object of 546
    assert runs["room"]["grown"] <= runs["none"]["grown"] + 4 * (1 << 20), runs
    assert runs["room"]["grown"] <= contents * 1.1, runs


def test_fault_in_asks_for_each_large_arrays_whole_pages_and_changes_nothing() -> None:
    glibc = FakeGlibc()
    big = np.arange(300_000, dtype=np.int64)  # 2.4 MB
    small = np.arange(1_000, dtype=np.int64)
    asked = c_heap.fault_in([big, small, big[1:]], madvise=glibc.madvise)
    ranges = [(a, n) for a, n, advice, _ in glibc.advised if advice == MADV_POPULATE_WRITE]
    assert len(ranges) == len(glibc.advised) == 2  # the small array is left alone
    for (address, length), arr in zip(ranges, (big, big[1:]), strict=True):
        start, end = arr.ctypes.data, arr.ctypes.data + arr.nbytes
        assert address % PAGE == 0 and length % PAGE == 0
        assert start <= address < start + PAGE and end - PAGE < address + length <= end
    assert asked == sum(n for _, n in ranges)
    # the real call (Linux >= 5.14; a no-op elsewhere): every value as it was
    before = big.copy()
    c_heap.fault_in([big])
    assert np.array_equal(big, before)
