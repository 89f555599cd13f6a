"""Configuration (coordinator.md §1): every flag, each also as ``KVATLAS_<NAME>``, CLI beats
env beats default; invalid values are ValueErrors; ``kvatlas coordinator --help`` lists all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvatlas.coordinator.config import CoordinatorConfig, parse_config

# flag -> (CLI value, parsed value, a second value for the CLI-beats-env check)
FLAGS: dict[str, tuple[str, Any, str]] = {
    "host": ("0.0.0.0", "0.0.0.0", "10.1.2.3"),
    "port": ("9400", 9400, "9401"),
    "chunk-size": ("128", 128, "64"),
    "hash-scheme": ("blake3-x1", "blake3-x1", "blake3"),
    "blend-probe-stride": ("4", 4, "2"),
    "redis-url": ("redis://127.0.0.1:6390/1", "redis://127.0.0.1:6390/1", "redis://h:1/0"),
    "event-stream": ("fleet:events", "fleet:events", "other:events"),
    "snapshot-path": ("/tmp/kv.snap", Path("/tmp/kv.snap"), "/tmp/other.snap"),
    "snapshot-interval": ("2.5", 2.5, "7"),
    "instance-timeout": ("0.75", 0.75, "3"),
    "auth-token-file": ("/etc/kvatlas/tokens.json", Path("/etc/kvatlas/tokens.json"), "/x.json"),
    "max-query-tokens": ("1000", 1000, "2000"),
    "max-batch-entries": ("50", 50, "60"),
    "max-body-bytes": ("1048576", 1048576, "2048"),
}
CONTRACT_FLAGS = [*FLAGS, "enable-blend-lookup", "event-transport"]


def _attr(flag: str) -> str:
    return flag.replace("-", "_")


def _env(flag: str) -> str:
    return "KVATLAS_" + flag.replace("-", "_").upper()


def test_defaults() -> None:
    cfg = parse_config([], environ={})
    assert cfg == CoordinatorConfig()
    assert (cfg.host, cfg.port, cfg.chunk_size, cfg.hash_scheme) == (
        "127.0.0.1",
        9300,
        256,
        "blake3",
    )
    assert cfg.enable_blend_lookup is True  # blend is what kvatlas is for (issue 15)
    assert cfg.blend_probe_stride == 1
    assert cfg.event_transport == "http"
    assert cfg.event_stream == "kvatlas:events"
    assert cfg.redis_url is None and cfg.snapshot_path is None and cfg.auth_token_file is None
    assert cfg.snapshot_interval == 60.0
    assert cfg.instance_timeout == 30.0


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_flag_cli_env_and_precedence(flag: str) -> None:
    cli, parsed, other = FLAGS[flag]
    name = _attr(flag)
    assert getattr(parse_config([f"--{flag}", cli], environ={}), name) == parsed
    assert getattr(parse_config([], environ={_env(flag): cli}), name) == parsed
    # CLI beats env
    assert getattr(parse_config([f"--{flag}", cli], environ={_env(flag): other}), name) == parsed
    assert getattr(parse_config([f"--{flag}={cli}"], environ={}), name) == parsed


def test_enable_blend_lookup() -> None:
    assert parse_config(["--enable-blend-lookup"], environ={}).enable_blend_lookup is True
    for text in ("1", "true", "yes", "on", "TRUE"):
        cfg = parse_config([], environ={"KVATLAS_ENABLE_BLEND_LOOKUP": text})
        assert cfg.enable_blend_lookup is True, text
    for text in ("0", "false", "no", "off"):
        cfg = parse_config([], environ={"KVATLAS_ENABLE_BLEND_LOOKUP": text})
        assert cfg.enable_blend_lookup is False, text
    env = {"KVATLAS_ENABLE_BLEND_LOOKUP": "1"}
    assert parse_config(["--no-enable-blend-lookup"], environ=env).enable_blend_lookup is False
    env = {"KVATLAS_ENABLE_BLEND_LOOKUP": "0"}
    assert parse_config(["--enable-blend-lookup"], environ=env).enable_blend_lookup is True


def test_event_transport() -> None:
    url = "redis://127.0.0.1:6379/0"
    cfg = parse_config(["--event-transport", "redis", "--redis-url", url], environ={})
    assert (cfg.event_transport, cfg.redis_url) == ("redis", url)
    cfg = parse_config([], environ={"KVATLAS_EVENT_TRANSPORT": "redis", "KVATLAS_REDIS_URL": url})
    assert cfg.event_transport == "redis"
    env = {"KVATLAS_EVENT_TRANSPORT": "redis", "KVATLAS_REDIS_URL": url}
    assert parse_config(["--event-transport", "http"], environ=env).event_transport == "http"


def test_environ_argument_isolates_from_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVATLAS_PORT", "9555")
    assert parse_config([], environ={}).port == 9300
    assert parse_config([]).port == 9555  # None → os.environ


@pytest.mark.parametrize(
    "argv",
    [
        ["--port", "0"],
        ["--port", "-1"],
        ["--port", "http"],
        ["--port", "70000"],
        ["--chunk-size", "0"],
        ["--chunk-size", "1.5"],
        ["--hash-scheme", "md5"],
        ["--blend-probe-stride", "0"],
        ["--event-transport", "kafka"],
        ["--event-transport", "redis"],  # needs --redis-url
        ["--snapshot-interval", "0"],
        ["--snapshot-interval", "soon"],
        ["--snapshot-interval", "nan"],
        ["--snapshot-interval", "inf"],
        ["--instance-timeout", "-1"],
        ["--instance-timeout", "nan"],
        ["--max-query-tokens", "0"],
        ["--max-batch-entries", "-5"],
        ["--max-body-bytes", "1e9"],
    ],
)
def test_invalid_values(argv: list[str]) -> None:
    with pytest.raises(ValueError):
        parse_config(argv, environ={})
    # the same value from the environment is just as invalid
    env = {_env(argv[0][2:]): argv[1]}
    if argv == ["--event-transport", "redis"]:
        env = {"KVATLAS_EVENT_TRANSPORT": "redis"}
    with pytest.raises(ValueError):
        parse_config([], environ=env)


def test_invalid_boolean_env() -> None:
    with pytest.raises(ValueError):
        parse_config([], environ={"KVATLAS_ENABLE_BLEND_LOOKUP": "maybe"})


def test_error_names_the_flag() -> None:
    with pytest.raises(ValueError, match="chunk-size"):
        parse_config(["--chunk-size", "big"], environ={})


def test_help_lists_every_flag() -> None:
    exe = Path(sys.executable).with_name("kvatlas")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "kvatlas.cli"]
    out = subprocess.run(
        [*cmd, "coordinator", "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    for flag in CONTRACT_FLAGS:
        assert f"--{flag}" in out, flag
        assert _env(flag) in out, _env(flag)


def test_cli_rejects_invalid_value_with_usage_error() -> None:
    exe = Path(sys.executable).with_name("kvatlas")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "kvatlas.cli"]
    proc = subprocess.run(
        [*cmd, "coordinator", "--chunk-size", "0"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "chunk" in proc.stderr


@pytest.mark.parametrize("variable", ["KVATLAS_LOG_LEVEL", "KVATLAS_EVICTION_POLICY"])
def test_a_variable_outside_the_choices_is_a_usage_error(variable: str) -> None:
    """``KVATLAS_EVICTION_POLICY=bogus`` started and crashed (a traceback, exit 1) where
    ``--eviction-policy bogus`` is a usage error: one line naming flag and value, exit 2."""
    import os

    proc = subprocess.run(
        [sys.executable, "-m", "kvatlas.cli", "coordinator", "--port", "1"],
        capture_output=True, text=True, timeout=60, env={**os.environ, variable: "bogus"},
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    flag = "--" + variable.removeprefix("KVATLAS_").lower().replace("_", "-")
    assert f"error: {flag}: invalid choice: 'bogus'" in proc.stderr, proc.stderr
