"""What a router or a cache node pays to import the light packages: no numba, no llvmlite.

The compiled kernels of ``kvatlas.keys`` (multimodal values) and ``kvatlas.events`` (JSON token
lists) load on their first use; a process that only talks to the coordinator never compiles or
loads them. Each case runs in a fresh interpreter, since this one has long loaded numba.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("numba", "llvmlite")


def _loaded_after(code: str, among: tuple[str, ...] = HEAVY) -> list[str]:
    """Which modules of ``among`` a fresh interpreter has loaded after running ``code``."""
    probe = f"import sys\n{code}\nprint(' '.join(m for m in {among!r} if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.split()


@pytest.mark.parametrize(
    "imports",
    ["import kvatlas.client", "import kvatlas.keys, kvatlas.events", "import kvatlas.errors"],
)
def test_light_packages_import_without_numba(imports: str) -> None:
    assert _loaded_after(imports) == []


def test_kernels_load_on_first_use() -> None:
    """The laziness is real: the first call that needs a kernel brings numba in (and works)."""
    values = "from kvatlas.keys import mm_hash_values\nassert len(mm_hash_values('img', 9)) == 9"
    assert _loaded_after(values) == list(HEAVY)
    decode = (
        "from kvatlas.events import decode_json\nassert decode_json(b'{\"batches\": []}') == []"
    )
    assert _loaded_after(decode) == list(HEAVY)


def test_the_engine_client_loads_no_server_stack() -> None:
    """``kvatlas.client`` (with its EngineClient) loads neither torch, ml_dtypes nor the web
    framework: an engine process pays for httpx, msgspec and numpy only."""
    assert (
        _loaded_after("import kvatlas.client", ("torch", "ml_dtypes", "fastapi", "starlette")) == []
    )


def test_the_services_load_ml_dtypes_only_for_bfloat16() -> None:
    """A coordinator or a float16/float32 node never needs ``ml_dtypes`` (most of a second of
    CPU at every process start); a bfloat16 node loads it as it starts, not inside its first
    request."""
    probe = (
        "import sys\nimport kvatlas.cli, kvatlas.coordinator.server, kvatlas.node.server\n"
        "from kvatlas.node.cache_node import CacheNode\n"
        "from kvatlas.node.config import NodeConfig\n"
        "def node(dtype):\n"
        "    return CacheNode(NodeConfig(model_name='m', num_layers=1, num_kv_heads=1,\n"
        "                     head_dim=8, chunk_size=16, dtype=dtype, l2='none'))\n"
        "node('float16').close(), node('float32').close()\n"
        "print('ml_dtypes' in sys.modules)\n"
        "node('bfloat16').close()\n"
        "print('ml_dtypes' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["False", "True"]


def test_starting_a_service_imports_no_other_commands_modules() -> None:
    """``kvatlas coordinator`` parses its flags and config without importing the node's, the
    router's, the simulated engine's or the benchmarks' modules (≈0.9 s of CPU at every
    service start on 2 busy cores)."""
    start = (
        "from kvatlas.cli import main\n"
        "try:\n"
        "    main(['coordinator', '--port', '0'])  # flags and config parsed, port refused\n"
        "except SystemExit:\n"
        "    pass"
    )
    others = (
        "kvatlas.node.config", "kvatlas.router.config", "kvatlas.engine_sim.config",
        "kvatlas.bench.service", "kvatlas.soak.run", "kvatlas.client.cache_cli",
    )  # fmt: skip
    assert _loaded_after(start, others) == []


def test_a_router_starts_without_numba() -> None:
    """``kvatlas router`` reads the coordinator's flags (for ``--scores-from replica``) but
    scores through a coordinator's HTTP API: parsing its flags and config brings in neither
    numba nor the directory (the KV-event publisher, which reads the directory, is imported on
    first use: ≈0.3 s of CPU less at every router start)."""
    start = (
        "from kvatlas.cli import main\n"
        "try:\n"
        "    main(['router', '--engine', 'a=http://127.0.0.1:1'])  # config refused\n"
        "except SystemExit:\n"
        "    pass"
    )
    assert _loaded_after(start, (*HEAVY, "kvatlas.directory")) == []


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["no-such-command"]])
def test_a_command_line_naming_no_command_imports_none(argv: list[str]) -> None:
    """``kvatlas --version``, ``kvatlas --help`` and a mistyped command need no command's
    flags: none of their modules is imported (every one of them took ≈1.5 s of CPU)."""
    run = (
        "import contextlib, io\nfrom kvatlas.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        f"    main({argv!r})"
    )
    commands = (
        "kvatlas.coordinator.config", "kvatlas.node.config", "kvatlas.router.config",
        "kvatlas.engine_sim.config", "kvatlas.bench.service", "kvatlas.soak.run",
        "kvatlas.client.cache_cli",
    )  # fmt: skip
    assert _loaded_after(run, (*HEAVY, *commands)) == []


def test_the_connectors_settings_import_without_vllm() -> None:
    """``kvatlas.connector``'s settings are read and checked without vLLM or torch (≈10 s of
    CPU to import: every pytest worker paid it collecting the connector's settings tests).
    The connector itself imports them when vLLM's loader asks for it by name
    (tests/connector/harness.py loads it through vLLM's ``KVConnectorFactory``)."""
    settings = (
        "from kvatlas.connector import ConnectorSettings\n"
        "ConnectorSettings.from_extra_config({'node_url': 'http://127.0.0.1:1'}, environ={})"
    )
    assert _loaded_after(settings, ("vllm", "torch")) == []
