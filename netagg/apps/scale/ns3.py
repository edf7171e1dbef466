"""The packet-level engine: one gradient synchronisation on ns-3 (ns3_sync.cc), for the sizes
it can run here, beside the flow-level model.

What it simulates (ns3_sync.cc): N workers (and P dedicated parameter servers) each on a
point-to-point link to one switch node; every packet WIRE_BYTES on the wire; hosts pace their
sends at line rate; the switch forwards by IPv4 with zero forwarding latency and deep
(lossless) queues, and for in-network aggregation adds the RTL's pipeline time and latency.
Schemes: ring, parameter server, in-network aggregation on one switch; the others (tree, BML
on BCube, leaf-spine, hierarchical) are the flow-level model's only.

Cost: `from ns import ns` takes 15 to 40 s once a process, compiling the C++ 2 s; then about
a microsecond of wall time per packet-hop event: 16 workers, 4 MB, ring: 123 k packets, ~3 s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

from netagg.apps.scale.cluster import PAYLOAD, WIRE_BYTES, Cluster
from netagg.apps.scale.flow import Scheme

ENGINE_SCHEMES = {Scheme.RING: 0, Scheme.PS: 1, Scheme.INA: 2}
MAX_WORKERS = 64                    # beyond this, minutes per point on 2 cores
MAX_PACKETS = 4_000_000             # about 10 s of wall time

_compiled = None


def available() -> bool:
    try:
        import cppyy  # noqa: F401
        _load_ns3()
    except ImportError:
        return False
    return True


# ns3 3.44's loader (ns3/ns/__init__.py) drops every library whose *path* contains "test",
# meaning ns-3's own test libraries; installed under such a path (nox's venv .nox/tests) it
# finds none and fails with "cppyy.gbl has no attribute 'ns3'". The same filter on the file
# name only is what it means.
_TEST_FILTER = 'filter(lambda x: "test" not in x, libraries)'
_NAME_FILTER = 'filter(lambda x: "test" not in os.path.basename(x), libraries)'


def _load_ns3():
    """ns-3's bindings (`ns3.ns`, which `from ns import ns` gives), loaded once."""
    import importlib.util
    import sys
    if "ns3.ns" in sys.modules:
        return sys.modules["ns3.ns"]
    spec = importlib.util.find_spec("ns3.ns")
    if spec is None:
        raise ImportError("ns-3 is not installed: pip install -e .[scale]")
    with open(spec.origin) as f:
        source = f.read()
    if "test" not in os.path.dirname(spec.origin) or _TEST_FILTER not in source:
        import ns3.ns
        return ns3.ns
    module = importlib.util.module_from_spec(spec)
    sys.modules["ns3.ns"] = module
    exec(compile(source.replace(_TEST_FILTER, _NAME_FILTER), spec.origin, "exec"),
         module.__dict__)
    return module


@contextlib.contextmanager
def _quiet_stderr():
    """cling prints harmless 'Failed to materialize symbols' lines on import: hide them."""
    fd = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)


def _engine():
    global _compiled
    if _compiled is None:
        with _quiet_stderr():
            import cppyy
            _load_ns3()         # ns-3's headers and libraries

            source = os.path.join(os.path.dirname(__file__), "ns3_sync.cc")
            with open(source) as f:
                cppyy.cppdef(f.read())
        _compiled = cppyy.gbl.netagg_ns3
    return _compiled


@dataclasses.dataclass(frozen=True)
class PacketLevel:
    scheme: Scheme
    workers: int
    mean_s: float                   # workers' mean finish time
    max_s: float                    # the last worker's
    packets: int
    peak_queue: int                 # the deepest switch output queue, packets


def simulate(scheme: Scheme, cluster: Cluster, gradient_bytes: float) -> PacketLevel:
    """One synchronisation of `gradient_bytes` per worker on one switch."""
    if scheme not in ENGINE_SCHEMES:
        raise ValueError(f"ns-3 runs {', '.join(s.value for s in ENGINE_SCHEMES)}, "
                         f"not {scheme.value}")
    if cluster.workers > MAX_WORKERS:
        raise ValueError(f"ns-3 runs up to {MAX_WORKERS} workers here")
    engine = _engine()
    cfg = engine.Config()
    cfg.scheme = ENGINE_SCHEMES[scheme]
    cfg.workers = cluster.workers
    cfg.servers = cluster.ps_servers if scheme is Scheme.PS else 0
    cfg.bytes = float(gradient_bytes)
    cfg.gbps = cluster.link_gbps
    cfg.delay_us = cluster.prop_us
    cfg.payload = PAYLOAD
    cfg.wire = WIRE_BYTES
    cfg.window = cluster.window
    cfg.switch_latency_ns = cluster.switch.latency_s * 1e9
    cfg.switch_port_gbps = cluster.switch.port_gbps
    r = engine.run(cfg)
    return PacketLevel(scheme, cluster.workers, r.mean_s, r.max_s, int(r.packets),
                       int(r.peak_queue))


def comparable(cluster: Cluster) -> Cluster:
    """The cluster as ns-3 simulates it: one switch, forwarding in zero time, one worker a
    node (the flow model on this cluster is what the packet level is checked against)."""
    return dataclasses.replace(cluster, forward_us=0.0, gpus_per_node=1,
                               radix=max(cluster.radix, cluster.workers + cluster.ps_servers))
