"""``kvatlas cache`` end to end (``docs/cache-control.md``, "Command line"): each action through
the CLI's entry point against a real coordinator on loopback HTTP with auth on, delivering to a
real ``kvatlas node`` process (fs L2): pins and their pages, a delete that skips pinned keys
and one that forces, a prefetch waited for with progress until the node's L1 holds the keys,
moves and their status, every quota verb; refusals exit 1 with the coordinator's status and
detail (403 for a token bound to another salt, 400/404 for bad input), a bad command line
exits 2, and what was refused changed nothing."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvatlas.asgi_thread import free_port
from kvatlas.cli import main
from kvatlas.client.cache_actions import _Progress
from kvatlas.client.cache_client import wait_for_status
from kvatlas.client.mp_server_client import MPServerClient
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.server import BackgroundServer
from kvatlas.node.engine_client import NodeEngineClient
from kvatlas.node.toy_model import ToyRopeModel
from kvatlas.processes import spawn_service, stop
from tests.conftest import HTTP, wait_for
from tests.coordinator.security_support import bearer, token
from tests.helpers import C, node_config, toy_node_flags, write_tokens

ADMIN, TENANT_A, NODE = token("admin"), token("cache-a"), token("node")
DOC = [int(t) for t in np.random.default_rng(36).integers(0, 500, 3 * C)]
"""Three chunks the node stores under the empty salt."""


class Fleet:
    def __init__(self, server: BackgroundServer, node_url: str, tmp: Path) -> None:
        self.server, self.url, self.node_url, self.tmp = server, server.url, node_url, tmp
        self.doc = tmp / "doc.json"
        self.doc.write_text(json.dumps(DOC))
        self.admin_file = _secret(tmp / "admin.token", ADMIN)
        self.tenant_file = _secret(tmp / "tenant.token", TENANT_A)

    def tiers(self) -> list[list[str]]:
        """Per chunk of DOC, the tiers node-a holds it in, as the directory shows."""
        r = HTTP.post(
            f"{self.url}/directory/lookup", headers=bearer(ADMIN),
            json={"token_ids": DOC, "model_name": "toy"},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        return [
            sorted(p["tier"] for p in row["placements"] if p["instance_id"] == "node-a")
            for row in r.json()["results"]
        ]


def _secret(path: Path, value: str) -> Path:
    path.write_text(value)
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("cachecli")
    tokens = write_tokens(
        tmp / "tokens.json",
        {"token": ADMIN, "role": "admin"},
        {"token": TENANT_A, "roles": ["cache"], "cache_salts": ["tenant-a"]},
        {"token": NODE, "roles": ["emit", "lookup"], "instance_ids": ["node-a", "node-b"]},
    )  # fmt: skip
    config = CoordinatorConfig(
        port=free_port(), chunk_size=C, auth_token_file=tokens, log_level="warning"
    )
    with BackgroundServer(config, mp_servers=lambda url: MPServerClient(url, timeout=10)) as srv:
        port = free_port()
        node = spawn_service(
            ["-m", "kvatlas.cli", "node", "--port", str(port), "--instance-id", "node-a",
             *toy_node_flags(C), "--l2", "fs", "--l2-path", str(tmp / "l2"),
             "--coordinator-url", srv.url, "--coordinator-token", NODE,
             "--coordinator-event-reporting"],
            f"http://127.0.0.1:{port}",
        )  # fmt: skip
        try:
            # node-b: registered, nothing listens at its MP port (a move's target)
            r = httpx.post(
                f"{srv.url}/instances", headers=bearer(NODE),
                json={"instance_id": "node-b", "ip": "127.0.0.1", "http_port": 9},
            )  # fmt: skip
            assert r.status_code == 200, r.text
            f = Fleet(srv, f"http://127.0.0.1:{port}", tmp)
            layout = node_config().layout
            with NodeEngineClient(f.node_url, layout) as client:
                tokens_ = np.asarray(DOC, dtype=np.uint32)
                assert client.store(tokens_, ToyRopeModel(layout).kv_chunks(tokens_)) == 3
            assert wait_for(lambda: f.tiers() == [["l1", "l2"]] * 3, timeout=60)
            yield f
        finally:
            stop([node])


def cache(
    capsys: pytest.CaptureFixture[str], fleet: Fleet, *argv: str, who: Path | None = None
) -> tuple[int, str, str]:
    """``kvatlas cache ARGV`` against the fleet's coordinator (``who``: a token file, default
    admin's): exit code, stdout, stderr."""
    capsys.readouterr()
    link = ["--coordinator-url", fleet.url, "--coordinator-token-file", str(who or fleet.admin_file)]  # fmt: skip
    path = list(argv[:2]) if argv[0] == "quota" else list(argv[:1])
    code = main(["cache", *path, *link, *argv[len(path) :]])
    out = capsys.readouterr()
    return code, out.out, out.err


def doc(fleet: Fleet, *more: str) -> list[str]:
    return ["--model-name", "toy", "--tokens-file", str(fleet.doc), *more]


def control_state(fleet: Fleet) -> Any:
    control = fleet.server.service.cache_control
    return (
        control.pins.rows(),
        control.quotas.default_limit_gb,
        control.quotas.limits(),
        control.commands.counts(),
    )


def test_pin_list_in_pages_and_unpin(capsys: pytest.CaptureFixture[str], fleet: Fleet) -> None:
    code, out, _ = cache(capsys, fleet, "pin", *doc(fleet, "--cache-salt", "tenant-a"),
                         who=fleet.tenant_file)  # fmt: skip
    assert (code, out) == (0, "pinned: 3 keys of 3 complete chunks\n")
    code, out, _ = cache(capsys, fleet, "pins", "--cache-salt", "tenant-a", "--limit", "2",
                         who=fleet.tenant_file)  # fmt: skip
    lines = out.splitlines()
    assert code == 0 and lines[0] == "pinned keys 1-2 of 3", out
    assert len([x for x in lines if "  tenant-a  toy  " in x]) == 2
    assert lines[-1] == "more: --offset 2 (or --all)"
    code, out, _ = cache(capsys, fleet, "pins", "--cache-salt", "tenant-a", "--limit", "2",
                         "--all", "--json", "-", who=fleet.tenant_file)  # fmt: skip
    listed = json.loads(out)
    assert code == 0 and listed["total"] == 3 and len(listed["pins"]) == 3
    assert {p["pin_count"] for p in listed["pins"]} == {1}
    assert {p["key"]["cache_salt"] for p in listed["pins"]} == {"tenant-a"}
    written = fleet.tmp / "unpinned.json"
    code, out, _ = cache(capsys, fleet, "unpin", *doc(fleet, "--cache-salt", "tenant-a"),
                         "--json", str(written), who=fleet.tenant_file)  # fmt: skip
    assert (code, out) == (0, "unpinned: 3 keys of 3 complete chunks\n")
    assert json.loads(written.read_text()) == {
        "requested": 3, "affected": 3, "status": "unpinned"
    }  # fmt: skip
    code, out, _ = cache(capsys, fleet, "pins", "--cache-salt", "tenant-a")
    assert (code, out.splitlines()[0]) == (0, "pinned keys 0-0 of 0")


def test_delete_skips_pinned_keys_then_prefetch_waits_until_l1_holds_them(
    capsys: pytest.CaptureFixture[str], fleet: Fleet
) -> None:
    assert cache(capsys, fleet, "pin", *doc(fleet))[0] == 0
    code, out, _ = cache(capsys, fleet, "delete", *doc(fleet, "--instance-id", "node-a",
                                                        "--tier", "l1"))  # fmt: skip
    assert code == 0
    assert out.splitlines() == [
        "deleted: 0 keys sent to node-a (l1), 3 pinned skipped, of 3 complete chunks",
        "pinned keys stay: unpin them, or --force",
    ]
    assert fleet.tiers() == [["l1", "l2"]] * 3
    code, out, _ = cache(capsys, fleet, "delete", *doc(fleet, "--instance-id", "node-a",
                                                        "--tier", "l1", "--force"))  # fmt: skip
    assert (code, out) == (
        0, "deleted: 3 keys sent to node-a (l1), 0 pinned skipped, of 3 complete chunks\n"
    )  # fmt: skip
    assert wait_for(lambda: fleet.tiers() == [["l2"]] * 3, timeout=30)
    assert cache(capsys, fleet, "unpin", *doc(fleet))[0] == 0

    code, out, err = cache(capsys, fleet, "prefetch", *doc(fleet, "--instance-id", "node-a",
                           "--wait", "--poll-interval-s", "0.05"))  # fmt: skip
    lines = out.splitlines()
    assert code == 0, (out, err)
    assert lines[0].startswith("submitted: 3 chunks, request_id ")
    assert lines[-1] == "completed: 3 of 3 keys in L1"
    request_id = lines[0].rsplit(" ", 1)[1]
    progress = err.splitlines()
    assert progress[-1].startswith(f"prefetch {request_id}: completed: 3 of 3 keys in L1 (")
    assert all(p.startswith(f"prefetch {request_id}: ") for p in progress)
    assert fleet.tiers() == [["l1", "l2"]] * 3  # in L1 again, as the directory shows
    code, out, _ = cache(capsys, fleet, "prefetch-status", "--instance-id", "node-a",
                         "--request-id", request_id, "--json", "-")  # fmt: skip
    assert code == 0
    assert json.loads(out) == {"status": "completed", "found_keys": 3, "total_keys": 3}


def test_move_and_its_status_exit_by_where_it_stands(
    capsys: pytest.CaptureFixture[str], fleet: Fleet
) -> None:
    code, out, err = cache(capsys, fleet, "move", *doc(fleet), "--source-instance-id", "node-a",
                           "--target-instance-id", "node-b", "--wait", "--wait-timeout-s",
                           "0.3", "--poll-interval-s", "0.05")  # fmt: skip
    first, last = out.splitlines()[0], out.splitlines()[-1]
    assert first.startswith("recorded: 3 chunks, move_id "), out
    move_id = first.rsplit(" ", 1)[1]
    code_s, out_s, _ = cache(capsys, fleet, "move-status", "--move-id", move_id, "--json", "-")
    status = json.loads(out_s)
    assert status["move_id"] == move_id and status["requested"] == 3
    # the exit code says where it stands: done 0, failed 4, still going after the wait 3
    if status["status"] == "pending":
        assert (code, code_s) == (3, 0)
        assert last.startswith("still pending (") and "--wait-timeout-s 0.3; it goes on" in last
        assert err.splitlines()[-1].startswith(f"move {move_id}: pending (")
    else:
        assert (code, code_s) == ((0, 0) if status["status"] == "completed" else (4, 4))
    # bad input: a clear 400 / 404 from the coordinator, exit 1, nothing recorded
    before = control_state(fleet)
    code, out, err = cache(capsys, fleet, "move", *doc(fleet), "--source-instance-id", "node-a",
                           "--target-instance-id", "node-a")  # fmt: skip
    assert (code, out) == (1, "")
    assert err == ("kvatlas cache move: POST /cache/moves: 400 source and target are the same "
                   "instance ('node-a')\n")  # fmt: skip
    code, _, err = cache(capsys, fleet, "move-status", "--move-id", "nope")
    assert code == 1 and "GET /cache/moves/nope: 404 unknown move_id='nope'" in err
    assert control_state(fleet) == before


def test_a_delete_its_instance_cannot_take_yet_is_kept_and_says_so(
    capsys: pytest.CaptureFixture[str], fleet: Fleet
) -> None:
    """node-b's MP port answers nothing: LMCache's 502, exit 1, and the message says the
    coordinator kept the delete and retries it (it does: one more pending delete)."""
    counts = fleet.server.service.cache_control.commands.counts
    pending = counts().get(("delete", "pending"), 0)
    code, out, err = cache(capsys, fleet, "delete", *doc(fleet, "--instance-id", "node-b"))
    assert (code, out) == (1, "")
    assert err.startswith("kvatlas cache delete: POST /cache/delete: 502 delete to 'node-b' ")
    assert "recorded the command: it retries it until the instance takes it" in err
    assert counts().get(("delete", "pending"), 0) == pending + 1


def test_prefetch_wait_waits_on_a_command_the_coordinator_kept(
    capsys: pytest.CaptureFixture[str], fleet: Fleet
) -> None:
    """A prefetch to node-b (its MP port answers nothing) is a 502 whose command the
    coordinator keeps and retries (its request_id in the reply). ``--wait`` exited 1 at once,
    as if refused; it waits on the kept command as a move to a target that is down is waited
    on: still pending at ``--wait-timeout-s``, exit 3 (it goes on)."""
    code, out, err = cache(capsys, fleet, "prefetch", *doc(fleet, "--instance-id", "node-b"),
                           "--wait", "--wait-timeout-s", "0.3", "--poll-interval-s", "0.05")  # fmt: skip
    assert code == 3, err
    assert "502" in err and "kept for retry: request_id " in err and "waiting for it" in err
    assert "pending after --wait-timeout-s 0.3; it goes on" in out
    code, out, err = cache(capsys, fleet, "prefetch", *doc(fleet, "--instance-id", "node-b"))
    assert (code, out) == (1, "") and "kept for retry" in err  # without --wait: as before


def test_every_quota_verb_and_a_token_bound_to_another_salt(
    capsys: pytest.CaptureFixture[str], fleet: Fleet
) -> None:
    tenant = fleet.tenant_file
    code, out, _ = cache(capsys, fleet, "quota", "set", "--cache-salt", "tenant-a",
                         "--limit-gb", "1.5", who=tenant)  # fmt: skip
    assert (code, out) == (0, "'tenant-a': quota 1.5 GB\n")
    code, out, _ = cache(capsys, fleet, "quota", "get", "--cache-salt", "tenant-a", who=tenant)
    assert (code, out) == (0, "'tenant-a': limit 1.5 GB (own), usage 0 B (0.0%)\n")
    before = control_state(fleet)
    for argv in (
        ("quota", "set", "--cache-salt", "tenant-b", "--limit-gb", "9"),
        ("quota", "delete", "--cache-salt", "tenant-b"),
        ("quota", "set", "--cache-salt", "", "--limit-gb", "9"),  # the empty salt: another
        ("pin", *doc(fleet, "--cache-salt", "tenant-b")),
    ):
        code, out, err = cache(capsys, fleet, *argv, who=tenant)
        assert (code, out) == (1, ""), argv
        assert "403 this token may not use cache_salt" in err, err
    code, _, err = cache(capsys, fleet, "quota", "list", who=tenant)  # every tenant's
    assert code == 1 and err.startswith("kvatlas cache quota list: GET /quota: 403 ")
    assert control_state(fleet) == before  # nothing applied

    code, out, _ = cache(capsys, fleet, "quota", "config", "--default-limit-gb", "2")
    assert (code, out) == (0, "default quota: 2 GB\n")
    code, out, _ = cache(capsys, fleet, "quota", "list", "--json", str(fleet.tmp / "q.json"))
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("default quota: 2 GB; total usage ")
    assert "'tenant-a': limit 1.5 GB (own), usage 0 B (0.0%)" in lines
    empty = next(x for x in lines if x.startswith("'' (the empty salt): limit 2 GB (default)"))
    assert "KiB" in empty  # node-a's L2 copies of DOC count against the empty salt
    listed = json.loads((fleet.tmp / "q.json").read_text())
    assert {s["cache_salt"] for s in listed["by_cache_salt"]} >= {"", "tenant-a"}
    code, out, _ = cache(capsys, fleet, "quota", "config", "--default-limit-gb", "none")
    assert (code, out) == (0, "default quota: none (exempt)\n")
    assert cache(capsys, fleet, "quota", "config")[1] == "default quota: none (exempt)\n"
    code, out, _ = cache(capsys, fleet, "quota", "delete", "--cache-salt", "tenant-a", who=tenant)
    assert (code, out) == (0, "'tenant-a': quota removed (the default applies)\n")
    code, _, err = cache(capsys, fleet, "quota", "delete", "--cache-salt", "tenant-a")
    assert code == 1 and "no quota for cache_salt='tenant-a'" in err  # LMCache's 200 not_found
    code, _, err = cache(capsys, fleet, "quota", "set", "--cache-salt", "a@b", "--limit-gb", "1")
    assert code == 1 and "400 cache_salt must not contain any of @ / \\ NUL" in err


def test_bad_command_lines_exit_2_and_no_token_is_a_401_with_a_hint(
    capsys: pytest.CaptureFixture[str], fleet: Fleet
) -> None:
    before = control_state(fleet)
    loose = fleet.tmp / "loose.token"
    loose.write_text(ADMIN)
    loose.chmod(0o644)
    cut = fleet.tmp / "cut.json"
    cut.write_text("[1, 2,")
    empty = fleet.tmp / "empty.json"
    empty.write_text("[]")
    nan_wait = ("prefetch", *doc(fleet, "--instance-id", "node-a", "--wait"))
    for argv, who, says in (
        ((*nan_wait, "--poll-interval-s", "nan"), None, "must be finite numbers > 0"),
        ((*nan_wait, "--wait-timeout-s", "nan"), None, "must be finite numbers > 0"),
        (("pin", "--model-name", "toy", "--tokens-file", str(cut)), None, f"{cut}: not a list"),
        (("pin", "--model-name", "toy"), None, "give the tokens: --token-ids or --tokens-file"),
        (("pin", *doc(fleet), "--token-ids", "1"), None, "one of them"),
        (("pin", "--model-name", "toy", "--token-ids", "1,x"), None, "--token-ids: integers"),
        (("pin", "--model-name", "toy", "--token-ids", ""), None, "--token-ids: no token ids"),
        (("unpin", "--model-name", "toy", "--token-ids", " , "), None, "no token ids given"),
        (("pin", "--model-name", "toy", "--tokens-file", str(empty)), None, "--tokens-file: no"),
        (("pins", "--limit", "0"), None, "--limit must be 1-10,000"),
        (("quota", "set", "--cache-salt", "t", "--limit-gb", "-1"), None, "finite number >= 0"),
        (("quota", "set", "--cache-salt", "t", "--limit-gb", "inf"), None, "finite number >= 0"),
        (("pin", "--model-name", "toy", "--token-ids", str(1 << 64)), None, "at most 63 bits"),
        (("quota", "config", "--default-limit-gb", "lots"), None, "a number of GB or 'none'"),
        (("pins",), loose, "chmod 600 it"),
        (("pins", "--json", str(fleet.tmp / "no-such-dir" / "x.json")), None, "--json: cannot"),
    ):
        code, out, err = cache(capsys, fleet, *argv, who=who)
        assert (code, out) == (2, ""), (argv, err)
        assert says in err and "Traceback" not in err, (argv, err)
    capsys.readouterr()
    code = main(["cache", "pins", "--coordinator-url", fleet.url])
    err = capsys.readouterr().err
    assert code == 1 and "401" in err and "--coordinator-token-file" in err, err
    code = main(["cache", "pins", "--coordinator-url", "127.0.0.1:9300"])
    assert code == 2 and "is not an http(s) URL" in capsys.readouterr().err
    assert control_state(fleet) == before


def test_a_refusal_from_a_real_process_exits_1_with_the_detail(fleet: Fleet) -> None:
    """``python -m kvatlas.cli cache ...`` as an operator runs it, its token from the
    environment: a 403 is exit 1 and one line naming the salt, no traceback."""
    env = {**os.environ, "KVATLAS_COORDINATOR_TOKEN": TENANT_A,
           "KVATLAS_COORDINATOR_URL": fleet.url}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "kvatlas.cli", "cache", "pin", "--model-name", "toy",
         "--token-ids", ",".join(map(str, DOC)), "--cache-salt", "tenant-b"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    assert done.stderr == (
        "kvatlas cache pin: POST /cache/pins: 403 this token may not use cache_salt 'tenant-b'\n"
    )


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_rewrites_one_line_on_a_terminal_and_logs_changes_otherwise() -> None:
    """What ``--wait`` shows: on a terminal one line rewritten in place; in a log a line per
    change and one at least every 10 s while nothing changes (so a log shows it is alive)."""
    polls = iter(["pending", "pending", "pending", "pending", "completed"])
    times = iter([0.0, 4.0, 11.0, 14.0, 15.0, 16.0])  # the start, then one per poll
    log = io.StringIO()
    progress = _Progress("prefetch r1", log)
    status, ended = wait_for_status(
        lambda: next(polls), lambda s: s == "completed", timeout_s=60,
        on_status=lambda s, elapsed: progress.show(s, elapsed),
        clock=lambda: next(times), sleep=lambda s: None,
    )  # fmt: skip
    progress.close()
    assert (status, ended) == ("completed", True)
    assert log.getvalue().splitlines() == [
        "prefetch r1: pending (4 s)",
        "prefetch r1: pending (14 s)",  # nothing changed for 10 s: alive
        "prefetch r1: completed (16 s)",
    ]
    tty = _Terminal()
    progress = _Progress("move m1", tty)
    progress.show("pending (queued)", 0.0)
    progress.show("completed (done)", 2.0)
    progress.close()
    assert tty.getvalue() == (
        "\rmove m1: pending (queued) (0 s)\x1b[K\rmove m1: completed (done) (2 s)\x1b[K\n"
    )


def test_waiting_gives_up_at_its_timeout_with_the_last_status() -> None:
    times = iter([0.0, 0.2, 1.5, 2.0])
    slept: list[float] = []
    status, ended = wait_for_status(
        lambda: "pending", lambda s: s == "completed", timeout_s=2.0, interval_s=1.0,
        clock=lambda: next(times), sleep=slept.append,
    )  # fmt: skip
    assert (status, ended) == ("pending", False)
    assert slept == [1.0, 0.5]  # never past the timeout: the last sleep is what is left


def test_an_empty_coordinator_url_variable_is_not_set(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``KVATLAS_COORDINATOR_URL=`` was the URL "": ``error: --coordinator-url: '' is not an
    http(s) URL``, exit 2. Empty is not set (docs/configuration.md): the default URL."""
    from kvatlas.client.cache_cli import CoordinatorLink
    from kvatlas.config_flags import dataclass_from_args

    empty = {"KVATLAS_COORDINATOR_URL": ""}
    link = dataclass_from_args(CoordinatorLink, argparse.Namespace(), empty)
    assert link.coordinator_url == CoordinatorLink().coordinator_url
    monkeypatch.setenv("KVATLAS_COORDINATOR_URL", "")
    code = main(["cache", "pins"])  # (the default's coordinator may or may not be there)
    err = capsys.readouterr().err
    assert code != 2 and "is not an http(s) URL" not in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["move-status", "--move-id", ""],
        ["move-status", "--move-id", "", "--wait"],
        ["prefetch-status", "--instance-id", "a", "--request-id", ""],
        ["prefetch-status", "--instance-id", "", "--request-id", "r", "--wait"],
        ["prefetch", "--instance-id", "", "--model-name", "m", "--token-ids", "1"],
        ["delete", "--instance-id", "", "--model-name", "m", "--token-ids", "1"],
        ["move", "--source-instance-id", "a", "--target-instance-id", "", "--model-name", "m",
         "--token-ids", "1"],
    ],
)  # fmt: skip
def test_an_empty_id_is_a_bad_command_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``move-status --move-id ''`` sent ``GET /cache/moves/``, which the coordinator
    redirects to the moves listing: the reply held no move, an AttributeError traceback; an
    empty ``--request-id`` was a 404 without a detail. An empty id is a bad command line, exit
    2, naming the flag, nothing sent (nothing listens at the URL: a request would be exit 1)."""
    url = f"http://127.0.0.1:{free_port()}"
    code = main(["cache", argv[0], "--coordinator-url", url, *argv[1:]])
    err = capsys.readouterr().err
    flag = argv[argv.index("") - 1]
    assert code == 2 and f"error: {flag} is empty" in err, err
