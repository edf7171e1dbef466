"""netagg: an FPGA switch that speaks RoCEv2 and adds gradients in flight, and the host software
that uses it.

- `netagg.hw`: the switch's gateware (Amaranth) and the wire contract (`netagg.hw.headers`,
  `netagg.hw.regmap`) that everything else is derived from;
- `netagg.sim`: the golden model, the RTL under Verilator, the simulated switch and board;
- `netagg.host`: the worker's driver, its engine and transport, and the PyTorch backend;
- `netagg.apps`: the `netagg` command, its demo, benchmarks and training runs;
- `netagg.bitstreams`: the board targets.

An installed distribution holds these as subfolders of this package. In the project's source
tree they are its top-level folders, beside this one, so the package's path includes the
tree's root.
"""

from pathlib import Path

_TREE = Path(__file__).resolve().parent.parent
if not (Path(__file__).parent / "hw").is_dir() and (_TREE / "hw" / "headers.py").is_file():
    __path__.append(str(_TREE))
