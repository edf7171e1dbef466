"""The `netagg` command line: a subparser per command (and per benchmark) with only its own
options, each checked where it is parsed, so that a bad argument ends in argparse's one-line
usage error (exit status 2) naming the command and the option and what it takes, before
anything runs: no traceback, no run that cannot succeed. A name that does not resolve is
answered by a stand-in resolver: no query leaves the machine. Importing the command line, and
parsing, import none of the simulation stack; a command that needs it where it is missing says
so in one line; a switch that does not answer is one line naming it."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys

import pytest

from netagg.apps import arguments as A
from netagg.apps import commands
from netagg.apps.cli import main
from netagg.apps.commands import gpu_check, train

# (argv, the option named, what the message says): every command and benchmark at least once.
BAD = [
    (["bench", "datapath", "--widths", "64,100"], "--widths", "one of 64, 128, 256, 512"),
    (["bench", "switch", "--ports", "1"], "--ports", "2 to 16"),
    (["bench", "switch", "--width", "48"], "--width", "one of 64"),
    (["bench", "allreduce", "--transports", "inproc,tcp"], "--transports", "one of inproc, udp"),
    (["bench", "allreduce", "--backend", "fpga"], "--backend", "invalid choice"),
    (["bench", "congestion", "--paths", "1,two"], "--paths", "a whole number"),
    (["bench", "congestion", "--experiments", "spraying,x"], "--experiments", "priority_drop"),
    (["bench", "congestion", "--loss-budget", "1.5"], "--loss-budget", "from 0 to 1"),
    (["bench", "board", "--board", "nexys"], "--board", "invalid choice"),
    (["bench", "host", "--sizes", "1Q"], "--sizes", "K, M or G"),
    (["bench", "leafspine", "--json", "--bogus"], "--bogus", ""),
    (["bench", "cluster", "--hosts", "4,x"], "--hosts", "a whole number"),
    (["bench", "cluster", "--rate", "fast"], "--rate", "mbit"),
    (["bench", "cluster", "--queue", "10ms"], "--queue", "kb"),
    (["bench", "fast", "--seconds", "-1"], "--seconds", "above 0"),
    (["bench", "loss", "--losses", "1,100"], "--losses", "below 100"),
    (["bench", "loss", "--values", "2.5"], "--values", "a whole number"),
    (["bench", "failures", "--backends", "golden,fast"], "--backends", "one of golden, rtl"),
    (["bench", "fabric", "--topology", "2by2"], "--topology", "LEAVESxSPINES"),
    (["bench", "fabric", "--oversubscription", "0"], "--oversubscription", "above 0"),
    (["bench", "fabric", "--widths", "64"], "--widths", ""),
    (["demo", "--switch", "udp://nonsense.invalid"], "--switch", "no IPv4 address"),
    (["demo", "--switch", "tcp://127.0.0.1:4791"], "--switch", "udp://host:port"),
    (["demo", "--values", "-5"], "--values", "at least 1"),
    (["demo", "--workers", "0"], "--workers", "at least 1"),
    (["demo", "--workers", "3", "--nodes", "2"], "--nodes", "do not split"),
    (["demo", "--bind", "10.0.0.1,localhost"], "--bind", "an IPv4 address"),
    (["demo", "--fabric", "/nonexistent/fabric.json"], "--fabric", "no readable file"),
    (["demo", "--uplink-down-at", "1"], "--uplink-down-at", "between 0 and 1"),
    (["train", "--runs", "gloo,nccl"], "--runs", "one of gloo, netagg, netagg_drop"),
    (["train", "--rate", "lots"], "--rate", "mbit"),
    (["gpu-check", "--layouts", "ring"], "--layouts", "one of hierarchical, flat"),
    (["gpu-check", "--timeout", "nan"], "--timeout", "finite"),
    (["probe", "udp://127.0.0.1:99999"], "url", "Port out of range"),
    (["probe", "udp://127.0.0.1:4791", "--timeout", "0"], "--timeout", "above 0"),
    (["sim", "serve", "--host", "0.0.0.0"], "--host", "not 0.0.0.0"),
    (["sim", "serve", "--topology", "0x2"], "--topology", "1 to 15 leaves"),
    (["demo", "--topology", "2x5"], "--topology", "1 to 4 spines"),
    (["sim", "serve", "--max-workers", "33"], "--max-workers", "1 to 32"),
    (["sim", "serve", "--slots", "4097"], "--slots", "1 to 4096"),
    (["sim", "board", "--board", "versa_ecp5_5g", "--tap", "a-much-too-long-prefix"], "--tap",
     "up to 12"),
    (["fuzz", "--width", "100"], "--width", "one of 64"),
    (["fuzz", "--against", "fast", "--leaf"], "--against", "single switch"),
    (["scale", "--workers", "abc"], "--workers", "a whole number"),
    (["scale", "--schemes", "ring,allgather"], "--schemes", "one of ring"),
    (["scale", "--bcube", "8"], "--bcube", "n,k"),
    (["scale", "--gbps", "1000"], "--gbps", "1 to 400"),
    (["cluster", "up", "--topology", "2"], "--topology", "LEAVESxSPINES"),
    (["cluster", "down", "--name", "a/b"], "--name", "letters, digits"),
    (["prove", "--jobs", "0"], "--jobs", "at least 1"),
]


def _prog(argv: list[str]) -> str:
    """The command's name as its parser says it: `netagg bench fabric`, `netagg demo`."""
    nested = argv[0] in ("bench", "sim", "cluster")
    return "netagg " + " ".join(argv[:2] if nested else argv[:1])


@pytest.mark.parametrize("argv, option, says", BAD, ids=[" ".join(a) for a, _, _ in BAD])
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
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{_prog(argv)}: error: "), last
    assert (f"argument {option}" in last or f"unrecognized arguments: {option}" in last), last
    assert says in last and "Traceback" not in err


def test_every_command_and_benchmark_is_tried():
    """BAD holds every command and every benchmark (a new one needs a line there)."""
    from netagg.apps.cli import parser
    tried = {_prog(argv) for argv, _, _ in BAD}
    top = parser()
    named = set()
    for command, sub in _choices(top).items():
        inner = _choices(sub)
        named |= {f"netagg {command} {n}" for n in inner} if inner else {f"netagg {command}"}
    assert named == tried


def _choices(parser) -> dict:
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            return action.choices
    return {}


def test_a_benchmark_lists_only_its_own_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "fabric", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--topology" in out and "--loss-budget" in out
    for other in ("--widths", "--transports", "--losses", "--backends", "--board", "--hosts "):
        assert other not in out


def test_defaults_are_todays(monkeypatch):
    """Each benchmark's defaults, as the flat `bench` parser's run gave them."""
    from netagg.apps.cli import parser
    p = parser()
    fabric = p.parse_args(["bench", "fabric"])
    assert (fabric.topology, fabric.hosts_per_leaf, fabric.rate, fabric.oversubscription,
            fabric.size, fabric.repeat, fabric.steps, fabric.loss_budget) == \
        ("2x2", 2, "40mbit", 2.0, 8 << 20, 5, 40, 0.1)
    cluster = p.parse_args(["bench", "cluster"])
    assert (cluster.hosts, cluster.rate, cluster.repeat, cluster.switch) == \
        ([4, 8], "100mbit", 3, "fast")
    assert p.parse_args(["bench", "loss"]).losses == [0.01, 0.05, 0.2]
    assert p.parse_args(["bench", "datapath"]).widths == [64, 128, 256, 512]
    assert p.parse_args(["bench", "fast"]).workers == 8
    assert p.parse_args(["bench", "congestion"]).paths == [1, 2, 4]
    assert p.parse_args(["bench", "failures"]).backends == ["golden", "rtl"]
    assert p.parse_args(["train"]).runs == list(train.RUNS)


def test_sizes_read_as_users_write_them():
    assert A.sizes("4K,1M,1.5MB,2G,4096") == [4096, 1 << 20, 3 << 19, 2 << 30, 4096]
    assert A.positives("4,8") == [4, 8]
    assert A.switch_url("udp://127.0.0.1:4791") == "udp://127.0.0.1:4791"
    assert A.percents("1,5,20") == [0.01, 0.05, 0.2]
    assert A.rate("100mbit") == "100mbit" and A.queue("256kb") == "256kb"
    assert [A.count(c) for c in ("4M", "200000", "1.5K")] == [4 << 20, 200_000, 1536]


def test_names_repeated_for_the_command_line_are_their_sources():
    """The light copies of names the simulation stack or torch's runs define."""
    from netagg import bitstreams
    from netagg.apps import gpu_check as G
    from netagg.apps import torch_runs
    from netagg.hw import beat
    assert A.BOARDS == bitstreams.BOARDS
    assert A.WIDTHS == beat.WIDTHS
    assert train.RUNS == tuple(r.name for r in torch_runs.RUNS)
    assert gpu_check.LAYOUTS == tuple(G.LAYOUTS)


def test_the_fabric_limits_are_the_fabrics():
    """A topology the command line takes is one the fabric takes, at both ends."""
    from netagg.sim import cluster_fabric, topology
    for fabric, (leaves, spines) in ((A.simulated_fabric, (15, 4)),
                                     (A.emulated_fabric, (60, 60))):
        assert fabric(f"{leaves}x{spines}") and fabric("1x1")
        for bad in (f"{leaves + 1}x1", f"1x{spines + 1}", "0x1"):
            with pytest.raises(argparse.ArgumentTypeError):
                fabric(bad)
    topology.Topology(15, 4, downlinks=1)
    topology.Topology(1, 1)
    for leaves, spines in ((16, 1), (1, 5)):
        with pytest.raises(ValueError):
            topology.Topology(leaves, spines, downlinks=1)
    cluster_fabric.Topology(60, 60, 1)
    for leaves, spines in ((61, 1), (1, 61)):
        with pytest.raises(ValueError):
            cluster_fabric.Topology(leaves, spines, 1)


def test_the_switch_limits_are_the_switchs():
    """`sim serve`'s ranges are those the switch takes: at each end it is built, beyond
    either it is refused."""
    from netagg.sim.golden import GoldenSwitch
    limits = {"ports": A.PORTS, "jobs": A.JOBS, "max_workers": A.MAX_WORKERS, "slots": A.SLOTS}
    for name, (low, high) in limits.items():
        for value in (low, high):
            GoldenSwitch(**{name: value})
        for value in (low - 1, high + 1):
            with pytest.raises(ValueError):
                GoldenSwitch(**{name: value})


def test_the_command_line_imports_no_simulation_stack():
    """`netagg --help`, and parsing a light command, import neither Amaranth, cocotb, scapy,
    netagg.hw nor netagg.sim (a host installed without the `sim` extra runs them)."""
    code = ("import sys, json; import netagg.apps.cli as c; "
            "c.parser().parse_args(['bench', 'host', '--sizes', '1M']); "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    heavy = [m for m in json.loads(out) if m.split(".")[0] in ("amaranth", "cocotb", "cocotbext",
                                                               "scapy")
             or m.startswith(("netagg.hw", "netagg.sim"))]
    assert heavy == []


@pytest.mark.parametrize("argv, missing", [
    (["bench", "fast", "--seconds", "0.1"], "netagg.sim.bench_fast"),
    (["fuzz", "--frames", "1"], "amaranth"),
    (["sim", "serve"], "netagg.sim"),
])
def test_without_the_simulation_stack_a_command_says_so(argv, missing):
    """Where the `sim` extra is not installed (here: its import made to fail, in a process of
    its own), a command that needs it says so in one line, exit status 2."""
    code = (f"import sys; sys.modules[{missing!r}] = None; from netagg.apps.cli import main; "
            f"sys.exit(main({argv!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"{_prog(argv)}: needs the simulation stack (pip install 'netagg[sim]')"]


def test_an_import_error_of_netagg_itself_is_not_hidden():
    assert commands.needs_sim_stack(ModuleNotFoundError("x", name="amaranth.hdl"))
    assert commands.needs_sim_stack(ModuleNotFoundError("x", name="netagg.sim"))
    assert not commands.needs_sim_stack(ModuleNotFoundError("x", name="netagg.host.engine"))
    assert not commands.needs_sim_stack(ModuleNotFoundError("x", name="amaranthine"))


@pytest.mark.parametrize("argv", [
    ["probe", "udp://127.0.0.1:9", "--timeout", "0.5"],
    ["demo", "--switch", "udp://127.0.0.1:9", "--values", "1000"],
], ids=["probe", "demo"])
def test_a_switch_that_does_not_answer_is_one_line_naming_it(argv, capsys):
    """Nothing listens on the discard port: one line within seconds, naming the switch."""
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"netagg {argv[0]}: ") and "127.0.0.1" in err[0]
