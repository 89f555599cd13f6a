"""The ``--kv-events-*`` flags (also ``KVATLAS_KV_EVENTS_*``), docs/kv-events.md."""

from __future__ import annotations

import pytest

from kvatlas.coordinator.config import parse_config


def test_endpoints_are_split_and_replay_is_paired_by_position() -> None:
    cfg = parse_config(
        ["--kv-events-subscribe", "tcp://a:1, tcp://b:1", "--kv-events-replay", ",tcp://b:2"]
    )
    assert cfg.kv_events_endpoints == ("tcp://a:1", "tcp://b:1")
    assert cfg.kv_events_replay_endpoints == (None, "tcp://b:2")
    env = parse_config([], {"KVATLAS_KV_EVENTS_SUBSCRIBE": "tcp://e:1"})
    assert env.kv_events_endpoints == ("tcp://e:1",) and env.kv_events_replay_endpoints == ()
    assert parse_config([]).kv_events_endpoints == ()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-events-subscribe", "tcp://a:1", "--kv-events-replay", "tcp://a:2,tcp://b:2"],
         "pairs"),
        (["--kv-events-replay-bind", "tcp://*:2"], "needs --kv-events-publish"),
        (["--kv-events-max-blocks", "0"], "--kv-events-max-blocks"),
        (["--kv-events-max-message-bytes", "0"], "--kv-events-max-message-bytes"),
        (["--kv-events-replay-size", "0"], "--kv-events-replay-size"),
        (["--kv-events-model", "a@b"], "@"),
        (["--kv-events-publish-encoding", "json"], "--kv-events-publish-encoding"),
    ],
)  # fmt: skip
def test_bad_flags_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_config(argv)


def test_an_endpoint_that_cannot_be_used_is_refused_at_start() -> None:
    import threading

    from kvatlas.coordinator.kv_events.links import KvEventsLinks
    from kvatlas.directory import KeyDirectory
    from kvatlas.errors import Unavailable

    for argv, flag in (
        (["--kv-events-publish", "tcp://no-such-transport"], "--kv-events-publish"),
        (["--kv-events-subscribe", "bogus://x"], "--kv-events-subscribe"),
    ):
        links = KvEventsLinks.from_config(
            parse_config(argv), KeyDirectory(256), lambda b: None, threading.Event()
        )
        with pytest.raises(Unavailable, match=flag):
            links.start()


def test_the_default_block_bound_holds_the_fleet_benchmarks_engines() -> None:
    """Every block the fleet benchmark's engines hold (GPU + CPU offload) fits the default
    --kv-events-max-blocks: below it the coordinator evicts blocks the engines still hold."""
    from kvatlas.bench.fleet.config import FleetConfig

    fleet = FleetConfig("rag:", ())
    held = fleet.engines * (fleet.gpu_blocks + fleet.host_blocks)
    assert held == 691_200
    assert parse_config([]).kv_events_max_blocks >= held
