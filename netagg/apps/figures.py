"""The docs' benchmark tables, rendered from the benchmarks' own `--json` output.

docs/figures/NAME.json holds one benchmark run as measured: `{"date", "machine", "command",
"note" (optional: the conditions), "notes" (optional: a table's own, by its name), "result":
<the bench's --json output>}`. A doc names a table by a marker
pair; everything between the markers is what `render` makes of the file, a line saying when,
where and how it was measured, then the table:

    <!-- figures: fabric -->            (docs/figures/fabric.json, its first table)
    <!-- figures: fabric.priority -->   (the same file, its table "priority")
    ...
    <!-- /figures -->

To refresh one, run the benchmark with `--json` and record its output (today's date, the
bench's own "machine" or this one's, the command), then rewrite the docs' tables:

    netagg bench loss --json > loss.json
    python -m netagg.apps.figures --record loss loss.json --command "netagg bench loss --json"
    python -m netagg.apps.figures                # rewrite every marked table
    python -m netagg.apps.figures --check        # exit 1 if a doc differs from its JSON

`tests/test_figures.py` runs the check, so the docs' tables cannot drift from the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
FIGURES = ROOT / "docs" / "figures"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- figures: ([\w.-]+) -->\n)(.*?)(<!-- /figures -->)", re.S)


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _n(x) -> str:
    """A count with thousands separators (a median of counts may be a float)."""
    return f"{round(x):,}"


def _pct(x: float) -> str:
    return f"{round(x * 100, 1):g} %"


def _mib(size: int) -> str:
    return f"{size >> 20} MiB"


def datapath(r: dict) -> str:
    rows = [[w, _n(f["beats"]), f"{f['in_beats_per_cycle']:.3f}",
             f"{f['out_beats_per_cycle']:.3f}", f["latency_cycles"],
             _n(f["sim_cycles_per_second"]), f"{f['build_seconds']:.0f}"]
            for w, f in r["widths"].items()]
    return _table(["width", "beats", "input beats/cycle", "output beats/cycle",
                   "first output beat (cycles)", "simulated cycles/s", "build (s)"], rows)


def cluster(r: dict) -> str:
    rows = []
    for row in r["runs"]:
        g, n = row["gloo"], row["netagg"]
        rows.append([row["hosts"], _mib(row["bytes"]), f"{g['seconds']:.3f} s",
                     f"{n['seconds']:.3f} s", f"{row['ratio']:.2f}", f"{row['predicted']:.2f}",
                     f"{row['of_prediction']:.2f}",
                     f"{max(n['utilisation_sent']):.2f} / {max(g['utilisation_sent']):.2f}"])
    return _table(["hosts", "size", "gloo", "netagg", "gloo / netagg", "predicted",
                   "of the prediction", "link use, netagg / gloo"], rows)


FABRIC_MODES = {"ecmp": "netagg, ECMP", "spray": "netagg, sprayed", "ring": "gloo's ring, ECMP"}


def fabric(r: dict) -> str:
    rows = []
    for mode, name in FABRIC_MODES.items():
        s = r["modes"][mode]
        rows.append([name, f"{s['seconds']:.3f} s", f"{s['worst_seconds']:.3f} s",
                     f"{_pct(s['imbalance_up'])} ({_pct(s['worst_imbalance_up'])})",
                     f"{_pct(s['imbalance_down'])} ({_pct(s['worst_imbalance_down'])})",
                     _n(s["retransmissions"]), _n(s["queue_drops"])])
    return _table(["mode", "median", "worst", "uplink imbalance up (worst)", "down (worst)",
                   "retransmissions", "uplink queue drops"], rows)


def fabric_priority(r: dict) -> str:
    p = r["priority_drop"]
    names = {"plain": "plain (class 0, shares the low class)",
             "priority": "priority (class 4, all high)",
             "priority_drop": f"priority drop (class 4, budget {p['loss_budget']:g})"}
    rows = []
    for mode, name in names.items():
        s = p["modes"][mode]
        rows.append([name, f"{s['p50']:.3f} s", f"{s['p99']:.3f} s",
                     f"{s['cross_goodput_bps'] / 1e6:.1f} Mb/s",
                     f"{_n(s['uplink_drops_high'])} / {_n(s['uplink_drops_low'])}",
                     _n(s["given_up"]), _n(s["retransmissions"]), f"{s['error']:g}"])
    return _table(["netagg", "step p50", "step p99", "other job's goodput",
                   "uplink drops high / low", "given up", "retransmissions",
                   "largest relative error"], rows)


def loss(r: dict) -> str:
    rows = []
    for row in r["runs"]:
        e, t = row["early"], row["timers"]
        rows.append([f"{row['loss'] * 100:g} %", f"{e['seconds']:.2f} s", f"{t['seconds']:.2f} s",
                     f"{row['timers_over_early']:.1f}x",
                     f"{_n(e['retransmissions'])} ({_n(e['early_retransmissions'])}, "
                     f"{_n(e['probes'])}) / {_n(t['retransmissions'])}"])
    return _table(["loss each way", "early recovery", "timeouts alone", "timeouts / early",
                   "retransmissions: early (of them early, probes) / timeouts"], rows)


FAILURE_ERRORS = {"switch killed": "NetaggSwitchGone", "job taken over": "NetaggJobTakenOver"}


def failures(r: dict) -> str:
    rows = [[s["backend"].upper() if s["backend"] == "rtl" else s["backend"], s["scenario"],
             f"{s['named']} ({s['right']} `{FAILURE_ERRORS[s['scenario']]}`)",
             f"{s['median']:.2f} s", f"{s['largest']:.2f} s"] for s in r["scenarios"]]
    return _table(["switch", "failure", "errors (right)", "median", "largest"], rows)


def leafspine(r: dict) -> str:
    rows = [[b["spines"], ", ".join(_n(n) for n in b["partials_per_uplink"]),
             ", ".join(f"{s:g}" for s in b["shares"]), f"{b['max_share_over_even']:.3f}"]
            for b in r["balance"]]
    return _table(["spines", "partials per uplink (both leaves)", "shares",
                   "largest share / even"], rows)


def congestion(r: dict) -> str:
    rows = []
    for mode, s in r["priority_drop"]["modes"].items():
        lost = s["lost_contributions"]
        rows.append([mode, f"{s['p50_s'] * 1e3:.1f} ms", f"{s['p99_s'] * 1e3:.1f} ms",
                     f"{s['max_s'] * 1e3:.1f} ms", _n(s["tail_drops"]), _n(s["nulled"]),
                     _n(s["retransmissions"]),
                     f"{_n(lost)} of {_n(s['packets_sent'])} packets" if lost else "0"])
    return _table(["priority drop", "completion p50", "p99", "max", "tail drops", "nulled",
                   "retransmissions", "contributions lost"], rows)


def congestion_spraying(r: dict) -> str:
    s = r["spraying"]
    rows = [[paths, f"{p['goodput_MBps']:.2f} MB/s",
             ", ".join(f"{g:.2f}" for g in p["goodput_MBps_runs"]),
             ", ".join(str(n) for n in p["switch_port_contributions"]),
             "yes" if p["same_result_as_first"] else "no"] for paths, p in s["paths"].items()]
    return _table(["paths", f"goodput per worker (median of {s['repeat']})", "runs (MB/s)",
                   "contributions per switch port (last run)", "same result"], rows)


RENDER = {"datapath": datapath, "cluster": cluster, "fabric": fabric,
          "fabric.priority": fabric_priority, "loss": loss, "failures": failures,
          "leafspine": leafspine, "congestion": congestion,
          "congestion.spraying": congestion_spraying}


def load(name: str) -> dict:
    return json.loads((FIGURES / f"{name.split('.')[0]}.json").read_text())


def render(name: str) -> str:
    """What goes between a table's markers: the measurement's line, then the table."""
    figure = load(name)
    table = name.partition(".")[2]
    text = figure.get("notes", {}).get(table) or figure.get("note")
    note = f"; {text}" if text else ""
    when = f" {figure['date']}" if figure.get("date") else ""
    return (f"Measured{when} on {figure['machine']} (`{figure['command']}`{note}):"
            f"\n\n{RENDER[name](figure['result'])}\n")


def rewrite(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2)) + m.group(4), text)


def marked(text: str) -> list[str]:
    return [m.group(2) for m in BLOCK.finditer(text)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m netagg.apps.figures",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a doc's table is not its JSON's")
    parser.add_argument("--record", nargs=2, metavar=("NAME", "FILE"),
                        help="make docs/figures/NAME.json of a bench's --json output in FILE")
    parser.add_argument("--command", help="with --record: the command that measured it")
    parser.add_argument("--note", help="with --record: the conditions, in a few words")
    args = parser.parse_args(argv)
    if args.record:
        name, path = args.record
        result = json.loads(Path(path).read_text())
        machine = result.get("machine") or (f"{os.cpu_count()} cores, {platform.machine()}, "
                                            f"Linux {platform.release()}")
        figure = {"date": result.get("date") or datetime.date.today().isoformat(),
                  "machine": machine, "command": args.command or f"netagg bench {name} --json",
                  **({"note": args.note} if args.note else {}), "result": result}
        (FIGURES / f"{name}.json").write_text(json.dumps(figure, indent=1) + "\n")
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        new = rewrite(text)
        if new != text:
            stale.append(doc.relative_to(ROOT))
            if not args.check:
                doc.write_text(new)
    for path in stale:
        print(f"{path}: {'differs from' if args.check else 'rewritten from'} docs/figures")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
