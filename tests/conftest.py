import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from netagg.hw.beat import WIDTHS  # noqa: E402
from netagg.sim.build import cocotb_runner  # noqa: E402
from netagg.sim.toolchain import have_icarus  # noqa: E402

SIMULATORS = [
    "verilator",
    pytest.param("icarus", marks=pytest.mark.skipif(not have_icarus(),
                                                    reason="Icarus Verilog is not installed")),
]


def run_cocotb(module: str, top: str, testcase: str, simulator: str = "verilator",
               env: dict | None = None, **params):
    """Run cocotb test `testcase` of `module` (tests.cocotb_datapath, say) on `top` built
    with `params`.

    WAVES=1 in the environment writes a waveform (VCD) into the build dir.
    """
    waves = os.environ.get("WAVES") == "1"
    runner, build_dir = cocotb_runner(top, simulator=simulator, waves=waves, **params)
    extra_env = {
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "NETAGG_WIDTH": str(params.get("width", 64)),
        **(env or {}),
    }
    test_dir = Path(tempfile.mkdtemp(prefix=f"{testcase.split(',')[0]}-", dir=build_dir))
    runner.test(
        test_module=module, hdl_toplevel="top", testcase=testcase,
        build_dir=build_dir, test_dir=test_dir, extra_env=extra_env, waves=waves,
        results_xml=str(test_dir / "results.xml"),
    )


@pytest.fixture(scope="module")
def served_switch():
    """A golden switch served over UDP (`netagg sim serve` in its own process, one a test
    module): its `udp://` URL."""
    from netagg.sim.bench import start_server
    proc, url = start_server("golden")
    yield url
    proc.terminate()
    proc.wait(10)
    proc.stdout.close()


# Widths in the default run; the others are in the slow set (`pytest -m slow`). Each width is
# a Verilator build of its own per top (15-60 s on two cores, see netagg/sim/build.py): the default
# run keeps the narrowest (a header over many beats) and the widest (a header in two beats,
# most frames in one or two), the slow set adds 128 and 256.
DEFAULT_WIDTHS = (64, 512)


@pytest.fixture(params=[w if w in DEFAULT_WIDTHS else pytest.param(w, marks=pytest.mark.slow)
                        for w in WIDTHS], ids=lambda w: f"w{w}")
def width(request):
    return request.param


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Keep the tests that share a build on one xdist worker (`--dist loadgroup`): one module
    and width (or simulator), the switch's and the leaf's cocotb testbenches, the proofs, and
    the tests on each RTL model build (`RTL_GROUPS`). Each worker then builds its own tops, in
    parallel with the other, instead of waiting on the other's build lock. Runs before xdist's
    own hook, which reads the groups. Other tests are left to xdist one by one."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else "tests"
        if "width" in params:
            group = f"{module}-w{params['width']}"
        elif params.get("simulator") == "verilator":
            group = f"{module}-w64"
        elif "simulator" in params:
            group = f"{module}-{params['simulator']}"
        elif module == "test_switch":
            group = "switch"            # one switch build for all its testbenches
        elif module == "test_leaf_cocotb":
            group = "leaf-cocotb"       # the leaf's and the switch's builds
        elif module == "test_formal":
            group = "formal"            # YoWASP compiles its Yosys once (no lock of its own)
        elif "rtl" in item.name or RTL_FIXTURES & set(item.fixturenames):
            group = RTL_GROUPS.get(module, "rtl-model")
        else:
            continue
        item.add_marker(pytest.mark.xdist_group(group))


# Tests on the Python-driven RTL (`sim.model`: "rtl" in the test's name or parameters, or one
# of these fixtures), grouped by the build they load, so that each build is made by one worker
# while the other worker builds another or runs other tests (one group for all of them made
# one worker build them one after the other). "rtl-model": the switch's default build
# (`make_switch()`), the host's tests and the fuzzer's.
RTL_FIXTURES = {"rtl_model", "rtl_spine", "small_spine", "rtl_leaf"}
RTL_GROUPS = {
    "test_spine_rtl": "rtl-spine",              # make_switch(spine=True)
    # the 2x2 fabric's leaves (6 ports, 2 uplinks) and spines (3 ports): Topology(2, 2)
    "test_leaf_rtl": "rtl-fabric",
    "test_topology": "rtl-fabric",
    "test_spine_failure_rtl": "rtl-fabric",
    "test_fabric_quorum": "rtl-fabric",
    "test_leafspine_e2e": "rtl-fabric",
}


@pytest.fixture(scope="module")
def rtl_model():
    """The switch's RTL (`sim.model.make_switch`), one per test module."""
    from netagg.sim.model import make_switch

    with make_switch() as rtl:
        yield rtl


@pytest.fixture(params=["golden", "rtl"])
def switch(request):
    """The golden model, then the RTL reset: a test of the switch's behaviour runs on both."""
    from netagg.sim.golden import GoldenSwitch

    if request.param == "golden":
        return GoldenSwitch()
    rtl = request.getfixturevalue("rtl_model")
    rtl.reset()
    return rtl
