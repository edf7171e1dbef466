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


# Widths in the default run; any other is in the slow set (`pytest -m slow`). Each width is a
# Verilator build of its own (15-60 s on two cores, see sim/build.py), so all four run.
DEFAULT_WIDTHS = WIDTHS


@pytest.fixture(params=[w if w in DEFAULT_WIDTHS else pytest.param(w, marks=pytest.mark.slow)
                        for w in WIDTHS], ids=lambda w: f"w{w}")
def width(request):
    return request.param


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Keep the tests of one module and width (or simulator) on one xdist worker (`--dist
    loadgroup`): each worker then builds its own tops, in parallel with the other, instead of
    waiting on the other's build lock. Runs before xdist's own hook, which reads the groups.
    Tests with neither parameter are left to xdist one by one."""
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
            group = "leaf-cocotb"       # the leaf's, the spine's and the switch's builds
        elif "rtl" in item.name:
            group = "rtl-model"         # host tests on the switch's Python-driven model
        else:
            continue
        item.add_marker(pytest.mark.xdist_group(group))


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
