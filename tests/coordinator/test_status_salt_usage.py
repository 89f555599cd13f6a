"""The status page counts each salt's L2 bytes (a pass over the whole directory) no more often
than it can afford: the last count is reused until it is 5 s old and 20 times as old as the
pass took, so a large directory and many open tabs cost at most a twentieth of a core; the
page says how old the count is. A fake clock: no wall-clock assertions."""

from __future__ import annotations

from kvatlas.coordinator.cache_control.status import (
    USAGE_COST_FACTOR,
    USAGE_MIN_AGE_S,
    SaltUsageCache,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_count_is_reused_until_it_is_old_enough_for_what_it_cost() -> None:
    clock = Clock()
    passes: list[float] = []
    cost_s = 0.0

    def count() -> dict[str, int]:
        passes.append(clock.now)
        clock.now += cost_s  # the pass takes this long
        return {"t": len(passes)}

    usage = SaltUsageCache(count, clock)
    assert (usage.get().bytes, usage.get().bytes) == ({"t": 1}, {"t": 1})  # one pass
    clock.now += USAGE_MIN_AGE_S - 0.5
    assert (usage.get().bytes, usage.get().age_s) == ({"t": 1}, USAGE_MIN_AGE_S - 0.5)
    clock.now += 0.5
    assert usage.get().bytes == {"t": 2}  # cheap passes: renewed every USAGE_MIN_AGE_S
    # a pass that takes 2 s is renewed only after 20 x 2 s, counted from when it ended
    clock.now += USAGE_MIN_AGE_S
    cost_s = 2.0
    assert usage.get().bytes == {"t": 3}
    ended = clock.now
    clock.now = ended + USAGE_COST_FACTOR * cost_s - 0.1
    assert usage.get().bytes == {"t": 3}
    clock.now = ended + USAGE_COST_FACTOR * cost_s
    assert usage.get().bytes == {"t": 4}
    assert len(passes) == 4
