"""The status page as an operator sees it: ``kvatlas demo --serve`` (a real coordinator and two
node processes, real traffic) rendered by headless Chromium at 1280×800, with an instance
whose name is markup; and ``--serve`` stopping cleanly on Ctrl-C.

Set ``KVATLAS_STATUS_SCREENSHOT=path.png`` to keep the screenshot (docs/img/status.png).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer
from tests.browser_support import Browser, require_chromium
from tests.conftest import HTTP, wait_for
from tests.coordinator.helpers import CS, Emitter, post_batches, running
from tests.helpers import write_tokens

EVIL_ID = "<img src=x onerror=alert(1)>"
EVIL_BACKEND = "<script>alert(1)</script>"
URL_LINE = re.compile(r"status page: (http://[\d.:]+)/")


@contextmanager
def serving_demo(*flags: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``kvatlas demo --serve`` in its own process; yields it and the coordinator's URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvatlas.cli", "demo", "--serve", "--seed", "1", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"},
        # Ctrl-C as in a terminal, whatever this process inherited (a job started with `&`
        # by a non-interactive shell ignores SIGINT, and so would the demo)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None
    lines = []
    try:
        for line in proc.stdout:  # ends when the demo exits without serving
            lines.append(line)
            found = URL_LINE.search(line)
            if found:
                # keep reading what it prints while serving: a full pipe would block it
                threading.Thread(target=lines.extend, args=(proc.stdout,), daemon=True).start()
                yield proc, found.group(1)
                break
        else:
            pytest.fail("demo --serve exited without a status page URL:\n" + "".join(lines))
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)


def interrupt(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGINT)
    return proc.wait(timeout=60)


def test_demo_serve_keeps_the_embedded_fleet_up_until_ctrl_c() -> None:
    with serving_demo("--documents", "4", "--queries", "3") as (proc, url):
        page = httpx.get(f"{url}/", timeout=30)
        assert page.status_code == 200
        assert "kvatlas coordinator" in page.text
        assert "node-0" in page.text and "node-1" in page.text
        # the pulse reports what the nodes did: query tokens arrive in the view
        assert wait_for(
            lambda: HTTP.get(f"{url}/status.json").json()["value"]["query_tokens"] > 0, 30
        )
        assert interrupt(proc) == 0


def _heartbeat(url: str, stop: threading.Event) -> None:
    while not stop.wait(2.0):
        httpx.put(url, timeout=10).raise_for_status()


def test_status_page_in_headless_chromium(tmp_path: Path) -> None:
    chromium = require_chromium()
    with serving_demo("--processes", "--documents", "6", "--queries", "6") as (proc, url):
        # bad input: an instance id and a backend that are markup (the id rule allows both)
        reply = httpx.post(
            f"{url}/instances",
            json={"instance_id": EVIL_ID, "metadata": {"backend": EVIL_BACKEND}},
        )
        assert reply.status_code == 200, reply.text
        # it stays alive as a node would (unheard for --instance-timeout, 30 s, it would be
        # fenced and, having never emitted, leave the table before the page is read)
        stop = threading.Event()
        beat = f"{url}/instances/{quote(EVIL_ID, safe='')}/heartbeat"
        heartbeat = threading.Thread(target=_heartbeat, args=(beat, stop), daemon=True)
        heartbeat.start()

        # the nodes report with every heartbeat (5 s): wait until both did
        def reported() -> bool:
            fleet = HTTP.get(f"{url}/status.json").json()["fleet"]
            return sum(1 for row in fleet if row["tiers"] is not None) >= 2

        assert wait_for(reported, 60, interval=0.5)
        browser = Browser(chromium, tmp_path / "profile")
        try:
            browser.navigate(f"{url}/")
            # the script replaces the server-rendered body every few seconds
            browser.wait_for(
                lambda: browser.evaluate(
                    "document.getElementById('updated').textContent"
                ).startswith("updated"),
                30,
            )
            shot = browser.screenshot(tmp_path / "status.png")
            assert shot.stat().st_size > 10_000
            keep = os.environ.get("KVATLAS_STATUS_SCREENSHOT")
            if keep:
                shutil.copy(shot, keep)
            ids = browser.evaluate(
                "[...document.querySelectorAll('#fleet td.id')].map(td => td.textContent)"
            )
            assert {"node-a", "node-b", EVIL_ID} <= set(ids)
            backends = browser.evaluate(
                "[...document.querySelectorAll('#fleet tbody tr')].map(tr => tr.cells[2].textContent)"
            )
            assert EVIL_BACKEND in backends
            # rendered as text: no element came out of the markup, nothing ran
            assert (
                browser.evaluate("document.querySelectorAll('#status img, #status script').length")
                == 0
            )
            assert browser.evaluate("document.getElementById('readiness').textContent") == "serving"
            for ratio in ("prefix", "fragment", "regret"):
                text = browser.evaluate(f"document.getElementById('{ratio}-ratio').textContent")
                assert re.fullmatch(r"\d+\.\d%", text), (ratio, text)
            prefix = float(
                browser.evaluate("document.getElementById('prefix-ratio').textContent")[:-1]
            )
            assert prefix > 0  # the demo's queries reuse cached prefixes
            traffic = browser.evaluate("document.getElementById('traffic').textContent")
            assert "lookups/s" in traffic and "blend p99" in traffic
            bars = browser.evaluate("document.querySelectorAll('#fleet .bar').length")
            assert bars >= 2  # L1 of both nodes against capacity
            assert browser.evaluate("document.querySelectorAll('#value svg').length") == 3
            assert browser.problems == [], browser.problems
            assert browser.console == []
        finally:
            browser.close()
            stop.set()
        heartbeat.join(timeout=15)
        assert interrupt(proc) == 0


def test_status_page_reads_without_javascript(tmp_path: Path) -> None:
    """Chromium with JavaScript off: the server-rendered page shows the fleet and the value."""
    chromium = require_chromium()
    with serving_demo("--documents", "4", "--queries", "3") as (proc, url):
        browser = Browser(chromium, tmp_path / "profile")
        try:
            browser.call("Emulation.setScriptExecutionDisabled", value=True)
            browser.navigate(f"{url}/status")
            root = browser.call("DOM.getDocument")["root"]["nodeId"]
            dom = browser.call("DOM.getOuterHTML", nodeId=root)["outerHTML"]
            browser.screenshot(tmp_path / "no-js.png")
            assert browser.problems == [], browser.problems
        finally:
            browser.close()
        assert 'id="fleet"' in dom and "node-0" in dom and "node-1" in dom
        assert 'id="prefix-ratio"' in dom and "rendered " in dom  # the script never ran
        assert interrupt(proc) == 0


def test_with_auth_the_page_asks_for_a_token_and_keeps_it_in_the_tab(tmp_path: Path) -> None:
    chromium = require_chromium()
    admin = "admin-" + "a" * 32
    tokens = write_tokens(tmp_path / "tokens.json", {"token": admin, "roles": ["admin"]})
    config = CoordinatorConfig(port=free_port(), auth_token_file=tokens, log_level="warning")
    with BackgroundServer(config) as server:
        reply = httpx.post(
            f"{server.url}/instances",
            json={"instance_id": "node-secret"},
            headers={"Authorization": f"Bearer {admin}"},
        )
        assert reply.status_code == 200
        browser = Browser(chromium, tmp_path / "profile")
        try:
            browser.navigate(f"{server.url}/")
            assert browser.evaluate("document.querySelectorAll('#login input').length") == 1
            assert "node-secret" not in browser.evaluate("document.body.textContent")
            browser.evaluate(
                f"document.querySelector('#login input').value = '{admin}';"
                "document.getElementById('login').requestSubmit()"
            )
            browser.wait_for(lambda: browser.evaluate("!!document.getElementById('fleet')"), 30)
            assert "node-secret" in browser.evaluate("document.getElementById('fleet').textContent")
            assert browser.evaluate("sessionStorage.getItem('kvatlas.token')") == admin
            assert browser.evaluate("document.getElementById('logout').hidden") is False
            assert browser.problems == [], browser.problems
        finally:
            browser.close()


def test_a_token_no_header_can_carry_is_refused_on_the_page_not_taken_for_an_outage(
    tmp_path: Path,
) -> None:
    """A token pasted with a typographic quote cannot go in an Authorization header (fetch
    throws before sending): the page says so and asks again, and one left in the tab is
    dropped at the next load. The old page said "coordinator unreachable", kept the token and
    retried it every 5 s; reloaded, it showed neither a login box nor "forget token" until
    the tab was closed."""
    chromium = require_chromium()
    admin = "admin-" + "a" * 32
    tokens = write_tokens(tmp_path / "tokens.json", {"token": admin, "roles": ["admin"]})
    config = CoordinatorConfig(port=free_port(), auth_token_file=tokens, log_level="warning")
    message = "(document.querySelector('#login p') || {}).textContent || ''"
    note = "document.getElementById('note').textContent"
    with BackgroundServer(config) as server:
        browser = Browser(chromium, tmp_path / "profile")
        try:
            browser.navigate(f"{server.url}/")
            browser.evaluate(
                f"document.querySelector('#login input').value = '\u201c{admin}\u201d';"
                "document.getElementById('login').requestSubmit()"
            )
            browser.wait_for(
                lambda: "cannot carry" in browser.evaluate(message) or browser.evaluate(note), 30
            )
            assert "cannot carry" in browser.evaluate(message)
            assert browser.evaluate(note) == ""
            assert browser.evaluate("sessionStorage.getItem('kvatlas.token')") is None
            # one already in the tab (kept by the old page): dropped, the login offered again
            browser.evaluate(f"sessionStorage.setItem('kvatlas.token', '\u201c{admin}')")
            browser.navigate(f"{server.url}/")
            browser.wait_for(
                lambda: "cannot carry" in browser.evaluate(message) or browser.evaluate(note), 30
            )
            assert browser.evaluate("document.querySelectorAll('#login input').length") == 1
            assert browser.evaluate(note) == ""
            browser.evaluate(
                f"document.querySelector('#login input').value = '{admin}';"
                "document.getElementById('login').requestSubmit()"
            )
            browser.wait_for(lambda: browser.evaluate("!!document.getElementById('fleet')"), 30)
            assert browser.problems == [], browser.problems
        finally:
            browser.close()


EVIL_SALT = "<img src=x onerror=alert(2)>"


def test_quotas_pins_and_commands_on_the_page_in_headless_chromium(tmp_path: Path) -> None:
    """Three salts with L2 bytes (one named with markup, one over its quota, the empty one
    under the default), three pinned keys, a delete its instance cannot take yet, a move whose
    target cannot be reached: the page shows each salt's usage against its limit, the pins and
    their bytes, the commands by kind and state, and a move's phase and progress, rendered as
    text."""
    chromium = require_chromium()
    tokens = [int(t) for t in range(7000, 7000 + 3 * CS)]
    with running() as (server, c):
        assert c.post("/instances", json={"instance_id": "n1", "http_port": 9}).status_code == 200
        node = Emitter("n1")
        batches = [
            node.store_chunks(tokens, salt=salt, tier="l2", backend="fs")
            for salt in ("tenant-a", EVIL_SALT, "")
        ]
        assert post_batches(c, *batches).status_code == 200  # 3 chunks of 100 B per salt
        for path, body in (
            ("/quota/config", {"default_limit_gb": 1}),
            ("/quota/tenant-a", {"limit_gb": 200 / 2**30}),  # 300 B held: over
            (f"/quota/{quote(EVIL_SALT, safe='')}", {"limit_gb": 600 / 2**30}),  # half used
        ):
            assert c.put(path, json=body).status_code == 200, path
        fields = {"model_name": "m", "world_size": 1, "token_ids": tokens}
        pinned = c.post("/cache/pins", json={**fields, "cache_salt": "tenant-a"})
        assert pinned.json()["affected"] == 3
        delete = c.post("/cache/delete", json={**fields, "instance_id": "n1", "force": True})
        assert delete.status_code == 502  # no MP server to reach: kept, pending
        assert c.post("/instances", json={"instance_id": "n2", "http_port": 9}).status_code == 200
        move = c.post(
            "/cache/moves",
            json={**fields, "source_instance_id": "n1", "target_instance_id": "n2"},
        )
        assert move.json()["status"] == "pending"

        def moving() -> list[dict[str, object]]:
            view = c.get("/status.json").json()["cache_control"]
            return [u["move"] for u in view["unfinished"] if u["kind"] == "move"]

        # the delivery loop asks its target (which cannot be reached): loading
        assert wait_for(lambda: moving()[0]["phase"] != "queued")
        view = c.get("/status.json").json()["cache_control"]
        assert moving() == [
            {"phase": "loading", "loaded": 0, "missing": 0, "deleted": 0, "skipped": 0}
        ]
        assert [u["move"] for u in view["unfinished"] if u["kind"] == "delete"] == [None]
        assert (view["pinned_keys"], view["pinned_bytes"], view["salts"]) == (3, 300, 3)
        assert [q["cache_salt"] for q in view["quotas"]] == ["tenant-a", EVIL_SALT, ""]
        browser = Browser(chromium, tmp_path / "profile")
        try:
            browser.navigate(f"{server.url}/")
            browser.wait_for(
                lambda: browser.evaluate(
                    "document.getElementById('updated').textContent"
                ).startswith("updated"),
                30,
            )
            shot = browser.screenshot(tmp_path / "cache-control.png")
            keep = os.environ.get("KVATLAS_CACHE_SCREENSHOT")
            if keep:
                shutil.copy(shot, keep)
            rows = browser.evaluate(
                "[...document.querySelectorAll('#quotas tbody tr')]"
                ".map(tr => [...tr.cells].map(td => td.textContent))"
            )
            assert rows == [
                ["tenant-a", "200 B own", "300 B / 200 B", "150.0%", "3"],
                [EVIL_SALT, "600 B own", "300 B / 600 B", "50.0%", "0"],
                ["_default", "1.0 GiB default", "300 B / 1.0 GiB", "0.0%", "0"],
            ]
            assert browser.evaluate("document.querySelectorAll('#quotas td.over').length") == 1
            assert browser.evaluate("document.querySelectorAll('#quotas .bar').length") == 3
            pins = browser.evaluate("document.getElementById('pins').textContent")
            assert "pinned keys3" in pins and "pinned bytes300 B" in pins
            counts = browser.evaluate(
                "Object.fromEntries([...document.querySelectorAll('#commands tbody tr')]"
                ".map(tr => [tr.cells[0].textContent, [...tr.cells].slice(1).map(td => td.textContent)]))"
            )
            assert counts == {
                "delete": ["1", "0", "0", "0"], "evict": ["0"] * 4, "prefetch": ["0"] * 4,
                "move": ["1", "0", "0", "0"],
            }  # fmt: skip
            unfinished = browser.evaluate("document.getElementById('unfinished').textContent")
            assert "Unfinished commands (2)" in unfinished and "delete" in unfinished
            phases = browser.evaluate(
                "[...document.querySelectorAll('#unfinished tbody tr')]"
                ".map(tr => [tr.cells[1].textContent, tr.cells[5].textContent])"
            )
            assert phases == [
                ["delete", "–"],
                ["move", "loading: 0 loaded, 0 missing, 0 deleted, 0 skipped"],
            ]
            assert "no MP-server client" in unfinished  # why it is still pending
            assert browser.evaluate("document.querySelectorAll('#status img').length") == 0
            assert browser.problems == [], browser.problems
            assert browser.console == []
        finally:
            browser.close()
