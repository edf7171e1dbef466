"""netagg: an FPGA switch that speaks RoCEv2 and adds gradients in flight, and the host software
that uses it.

- `netagg.contract`: the wire and the register map, declared once in plain Python (numpy for
  the array codecs); everything else derives its layouts from it;
- `netagg.host`: the worker's driver, its engine and transport, and the PyTorch backend;
- `netagg.apps`: the `netagg` command, its demo, benchmarks and training runs;
- `netagg.hw`: the switch's gateware (Amaranth);
- `netagg.sim`: the golden model, the RTL under Verilator, the simulated switch and board;
- `netagg.bitstreams`: the board targets.

`pip install netagg` installs the first three and what they need; `hw`, `sim` and
`bitstreams` need the `sim` extra (Amaranth, cocotb, Verilator, scapy).
"""
