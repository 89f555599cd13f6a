"""Node flags: every one described by ``kvatlas node --help``, the same names as the
coordinator's for the same concept, the old ``--enable-blend`` spelling still accepted."""

from __future__ import annotations

import argparse
import logging
import pkgutil
from pathlib import Path

import pytest

import kvatlas.node
from kvatlas.cli import _build_parser
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.events import EVENT_TRANSPORTS
from kvatlas.keys import DEFAULT_CHUNK_SIZE
from kvatlas.node.config import NodeConfig, add_arguments, config_from_args, default_l2_path

LAYOUT = ("--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8")


def node_args(*argv: str) -> argparse.Namespace:
    """``kvatlas node``'s flags, with a KV layout (which the command refuses to guess)."""
    return _build_parser().parse_args(["node", *LAYOUT, *argv])


def test_every_flag_has_help() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    described = [a for a in parser._actions if a.help not in (None, argparse.SUPPRESS)]
    for action in described:
        if action.dest == "help":
            continue
        assert action.help is not None and not action.help.startswith("["), action.dest
    fields = set(NodeConfig.__dataclass_fields__)
    assert fields == {a.dest for a in described} - {"help"}


def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        node_args("--help")
    out = capsys.readouterr().out
    for name in NodeConfig.__dataclass_fields__:
        assert "--" + name.replace("_", "-") in out
    assert "--enable-blend " not in out and "--enable-blend," not in out  # the alias is hidden


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        ((), {}, True),
        (("--no-enable-blend-lookup",), {}, False),
        (("--no-enable-blend",), {}, False),  # the old spelling
        (("--enable-blend",), {"KVATLAS_ENABLE_BLEND_LOOKUP": "0"}, True),
        ((), {"KVATLAS_ENABLE_BLEND": "0"}, False),  # the old variable
        ((), {"KVATLAS_ENABLE_BLEND": "0", "KVATLAS_ENABLE_BLEND_LOOKUP": "1"}, True),
    ],
)
def test_enable_blend_lookup_and_its_old_spelling(
    argv: tuple[str, ...], environ: dict[str, str], expected: bool
) -> None:
    assert config_from_args(node_args(*argv), environ).enable_blend_lookup is expected


def test_shared_names_and_defaults() -> None:
    assert NodeConfig().chunk_size == DEFAULT_CHUNK_SIZE == CoordinatorConfig().chunk_size
    for transport in EVENT_TRANSPORTS:
        NodeConfig(event_transport=transport, redis_url="redis://x")
        CoordinatorConfig(event_transport=transport, redis_url="redis://x")
    for config in (NodeConfig, CoordinatorConfig):
        with pytest.raises(ValueError, match="--event-transport must be one of http, redis"):
            config(event_transport="carrier-pigeon")


def test_every_node_logger_is_under_kvatlas_node(caplog: pytest.LogCaptureFixture) -> None:
    """Modules log under their own name, so ``kvatlas.node`` still catches them all."""
    names = [m.name for m in pkgutil.iter_modules(kvatlas.node.__path__)]
    loggers = []
    for name in names:
        module = __import__(f"kvatlas.node.{name}", fromlist=["log"])
        log = getattr(module, "log", None)
        if log is not None:
            assert log.name in (f"kvatlas.node.{name}", "kvatlas.node")
            loggers.append(log)
    assert len(loggers) >= 5
    with caplog.at_level(logging.WARNING, logger="kvatlas.node"):
        for log in loggers:
            log.warning("from %s", log.name)
    assert {r.name for r in caplog.records} == {log.name for log in loggers}


def test_l2_path_defaults_to_the_per_user_cache_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Not a directory relative to wherever the node was started (issue 15 item 5)."""
    assert default_l2_path({"XDG_CACHE_HOME": "/x/cache"}) == Path("/x/cache/kvatlas/l2")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_l2_path({}) == tmp_path / ".cache" / "kvatlas" / "l2"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert NodeConfig().l2_path == tmp_path / "xdg" / "kvatlas" / "l2"
    assert NodeConfig(l2_path=Path("here")).l2_path == Path("here")


def test_heartbeat_interval_flag_environment_and_bounds() -> None:
    """``--heartbeat-interval-s`` (5 s by default; the soak runs 1 s against a 3 s timeout)."""
    assert NodeConfig().heartbeat_interval_s == 5.0
    assert (
        config_from_args(node_args("--heartbeat-interval-s", "1"), {}).heartbeat_interval_s == 1.0
    )
    from_env = config_from_args(node_args(), {"KVATLAS_HEARTBEAT_INTERVAL_S": "2.5"})
    assert from_env.heartbeat_interval_s == 2.5
    for bad in (0.0, 3601.0):
        with pytest.raises(ValueError, match="--heartbeat-interval-s"):
            NodeConfig(heartbeat_interval_s=bad)


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf"), 3601.0])
def test_the_fleet_refresh_interval_is_bounded(bad: float) -> None:
    """``--fleet-refresh-interval-s`` took NaN, -1 and inf: the fleet view then asked the
    coordinator for its instances on every peer lookup (negative, NaN) or never after the first
    (inf: peers that joined later were never tried). [0, 3600] s: 0 re-reads the list at every
    peer ask, on purpose (the fleet tests' setting: a peer seen at once)."""
    for good in (0.0, 3600.0):
        assert NodeConfig(fleet_refresh_interval_s=good).fleet_refresh_interval_s == good
    with pytest.raises(ValueError, match=r"--fleet-refresh-interval-s must be in \[0, 3600\]"):
        NodeConfig(fleet_refresh_interval_s=bad)


def test_event_delivery_retries_at_least_once_per_heartbeat() -> None:
    """Found by ``kvatlas soak``: after a Redis restart the nodes' event sinks waited up to
    their fixed 5 s backoff cap before delivering again, past the convergence target (twice
    the heartbeat interval) of a fleet heartbeating every second. A node's sink now retries
    at least once per ``--heartbeat-interval-s`` and per 5 s (the default: unchanged)."""
    from kvatlas.asgi_thread import free_port
    from kvatlas.node.server import NodeProcess

    for heartbeat, retry_max in ((1.0, 1.0), (5.0, 5.0), (30.0, 5.0)):
        config = NodeConfig(
            model_name="m", num_layers=1, num_kv_heads=1, head_dim=8, chunk_size=16,
            dtype="float32", l2="none", instance_id="n1", port=free_port(),
            coordinator_url=f"http://127.0.0.1:{free_port()}",  # nobody there: deferred
            coordinator_event_reporting=True, heartbeat_interval_s=heartbeat,
        )  # fmt: skip
        process = NodeProcess(config, start=False)
        try:
            assert process.sink is not None
            assert process.sink.backoff_max == retry_max
            process.sink.close(timeout=0)  # (nobody to deliver to: not the 5 s drain a close gives)
        finally:
            process.close()


def test_kvatlas_node_refuses_to_guess_the_kv_layout(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --hf-config or the three shape flags, no toy layout: exit 2, saying what to give."""
    from kvatlas.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["node", "--port", "0", "--num-layers", "4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--num-kv-heads, --head-dim" in err and "--hf-config" in err


def test_engine_id_flag_environment_and_refusals() -> None:
    """``--engine-id`` (``KVATLAS_ENGINE_ID``): the engine this node serves, an instance id,
    never the node's own, and only with a coordinator (it is said at registration)."""
    url = ("--coordinator-url", "http://127.0.0.1:9300")
    assert config_from_args(node_args(*url, "--engine-id", "pod-a"), {}).engine_id == "pod-a"
    env = {"KVATLAS_ENGINE_ID": "pod-a:dp1"}
    assert config_from_args(node_args(*url), env).engine_id == "pod-a:dp1"
    assert NodeConfig().engine_id is None  # not set by default
    for argv, says in [
        ((*url, "--engine-id", "../x"), "--engine-id"),
        ((*url, "--engine-id", "n", "--instance-id", "n"), "not the node"),
        (("--engine-id", "pod-a"), "--coordinator-url"),
    ]:
        with pytest.raises(ValueError, match=says):
            config_from_args(node_args(*argv), {})
