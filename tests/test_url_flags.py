"""A URL flag without a scheme is refused at start (exit 2, naming the flag): it used to be
taken as a relative path and retried forever (issue 29 item 5)."""

from __future__ import annotations

import pytest

from kvatlas.cli import main

NODE = ["node", "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8", "--port", "0"]
CASES = [
    [*NODE, "--coordinator-url", "127.0.0.1:9300", "--coordinator-event-reporting"],
    ["router", "--engine", "e0=http://127.0.0.1:8000", "--coordinator-url", "localhost:9300"],
    ["engine-sim", "--port", "8001", "--node-url", "127.0.0.1:9400"],
]


@pytest.mark.parametrize("argv", CASES, ids=["node", "router", "engine-sim"])
def test_a_url_without_a_scheme_is_exit_2_naming_the_flag(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "is not an http(s) URL" in err and "Traceback" not in err


SECRET = "s3cret-pw"
WITH_USERINFO = [
    [*NODE, "--coordinator-url", f"http://ops:{SECRET}@127.0.0.1:9300",
     "--coordinator-event-reporting"],
    ["router", "--policy", "round-robin", "--engine", f"e0=http://ops:{SECRET}@127.0.0.1:8000"],
    ["router", "--engine", "e0=http://127.0.0.1:8000",
     "--coordinator-url", f"http://ops:{SECRET}@127.0.0.1:9300"],
    ["engine-sim", "--port", "8001", "--node-url", f"http://ops:{SECRET}@127.0.0.1:9400"],
]  # fmt: skip


@pytest.mark.parametrize(
    "argv", WITH_USERINFO, ids=["node", "router-engine", "router-coordinator", "engine-sim"]
)
def test_a_url_with_a_password_is_exit_2_without_echoing_it(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``user:password@`` in a URL flag was accepted: the router showed its engines' URLs on
    its open ``/healthz`` and in its logs, password included (and sent it only on its health
    probes, not with the requests it routes). kvatlas authenticates with bearer tokens from
    files; a URL's credentials are refused at start, and the message does not repeat them."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "user:password@" in err and SECRET not in err and "Traceback" not in err


def test_check_http_url_refuses_credentials_and_keeps_the_rest() -> None:
    """The check behind every URL flag (the CLI test above hangs on the old code: the service
    starts)."""
    from kvatlas.checks import check_http_url

    assert check_http_url("http://127.0.0.1:9300/", "--x") == "http://127.0.0.1:9300"
    assert check_http_url("https://[::1]:8000/v1", "--x") == "https://[::1]:8000/v1"
    for url in (f"http://ops:{SECRET}@h:1", "http://ops@h:1", "https://:pw@h"):
        with pytest.raises(ValueError, match="user:password@") as exc:
            check_http_url(url, "--x")
        assert SECRET not in str(exc.value)
