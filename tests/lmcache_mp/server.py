"""A real LMCache 0.5.6 MP server (``lmcache server``) on loopback, for the interop tests.

``make test`` installs LMCache into ``.venv-lmcache`` (requirements/lmcache-cpu.txt); these
helpers start its server on free ports with a file-system L2 in a temporary directory, and an
engine (:mod:`tests.lmcache_mp.engine_driver`, run with that environment's Python) that
registers CPU KV tensors and stores sequences, so the server's prefetch route has a layout and
its L2 holds real chunks. Never a silent skip: under ``CI`` a missing environment fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.bench.lmcache_reference import REFERENCE_VERSION, installed_version, lmcache_env
from kvatlas.errors import InvalidInput
from tests.torch_support import ci_enabled

ROOT = Path(__file__).resolve().parents[2]
LMCACHE_VENV = Path(os.environ.get("KVATLAS_LMCACHE_VENV", ROOT / ".venv-lmcache"))
CHUNK_SIZE = 16
ENGINE_DRIVER = Path(__file__).with_name("engine_driver.py")
_STARTUP_S = 120.0  # importing LMCache (torch, transformers, grpc) on 2 busy cores


def require_lmcache() -> Path:
    """The LMCache environment's ``bin`` directory, or fail (under CI) / skip (locally)."""
    bin_dir = LMCACHE_VENV / "bin"
    lmcache = bin_dir / "lmcache"
    reason = None
    if not lmcache.exists():
        reason = f"{lmcache} is missing; `make lmcache` (part of `make test`) installs it"
    else:
        try:
            version = installed_version(bin_dir / "python")
        except InvalidInput as exc:
            reason = str(exc)
        else:
            if version != REFERENCE_VERSION:
                reason = f"{LMCACHE_VENV} holds LMCache {version}, not {REFERENCE_VERSION}"
    if reason is not None:
        if ci_enabled():
            pytest.fail(reason)
        pytest.skip(reason)
    return bin_dir


@dataclass(frozen=True)
class StoredSequence:
    """A sequence the engine stored: its token ids (every chunk complete)."""

    sequence: int
    token_ids: list[int]


@dataclass(frozen=True)
class LMCacheServer:
    """A running ``lmcache server``: its HTTP base URL, L2 directory, the model the engine
    registered and the sequences it stored."""

    url: str
    l2_dir: Path
    model_name: str
    stored: tuple[StoredSequence, ...]

    def l2_keys(self) -> list[dict[str, Any]]:
        """The keys its fs L2 holds, as ``EncodedObjectKey`` wire dicts (read from the file
        names LMCache writes: ``model@0x<kv_rank>@<group>@<hash>[@salt].data``)."""
        keys = []
        for path in sorted(self.l2_dir.glob("*.data")):
            model, rank, group, chunk_hash, *salt = path.stem.split("@")
            keys.append({
                "chunk_hash_hex": chunk_hash, "model_name": model, "kv_rank": int(rank, 16),
                "object_group_id": int(group, 16), "cache_salt": salt[0] if salt else "",
            })  # fmt: skip
        return keys


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + _STARTUP_S
    with httpx.Client(timeout=2) as client:  # one for every poll (tests/conftest.py, HTTP)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"lmcache server exited ({proc.returncode}): {log.read_text()[-3000:]}"
                )
            try:
                client.get(f"{url}/cache/prefetches/probe")
                return
            except httpx.TransportError:
                time.sleep(0.2)
    raise RuntimeError(
        f"lmcache server not answering after {_STARTUP_S}s: {log.read_text()[-3000:]}"
    )


@contextmanager
def lmcache_server(tmp: Path, sequences: tuple[int, ...] = (1, 2)) -> Iterator[LMCacheServer]:
    """Start ``lmcache server`` and an engine that stores ``sequences`` (3 chunks each); stop
    both on exit."""
    bin_dir = require_lmcache()
    env = lmcache_env()
    http_port, rpc_port = free_port(), free_port()
    l2_dir = tmp / "lmcache-l2"
    log = tmp / "lmcache-server.log"
    url = f"http://127.0.0.1:{http_port}"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [str(bin_dir / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(rpc_port),
             "--http-host", "127.0.0.1", "--http-port", str(http_port),
             "--chunk-size", str(CHUNK_SIZE), "--l1-size-gb", "0.05", "--no-l1-use-lazy",
             "--eviction-policy", "LRU", "--disable-observability",
             "--l2-adapter", json.dumps({"type": "fs", "base_path": str(l2_dir)})],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp,
        )  # fmt: skip
    engine: subprocess.Popen[str] | None = None
    try:
        _wait_http(url, server, log)
        engine = subprocess.Popen(
            [str(bin_dir / "python"), str(ENGINE_DRIVER), "--rpc-url", f"tcp://127.0.0.1:{rpc_port}",
             "--http-url", url, "--num-tokens", str(3 * CHUNK_SIZE - 1),
             "--sequences", *map(str, sequences)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=(tmp / "engine.log").open("w"),
            env=env, cwd=tmp, text=True,
        )  # fmt: skip
        assert engine.stdout is not None
        line = engine.stdout.readline()  # the engine prints one line once it has stored
        if not line:
            engine.wait(timeout=30)
            raise RuntimeError(
                f"the LMCache engine failed: {(tmp / 'engine.log').read_text()[-3000:]}"
            )
        reply = json.loads(line)
        assert reply["chunk_size"] == CHUNK_SIZE, reply
        yield LMCacheServer(
            url, l2_dir, reply["model_name"],
            tuple(StoredSequence(s["sequence"], s["token_ids"]) for s in reply["stored"]),
        )  # fmt: skip
    finally:
        for proc in (engine, server):
            if proc is None:
                continue
            if proc is engine and proc.stdin is not None:
                proc.stdin.close()  # the engine unregisters and exits
                try:
                    proc.wait(timeout=15)
                    continue
                except subprocess.TimeoutExpired:
                    pass
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if sys.exc_info()[0] is not None and log.exists():
            print(log.read_text()[-3000:], file=sys.stderr)
