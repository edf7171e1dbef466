"""Bad command-line arguments end in argparse's one-line usage error (exit status 2) naming
the option and what it takes, before anything runs: no traceback, no run that cannot
succeed. A name that does not resolve is answered by a stand-in resolver: no query leaves
the machine."""

from __future__ import annotations

import socket

import pytest
from netagg.apps import arguments as A
from netagg.apps.cli import main


@pytest.mark.parametrize("argv, option, says", [
    (["demo", "--switch", "udp://nonsense.invalid"], "--switch", "no IPv4 address"),
    (["demo", "--switch", "tcp://127.0.0.1:4791"], "--switch", "udp://host:port"),
    (["demo", "--values", "-5"], "--values", "at least 1"),
    (["demo", "--workers", "0"], "--workers", "at least 1"),
    (["scale", "--workers", "abc"], "--workers", "a whole number"),
    (["bench", "host", "--sizes", "1Q"], "--sizes", "K, M or G"),
    (["bench", "cluster", "--hosts", "4,x"], "--hosts", "a whole number"),
    (["probe", "udp://127.0.0.1:99999"], "url", "Port out of range"),
    (["prove", "--jobs", "0"], "--jobs", "at least 1"),
])
def test_a_bad_argument_is_one_line_naming_it(argv, option, says, capsys, monkeypatch):
    resolve = socket.getaddrinfo

    def no_such_name(host, *rest):
        if host.endswith(".invalid"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return resolve(host, *rest)

    monkeypatch.setattr(socket, "getaddrinfo", no_such_name)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"netagg {argv[0]}") and f"argument {option}" in err and says in err
    assert "Traceback" not in capsys.readouterr().err


def test_sizes_read_as_users_write_them():
    assert A.sizes("4K,1M,1.5MB,2G,4096") == [4096, 1 << 20, 3 << 19, 2 << 30, 4096]
    assert A.positives("4,8") == [4, 8]
    assert A.switch_url("udp://127.0.0.1:4791") == "udp://127.0.0.1:4791"
