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
