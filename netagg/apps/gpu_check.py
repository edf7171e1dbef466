"""`netagg gpu-check`: the "netagg" backend's CUDA path, checked on one GPU in one command.

    netagg gpu-check [--values 4M] [--layouts hierarchical,flat] [--timeout 420] [--json]

starts `netagg sim serve` (the golden model) on this machine's CPU and, per layout, a
torchrun job of 2 processes that share cuda:0 (`hierarchical`: one agent of 2 processes,
which add their tensors on the node first; `flat`: two agents of 1), each process running
`apps.gpu_check_job` (what it checks is said there). gloo's connections stay on loopback.
The report, one JSON object with `--json`, has each layout's ranks' figures and

- `all_reduce`: every dtype and op the switch takes, CUDA bit for bit against the CPU path,
  and each sent through the switch;
- `ordering`: a late producer's stream and a consumer after the future see the right sums;
- `fallbacks`: float64, int64 and MAX on CUDA right through gloo, nothing sent to the
  switch; float64 AVG refused with an error naming float64, send of a CUDA tensor refused
  naming its device;
- `ddp`: a small model on CUDA through netagg (DDP's allreduce, and the hook) within
  `DDP_TOLERANCE` of gloo's weights and losses, and every rank's weights the same bits;
- `staging`: all_reduce of `--values` float32 values on CUDA and on the CPU, the copies'
  GB/s each way, their time alone over the allreduce's, and the seconds the staging waited
  on copies the sums did not hide (figures, not verdicts);
- `collectives`: what gloo did with CUDA tensors in each other collective.

`verified` is true when every check of every layout holds. Exit status 0 verified, 1 not
(or a job failed or ran out of time: its error is in the report), 2 when it cannot run here
(no CUDA device: it says so and starts nothing). The layouts share `--timeout` seconds
(default 420: the command ends within 8 minutes); a job still running at its share's end is
killed, and what its ranks wrote by then is reported.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

LAYOUTS = {"hierarchical": (1, 2), "flat": (2, 1)}       # (torchrun agents, processes each)
DDP_TOLERANCE = 1e-4        # weights and losses against gloo's, after 3 SGD steps
SECTIONS = ("all_reduce", "ordering", "fallbacks", "ddp", "staging", "collectives")


def cuda_missing() -> str | None:
    """Why this machine cannot run the check, None when it can."""
    try:
        import torch
    except ImportError:
        return "no torch: pip install torch (its CUDA build)"
    if not torch.cuda.is_available():
        return (f"no CUDA device: torch {torch.__version__} sees none "
                f"(its CUDA build: {torch.version.cuda or 'none, a CPU build'})")
    return None


def verdicts(ranks: list[dict]) -> dict:
    """Per check, whether every rank of one layout passed it."""
    def every(section, test):
        try:
            return all(test(r[section]) for r in ranks)
        except (KeyError, TypeError):           # a section missing or failed
            return False
    ddp_ok = every("ddp", lambda d: max(d["plain_vs_gloo"], d["hook_vs_gloo"],
                                        d["loss_plain_vs_gloo"],
                                        d["loss_hook_vs_gloo"]) < DDP_TOLERANCE)
    return {
        "all_reduce": every("all_reduce", lambda a: all(
            c["bit_for_bit"] and (c["packets"] is None or c["packets"] > 0)
            for c in a.values())),
        "ordering": every("ordering", lambda o: o["late_producer"] is True
                          and o["consumer_after_future"] is True
                          and o["future_value_is_tensor"] is True),
        "fallbacks": every("fallbacks", lambda f: all(
            f[k] == {"right": True, "packets": 0}
            for k in ("float64_SUM", "int64_SUM", "float32_MAX"))
            and "float64" in f["float64_AVG_refused"] and "AVG" in f["float64_AVG_refused"]
            and "send of tensors on cuda" in f["send_refused"]),
        "ddp": ddp_ok and len({(r["ddp"]["digest_plain"], r["ddp"]["digest_hook"])
                               for r in ranks}) == 1,
        "staging": every("staging", lambda s: s["cuda_allreduce_s"] > 0),
        "shut_down": every("shut_down", bool),
    }


def gpu_check(values: int = 4 << 20, layouts=("hierarchical", "flat"), timeout: float = 420.0,
              quiet: bool = False) -> dict:
    from rich.console import Console

    from netagg.apps import torch_runs
    from netagg.sim.bench import start_server

    report = {"command": "gpu-check", "values": values, "layouts": {}, "verified": False}
    missing = cuda_missing()
    if missing:
        report["error"] = missing
        return report
    console = Console(stderr=True, quiet=quiet)
    deadline = time.monotonic() + timeout
    with console.status("starting the golden switch"):
        server, url = start_server("golden")
    try:
        for i, layout in enumerate(layouts):
            nodes, per_node = LAYOUTS[layout]
            share = (deadline - time.monotonic()) / (len(layouts) - i)
            with tempfile.TemporaryDirectory(prefix=f"netagg-gpu-{layout}-") as tmp_name:
                tmp = Path(tmp_name)
                result: dict = {"nodes": nodes, "per_node": per_node}
                began = time.monotonic()
                with console.status(f"{layout}: 2 processes on cuda:0 under torchrun"):
                    try:
                        torch_runs.torchrun(
                            ["-m", "netagg.apps.gpu_check_job", str(tmp), "--values",
                             str(values)], url=url, nodes=nodes, per_node=per_node,
                            logs=tmp, what=f"netagg gpu-check, {layout}", timeout=share)
                    except RuntimeError as e:
                        result["error"] = str(e)
                result["seconds"] = time.monotonic() - began
                ranks = [json.loads(p.read_text()) if p.exists() else {}
                         for p in (tmp / f"rank{r}.json" for r in range(nodes * per_node))]
                result["ranks"] = ranks
                result["checks"] = verdicts(ranks)
                result["verified"] = "error" not in result and all(result["checks"].values())
                report["layouts"][layout] = result
    finally:
        server.terminate()
        server.wait(10)
        server.stdout.close()
    report["verified"] = bool(report["layouts"]) and all(
        r["verified"] for r in report["layouts"].values())
    return report


def summary(report: dict) -> str:
    if "error" in report:
        return f"netagg gpu-check: cannot run here: {report['error']}"
    lines = []
    for layout, r in report["layouts"].items():
        failed = [k for k, ok in r["checks"].items() if not ok]
        lines.append(f"{layout}: {'verified' if r['verified'] else 'FAILED'} in "
                     f"{r['seconds']:.0f} s" + (f" (failed: {', '.join(failed)})" if failed
                                               else "") + (f"; {r['error']}" if "error" in r
                                                           else ""))
        s = r["ranks"][0].get("staging", {}) if r["ranks"] else {}
        if "cuda_allreduce_s" in s:
            lines.append(f"  staging: {s['bytes'] / 1e6:.0f} MB float32, allreduce "
                         f"{s['host_allreduce_s']:.2f} s from host memory, "
                         f"{s['cuda_allreduce_s']:.2f} s from CUDA; copies "
                         f"{s['d2h_GBps']:.1f} GB/s to the host, {s['h2d_GBps']:.1f} GB/s "
                         f"back, {s['copies_over_allreduce']:.1%} of the allreduce's time "
                         f"alone; waited {s['staging_copy_wait_s']:.3f} s on copies")
        c = r["ranks"][0].get("collectives", {}) if r["ranks"] else {}
        if c:
            lines.append("  gloo with CUDA tensors: " + ", ".join(f"{k} {v}"
                                                                 for k, v in c.items()))
    return "\n".join(lines)
