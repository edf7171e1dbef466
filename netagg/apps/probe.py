"""`netagg probe udp://HOST:PORT`: what a user runs first after loading a bitstream.

It reads, through the control path, whether the switch answers and how fast, its magic, its
parameters (ports, jobs, workers per job, slots, largest payload, datapath width), its own
addresses (the source of results), the switch port this host's requests come in by, its
manager, each job's configuration (its owner, epoch and deadline too; its key is never read), its
ranks' heartbeats (BEAT, `host.liveness`), and every port and job counter; and prints them as tables
(`--json`: one object). `sources(url)` finds, among this host's addresses, one per switch
port it reaches (how `netagg demo` puts nodes on every cabled port).
"""

from __future__ import annotations

import ipaddress
import socket
import time

from netagg.contract import regmap as R
from netagg.host import netif
from netagg.host.control import SwitchControl, ip_str
from netagg.host.engine import NetaggError
from netagg.host.transport import UdpTransport, parse_udp_url

JOB_FIELDS = (("config", R.JOB_CONFIG), ("slot_base", R.JOB_SLOT_BASE),
              ("slot_count", R.JOB_SLOT_COUNT), ("credits", R.JOB_CREDITS),
              ("quorum", R.JOB_QUORUM), ("completed", R.JOB_COMPLETED),
              ("epoch", R.JOB_EPOCH),    # its KEY reads 0: no control read learns it
              ("owner", R.JOB_OWNER), ("deadline", R.JOB_DEADLINE))


def probe(url: str, timeout: float = 3.0) -> dict:
    """Everything `netagg probe` shows, as one dict. Raises NetaggError when the switch does
    not answer within `timeout` seconds, or is not a netagg switch."""
    t0 = time.perf_counter()
    ctl = SwitchControl(url, timeout=timeout)
    try:
        rtt_ms = (time.perf_counter() - t0) * 1e3
        p = dict(ctl.params)
        p["mac"] = _mac_str(p["mac"])
        jobs = {}
        for j in range(p["jobs"]):
            values = ctl.read(*(R.job_reg(j, off) for _, off in JOB_FIELDS))
            job = dict(zip((name for name, _ in JOB_FIELDS), values))
            config = job.pop("config")
            job.update(enabled=bool(config >> 31), workers=config & 0x3F,
                       owner=ip_str(job["owner"]) if job["owner"] else None)
            ranks = min(job["workers"], p["max_workers"])
            job["beats"] = ctl.read(*(R.beat_reg(j, r) for r in range(ranks))) if ranks else []
            jobs[j] = job
        manager = ctl.manager()
        counters = ctl.counters()
        local = ctl.transport.local
    finally:
        ctl.close()
    return {"url": url, "answers": True, "rtt_ms": round(rtt_ms, 3), "magic": f"{R.MAGIC:#x}",
            "params": p, "host": {"ip": local.ip, "mac": _mac_str(local.mac),
                                  "switch_port": p["port"]}, "manager": manager,
            "jobs": jobs, "port_counters": counters["ports"], "job_counters": counters["jobs"]}


def sources(url: str) -> list[str]:
    """One local IPv4 address per switch port this host reaches, in port order: each address
    of an up interface (loopback ones only for a switch on loopback) asks REG_PORT."""
    host, _ = parse_udp_url(url)
    loopback = ipaddress.IPv4Address(socket.gethostbyname(host)).is_loopback
    by_port: dict[int, str] = {}
    for ip in netif.candidate_addresses(loopback):
        try:
            t = UdpTransport(url, bind_ip=ip)
        except OSError:
            continue
        try:
            by_port.setdefault(t.ingress_port(t.sock, t.local, tries=2), ip)
        except (TimeoutError, OSError):
            pass
        finally:
            t.close()
    return [by_port[p] for p in sorted(by_port)]


def _mac_str(mac: int) -> str:
    return ":".join(f"{b:02x}" for b in mac.to_bytes(6, "big"))


def print_probe(report: dict, console) -> None:
    from rich.table import Table

    p, h = report["params"], report["host"]
    console.print(
        f"[bold]{report['url']}[/bold] answers (magic {report['magic']}, "
        f"{report['rtt_ms']:.1f} ms to read its parameters)\n"
        f"switch: {p['ports']} ports, {p['jobs']} jobs of up to {p['max_workers']} workers, "
        f"{p['slots']} slots, payloads up to {p['max_payload']} bytes, {p['width']}-bit "
        f"ports\nresults from: {p['ip']}:{p['udp_sport']} (MAC {p['mac']})"
        + (" (unset: the first worker sets it)" if p["ip"] == "0.0.0.0" else "")
        + f"\nthis host: {h['ip']} (MAC {h['mac']}) on switch port {h['switch_port']}"
        + f"\nmanager: {report['manager'] or 'none (the first write of REG_MANAGER sets it)'}")
    jobs = Table(title="jobs")
    columns = ("enabled", "owner", "workers", "slot_base", "slot_count", "credits", "quorum",
               "completed", "epoch", "deadline")
    for col in ("job", *columns, "beats (by rank)"):
        jobs.add_column(col, justify="right")
    for j, job in report["jobs"].items():
        jobs.add_row(str(j), *(f"{job[c]:#010x}" if c == "epoch" else str(job[c] or "-")
                               if c == "owner" else str(job[c]) for c in columns),
                     " ".join(f"{b:08x}" for b in job["beats"]))
    console.print(jobs)
    for title, rows, names in (("port counters", report["port_counters"], R.PORT_COUNTERS),
                               ("job counters", report["job_counters"], R.JOB_COUNTERS)):
        table = Table(title=title)
        table.add_column("counter")
        for key in rows:
            table.add_column(f"{title.split()[0]} {key}", justify="right")
        for name in names:
            table.add_row(name, *(f"{rows[k][name]:,}" for k in rows))
        console.print(table)


def probe_main(url: str, as_json: bool, timeout: float = 3.0) -> int:
    import json
    import sys

    from rich.console import Console

    console = Console()
    try:
        report = probe(url, timeout)
    except (NetaggError, OSError, ValueError) as e:
        if as_json:
            print(json.dumps({"url": url, "answers": False, "error": str(e)}))
        else:       # one line, unwrapped: it names the switch and what it did
            print(f"netagg probe: {e}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(report))
    else:
        print_probe(report, console)
    return 0
