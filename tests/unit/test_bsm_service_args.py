"""``ps-bsm``'s command line refuses bad arguments before it binds anything, and the entry point
is installed. (The service over real sockets: tests/integration/test_bsm_service.py.)"""

from __future__ import annotations

from importlib.metadata import entry_points

from ps_server import bsm_service


def test_cli_rejects_bad_arguments(capsys):
    assert bsm_service.main(["--policy", "nope", "--global-batch", "8"]) == 2
    assert "unknown batch policy" in capsys.readouterr().err
    assert bsm_service.main(["--global-batch", "8", "--policy-args", "[1]"]) == 2
    assert "JSON object" in capsys.readouterr().err
    assert bsm_service.main(["--global-batch", "0"]) == 2
    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("ps-bsm") == "ps_server.bsm_service:main"
