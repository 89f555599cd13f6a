"""One name per setting, read from the tables of docs/configuration.md: each setting is a field
and a flag on every service the table names, each reply the table names carries it under that
name with the value the service was started with (a real coordinator and a real node over
loopback HTTP), each old spelling still sets the new field and warns, naming it; a quantity's
name carries its unit, and "not set" is ``None``."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvatlas.asgi_thread import ThreadedServer, free_port
from kvatlas.client.route_client import ROUTE_HELP, ROUTE_RENAMED_FLAGS, RouteCommand
from kvatlas.config_flags import FlagParser, add_dataclass_arguments, dataclass_from_args
from kvatlas.coordinator import config as coordinator_config
from kvatlas.engine_sim import config as engine_sim_config
from kvatlas.node import config as node_config_module
from kvatlas.node.cache_node import CacheNode
from kvatlas.node.http_api import create_node_app
from kvatlas.router import config as router_config
from tests.coordinator.helpers import b64, running
from tests.helpers import node_config, toy_node_flags

PAGE = Path(__file__).parents[1] / "docs" / "configuration.md"


@dataclasses.dataclass(frozen=True)
class Service:
    config: type
    add_arguments: Callable[[argparse.ArgumentParser], None]
    parse: Callable[..., Any]
    renamed: Mapping[str, str]


def _route_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, RouteCommand, ROUTE_HELP, renamed=ROUTE_RENAMED_FLAGS)


SERVICES = {
    "coordinator": Service(
        coordinator_config.CoordinatorConfig, coordinator_config.add_arguments,
        coordinator_config.config_from_args, coordinator_config.RENAMED_FLAGS,
    ),
    "node": Service(
        node_config_module.NodeConfig, node_config_module.add_arguments,
        node_config_module.config_from_args, node_config_module.RENAMED_FLAGS,
    ),
    "router": Service(
        router_config.RouterConfig, router_config.add_arguments, router_config.config_from_args,
        {},
    ),
    "engine-sim": Service(
        engine_sim_config.EngineSimConfig, engine_sim_config.add_arguments,
        lambda args, environ: dataclass_from_args(
            engine_sim_config.EngineSimConfig, args, environ, engine_sim_config.RENAMED_FLAGS
        ),
        engine_sim_config.RENAMED_FLAGS,
    ),
    "route": Service(
        RouteCommand, _route_arguments,
        lambda args, environ: dataclass_from_args(RouteCommand, args, environ, ROUTE_RENAMED_FLAGS),
        ROUTE_RENAMED_FLAGS,
    ),
}  # fmt: skip
"""Each service the page names: its config, flags, parse (flags, environment) and renames."""

CONTRACT_UNSUFFIXED = {
    "instance_timeout", "snapshot_interval", "coordinator_blend_timeout", "l2_redis_ttl",
}  # fmt: skip
"""Durations whose names the contract fixes (the page's last table)."""
DIMENSIONLESS = {
    "fragment_weight", "recompute_share", "speed", "gpu_mfu", "gpu_hbm_efficiency",
    "model_params", "gpu_peak_flops", "rope_theta",
}  # fmt: skip
"""Floats without a unit (weights, shares, counts, a frequency base, FLOPs)."""
UNIT_SUFFIXES = ("_s", "_bytes", "_per_s", "_per_token")


def _table(heading: str) -> list[list[str]]:
    """The rows of the first table under ``heading`` (cells stripped, header and rule off)."""
    text = PAGE.read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def _names(cell: str) -> list[str]:
    return re.findall(r"`([a-z0-9_]+)`", cell)


SETTINGS = [(_names(row[0])[0], row[1].split(", "), row[2]) for row in _table(
    "Settings, their services and the replies that report them")]  # fmt: skip
RENAMES = [(row[0], _names(row[1])[0], _names(row[2])[0]) for row in _table(
    "Old spellings (they work for one release)")]  # fmt: skip


def _flags(service: Service) -> dict[str, argparse.Action]:
    parser = FlagParser()
    service.add_arguments(parser)
    return {opt: a for a in parser._actions for opt in a.option_strings}


def test_the_page_names_every_service_and_setting_it_lists() -> None:
    assert len(SETTINGS) > 30 and len(RENAMES) >= 16  # the tables were read
    for setting, services, _ in SETTINGS:
        for name in services:
            service = SERVICES[name]
            assert setting in {f.name for f in dataclasses.fields(service.config)}, (name, setting)
            flags = _flags(service)
            flag = "--" + setting.replace("_", "-")
            assert flag in flags and flags[flag].dest == setting, (name, flag)


def test_every_old_spelling_is_on_the_page_and_nothing_else() -> None:
    in_code = {(name, old, new) for name, s in SERVICES.items() for old, new in s.renamed.items()}
    assert set(RENAMES) == in_code


@pytest.mark.parametrize(("name", "old", "new"), RENAMES)
def test_an_old_spelling_sets_the_new_field_and_warns_naming_it(
    name: str, old: str, new: str
) -> None:
    service = SERVICES[name]
    hint = typing.get_type_hints(service.config)[new]
    kind = next(t for t in (typing.get_args(hint) or (hint,)) if t is not type(None))
    boolean = kind is bool
    value = "true" if boolean else "7"
    base = {
        "node": ["--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8"],
        "router": ["--engine", "e=http://127.0.0.1:1", "--policy", "round-robin"],
    }.get(name, [])
    parser = FlagParser()
    service.add_arguments(parser)
    old_flag, new_flag = "--" + old.replace("_", "-"), "--" + new.replace("_", "-")
    argv = [*base, old_flag] if boolean else [*base, old_flag, value]
    with pytest.warns(DeprecationWarning, match=re.escape(new_flag)):
        config = service.parse(parser.parse_args(argv), {})
    expected = True if boolean else kind(value)
    assert getattr(config, new) == expected
    env_old, env_new = "KVATLAS_" + old.upper(), "KVATLAS_" + new.upper()
    with pytest.warns(DeprecationWarning, match=env_new):
        config = service.parse(parser.parse_args(base), {env_old: value})
    assert getattr(config, new) == expected
    with warnings.catch_warnings():  # the new spelling: no warning
        warnings.simplefilter("error")
        config = service.parse(parser.parse_args(base), {env_new: value})
    assert getattr(config, new) == expected
    assert not re.search(re.escape(old_flag) + r"(?![-\w])", parser.format_help())  # hidden


def test_quantities_carry_their_unit_and_not_set_is_none() -> None:
    for name, service in SERVICES.items():
        hints = typing.get_type_hints(service.config)
        for f in dataclasses.fields(service.config):
            base = typing.get_args(hints[f.name])[0] if typing.get_args(hints[f.name]) else None
            kind = hints[f.name] if base is None else base
            if kind is float and f.name not in DIMENSIONLESS | CONTRACT_UNSUFFIXED:
                assert f.name.endswith(UNIT_SUFFIXES), (name, f.name)
            if f.name in ("cache_salt",):  # "" is a namespace (the unsalted one), not "unset"
                continue
            assert f.default != "", f'{name}: {f.name} = "" (not set is None)'


# ------------------------------------------------------------------ the replies


@pytest.fixture(scope="module")
def coordinator() -> Iterator[tuple[Any, httpx.Client]]:
    with running(
        chunk_size=16, hash_scheme="blake3-x1", enable_blend_lookup=False, replica_id="names-r"
    ) as (server, client):
        yield server.config, client


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[Any, httpx.Client]]:
    config = node_config(
        model_name="names-m", chunk_size=16, hash_scheme="blake3-x1", world_size=2, rank=1,
        instance_id="names-node", num_layers=1, num_kv_heads=2, head_dim=8, dtype="bfloat16",
        rotary_dim=4, rope_style="gptj", rope_theta=500000.0,
    )  # fmt: skip
    server = ThreadedServer(create_node_app(CacheNode(config)), port=free_port())
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=30.0) as client:
            yield config, client
    finally:
        server.stop()


def _reply(client: httpx.Client, route: str) -> dict[str, Any]:
    method, path = route.split()
    if method == "POST":  # the blend lookup: a query of one chunk
        body = {"tokens_b64": b64(range(16)), "model_name": "m"}
        reply = client.post(path, json=body)
    else:
        reply = client.get(path)
    assert reply.status_code == 200, (route, reply.text)
    found: dict[str, Any] = reply.json()
    return found


@pytest.mark.parametrize(("setting", "reported"), [(s, r) for s, _, r in SETTINGS if r != "—"])
def test_a_reply_reports_a_setting_under_its_name(
    setting: str,
    reported: str,
    coordinator: tuple[Any, httpx.Client],
    node: tuple[Any, httpx.Client],
) -> None:
    services = {"coordinator": coordinator, "node": node}
    for service, route in re.findall(r"(\w+) `([A-Z]+ [^`]+)`", reported):
        config, client = services[service]
        body = _reply(client, route)
        assert setting in body, (service, route, setting, sorted(body))
        value = getattr(config, setting)
        if value is not None and body[setting] is not None:
            assert body[setting] == value, (service, route, setting)


def test_a_node_reads_the_health_of_a_coordinator_of_the_release_before() -> None:
    """An older coordinator's ``/healthz`` names ``key_scheme`` and ``blend_lookup``: a node
    of this release reads them for one release (else it would take the coordinator for
    LMCache's, which states no scheme, and check nothing)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from kvatlas.api import HealthReply, decode
    from kvatlas.client import CoordinatorClient

    before = {"status": "healthy", "key_scheme": "blake3-x1", "chunk_size": 16,
              "blend_lookup": False, "event_transport": "http"}  # fmt: skip
    app = Starlette(routes=[Route("/healthz", lambda _: JSONResponse(before))])
    server = ThreadedServer(app, port=free_port())
    server.start()
    try:
        with CoordinatorClient(server.url) as client:
            health = client.health()
    finally:
        server.stop()
    assert (health.hash_scheme, health.enable_blend_lookup) == ("blake3-x1", False)
    assert health.states_hash_scheme
    plain = decode(JSONResponse(before).body, HealthReply)  # the reply type itself: new names
    assert (plain.hash_scheme, plain.enable_blend_lookup) == (None, None)


def test_the_nodes_old_max_body_bytes_0_is_not_set_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="--max-body-bytes"):
        config = node_config(max_body_bytes=0)
    assert config.max_body_bytes is None and config.max_store_bytes > config.max_call_bytes
    assert node_config(max_body_bytes=4096).max_store_bytes == 4096
    with pytest.raises(ValueError, match="--max-body-bytes"):
        node_config(max_body_bytes=-1)


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_a_float_setting_refuses_nan_and_infinity(name: str) -> None:
    """``--step-overhead-s nan`` started an engine-sim whose every request hung; the router's
    ``--l1-bandwidth-bytes-per-s nan`` went into its cost model: checks written ``value < 0``
    let NaN (and infinity) through. Every float setting of every service, as a flag or a
    variable, refuses them, naming the flag."""
    service = SERVICES[name]
    hints = typing.get_type_hints(service.config)
    floats = [
        f.name
        for f in dataclasses.fields(service.config)
        if float in (hints[f.name], *typing.get_args(hints[f.name]))
    ]
    assert floats or name == "route", name
    base = toy_node_flags() if name == "node" else []  # (the node reads its layout first)
    for field in floats:
        flag = "--" + field.replace("_", "-")
        for value in ("nan", "inf", "-inf"):
            parser = FlagParser()
            service.add_arguments(parser)
            with pytest.raises(ValueError, match=f"{flag}: not a finite number"):
                service.parse(parser.parse_args([*base, f"{flag}={value}"]), {})
            with pytest.raises(ValueError, match=f"{flag}: not a finite number"):
                service.parse(parser.parse_args(base), {"KVATLAS_" + field.upper(): value})


def _base_flags(name: str) -> list[str]:
    """What a service needs to start at all (the node its layout, the router engines)."""
    if name == "router":
        return ["--engine", "e1=http://127.0.0.1:9", "--policy", "round-robin"]
    return toy_node_flags() if name == "node" else []


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_a_variable_outside_a_settings_choices_is_refused_as_the_flag_is(name: str) -> None:
    """``KVATLAS_LOG_LEVEL=bogus`` (every service), ``KVATLAS_EVICTION_POLICY=bogus``
    (coordinator) passed the configs' checks (argparse's choices apply to the flag only) and
    crashed later, a traceback and exit 1 where the flag is a usage error. Refused, naming the
    flag or the value (``--log-level: invalid choice: 'bogus'``; a field with a check of its
    own says it its way)."""
    service = SERVICES[name]
    base = _base_flags(name)
    parser = FlagParser()
    service.add_arguments(parser)
    fields = {f.name for f in dataclasses.fields(service.config)}
    given = {flag[2:].replace("-", "_") for flag in base if flag.startswith("--")}
    chosen = [a.dest for a in parser._actions if a.choices and a.dest in fields - given]
    assert chosen or name == "route", name
    for field in chosen:
        flag = "--" + field.replace("_", "-")
        with pytest.raises(ValueError, match=f"'bogus'|{flag}"):  # (a usage error: exit 2)
            service.parse(parser.parse_args(base), {"KVATLAS_" + field.upper(): "bogus"})


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_an_empty_value_is_not_set(name: str) -> None:
    """docs/configuration.md: an empty value means not set. A setting with a default took an
    empty one literally: ``KVATLAS_EVENT_STREAM=`` (or ``--event-stream ''``) made the Redis key
    "" the stream (one service with it and one without split a fleet across two streams),
    ``KVATLAS_HOST=`` the host "". Every setting but a bool (where empty is false) has its
    default."""
    service = SERVICES[name]
    base = _base_flags(name)
    hints = typing.get_type_hints(service.config)
    parser = FlagParser()
    service.add_arguments(parser)
    default = service.parse(parser.parse_args(base), {})
    chosen = {a.dest for a in parser._actions if a.choices}  # argparse refuses '' for these
    for f in dataclasses.fields(service.config):
        if bool in (hints[f.name], *typing.get_args(hints[f.name])):
            continue
        flag = "--" + f.name.replace("_", "-")
        from_env = service.parse(parser.parse_args(base), {"KVATLAS_" + f.name.upper(): ""})
        assert getattr(from_env, f.name) == getattr(default, f.name), f.name
        if flag not in base and f.name not in chosen:
            from_flag = service.parse(parser.parse_args([*base, f"{flag}="]), {})
            assert getattr(from_flag, f.name) == getattr(default, f.name), f.name
