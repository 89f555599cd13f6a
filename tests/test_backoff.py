"""``kvatlas.backoff.Backoff``: steps double up to the cap, each wait is 50-100% of its step,
a step is reported once, a reset starts over (and is reported anew)."""

from __future__ import annotations

import pytest

from kvatlas.backoff import Backoff


def test_steps_double_to_the_cap_and_each_is_reported_once() -> None:
    jitters = iter([0.0, 1.0, 0.5, 0.0, 0.0, 1.0])
    backoff = Backoff(0.1, 0.5, jitter=lambda: next(jitters))
    told, waits = [], []
    for _ in range(6):
        told.append(backoff.report())
        waits.append(backoff.next_wait())
    assert waits == pytest.approx([0.05, 0.2, 0.3, 0.25, 0.25, 0.5])  # steps .1 .2 .4 .5 .5 .5
    assert told == [True, True, True, True, False, False]
    backoff.reset()
    assert (backoff.step, backoff.report()) == (0.1, True)


def test_an_initial_step_above_the_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="initial"):
        Backoff(1.0, 0.5)
