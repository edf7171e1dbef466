"""Real aggregation traffic for the Verilator model's benchmarks (`sim.model.bench`,
`netagg bench`): a control request that configures a job with one worker per port, then a
contribution from every worker for each slot; replayed, it aggregates afresh each time."""

from __future__ import annotations

from netagg.contract import regmap as R

from .model import BENCH_KEY


def switch_traffic(ports: int = 4, slots: int = 16, lanes: int = 256) -> list[tuple[int, bytes]]:
    """Real aggregation traffic for `bench`: a control request that configures job 0 with
    one worker per port (and clears its slots), then one contribution of `lanes` int32 lanes
    from every worker for each of `slots` slots. Replayed, it aggregates afresh each time."""
    import numpy as np

    from netagg.contract import wire as W

    host = W.Endpoint("10.0.9.9", 0xD000, 0x02BB00000009)
    switch = W.Endpoint("10.0.0.1", W.ROCEV2_PORT, 0x02AA00000001)
    workers = [W.Endpoint(f"10.1.0.{10 + r}", 0xC100 + r, 0x020000000100 | r)
               for r in range(ports)]
    records = [(R.WRITE | R.job_reg(0, R.JOB_CONFIG), 0),      # its range is fixed while enabled
               (R.WRITE | R.job_reg(0, R.JOB_SLOT_BASE), 0),
               (R.WRITE | R.job_reg(0, R.JOB_SLOT_COUNT), slots)]
    for r, w in enumerate(workers):
        records += [
            (R.WRITE | R.worker_reg(0, r, R.WORKER_PORT),
             R.WORKER_ENDPOINT.pack(switch_port=r, udp_port=w.port)),
            (R.WRITE | R.worker_reg(0, r, R.WORKER_MAC_LO), w.mac & 0xFFFFFFFF),
            (R.WRITE | R.worker_reg(0, r, R.WORKER_MAC_HI), w.mac >> 32),
            (R.WRITE | R.worker_reg(0, r, R.WORKER_IP), W.ip_to_int(w.ip)),
        ]
    records.append((R.WRITE | R.job_reg(0, R.JOB_CONFIG), R.CONFIG.pack(enable=1, workers=ports)))
    records.append((R.WRITE | R.job_reg(0, R.JOB_KEY), BENCH_KEY))
    traffic = [(0, W.control_request(records, 0, host, switch).frame())]
    payload = np.arange(lanes, dtype="<i4").tobytes()
    for s in range(slots):
        for r, w in enumerate(workers):
            # the slot's use 0 after CONFIG: msn = use * slots + slot
            packet = W.contribution(job=0, rank=r, slot=s, version=0, offset=len(payload) * s,
                                    lanes=payload, psn=s, msn=s, key=BENCH_KEY, src=w,
                                    dst=switch)
            traffic.append((r, packet.frame()))
    return traffic
