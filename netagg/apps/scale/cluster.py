"""What `netagg scale` is asked about: a model, a cluster, and netagg's switch as calibrated.

Plain data, no computation beyond unit conversions. A `Model` is a gradient size and a
compute time per iteration on one worker; a `Cluster` the workers, their grouping into
nodes, the topology and its links; a `SwitchCalibration` the RTL switch's measured figures
(`netagg bench switch`, docs/benchmarks.md) and the clock they are scaled by.

Assumptions, each a field with its default and overridable from the command line:
- every packet carries `PAYLOAD` gradient bytes in a RoCEv2 WRITE; `WIRE_BYTES` is what it
  takes on an Ethernet link (preamble, headers, ICRC, FCS, gap): 91 % of the line rate is
  gradient, whatever the scheme;
- the named models' compute times are one V100-class GPU's forward and backward pass at a
  common batch size (ResNet-50 and VGG-19 at 64 images, BERT-large at 32 sequences of 128,
  GPT-2 1.5B at 8 of 1024): rough figures to be replaced by one's own (`--compute-ms`);
- the RTL is clocked at `clock_mhz` (250 MHz by default: an assumption, the simulation
  measures cycles, not time), its aggregator as wide as its ports together (as measured:
  4 x 512 bits into 2048), so a port takes one 64-byte beat a cycle whatever the port count.
"""

from __future__ import annotations

import dataclasses
import enum
import math

PAYLOAD = 1024          # gradient bytes per packet (netagg's payload)
# Preamble and SFD 8, Ethernet 14, IPv4 20, UDP 8, BTH 12, RETH 16, ICRC 4, FCS 4, gap 12.
WIRE_OVERHEAD = 98
WIRE_BYTES = PAYLOAD + WIRE_OVERHEAD
PREAMBLE_AND_GAP = 20   # not in the frame a switch port takes in


class Topology(enum.Enum):
    FAT_TREE = "fat-tree"
    LEAF_SPINE = "leaf-spine"
    BCUBE = "bcube"


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    params: int
    compute_s: float                # forward and backward of one iteration on one worker
    bytes_per_param: int = 4        # float32 (netagg's int32 fixed point is the same size)

    @property
    def gradient_bytes(self) -> int:
        return self.params * self.bytes_per_param


# Parameter counts: torchvision's resnet50 and vgg19, bert-large-uncased, GPT-2 XL.
MODELS = {
    "resnet50": Model("ResNet-50", 25_557_032, 0.19),
    "vgg19": Model("VGG-19", 143_667_240, 0.30),
    "bert-large": Model("BERT-large", 335_141_888, 0.40),
    "gpt2-1.5b": Model("GPT-2 1.5B", 1_557_611_200, 1.00),
}


@dataclasses.dataclass(frozen=True)
class SwitchCalibration:
    """The RTL switch's per-packet throughput and latency, in cycles, and the clock that turns
    them into time."""

    beats_per_cycle: float = 1.000  # per port, `netagg bench switch` (docs/benchmarks.md)
    latency_cycles: int = 28        # last contribution's last beat -> first result beat
    width_bits: int = 512           # the port width the figures were measured at
    clock_mhz: float = 250.0        # an assumption: see the module docstring
    source: str = "docs/benchmarks.md: netagg bench switch, 4 ports x 512 bits"

    @classmethod
    def from_bench(cls, report: dict, clock_mhz: float = 250.0) -> SwitchCalibration:
        """From `netagg bench switch --json`: the slowest port's beats per cycle."""
        return cls(beats_per_cycle=min(report["beats_per_cycle"]),
                   latency_cycles=int(report["latency_cycles"]), width_bits=report["width"],
                   clock_mhz=clock_mhz, source="netagg bench switch --json (measured now)")

    @property
    def cycle_s(self) -> float:
        return 1e-6 / self.clock_mhz

    @property
    def packet_s(self) -> float:
        """Time a port's pipeline takes for one packet: its frame in whole beats."""
        beats = math.ceil((WIRE_BYTES - PREAMBLE_AND_GAP) * 8 / self.width_bits)
        return beats / self.beats_per_cycle * self.cycle_s

    @property
    def latency_s(self) -> float:
        return self.latency_cycles * self.cycle_s

    @property
    def port_gbps(self) -> float:
        """The line rate (wire bytes) one port keeps up with."""
        return WIRE_BYTES * 8 / self.packet_s / 1e9


@dataclasses.dataclass(frozen=True)
class Cluster:
    workers: int
    link_gbps: float = 100.0
    topology: Topology = Topology.FAT_TREE
    radix: int = 64                 # ports per switch (fat-tree, leaf-spine)
    bcube_n: int = 8                # BCube(n, k): n-port switches, k levels (k NICs a server)
    bcube_k: int = 2
    oversubscription: float = 1.0   # leaf-spine: a leaf's host bandwidth over its uplinks'
    spraying: bool = True           # spread packets over every path (else one hashed path
                                    # per flow, ECMP)
    gpus_per_node: int = 1          # workers sharing one NIC
    intra_gbps: float = 1200.0      # between the GPUs of a node (NVLink-class by default)
    prop_us: float = 0.5            # propagation per link
    forward_us: float = 0.5         # a commodity switch's forwarding latency
    ps_servers: int = 0             # parameter servers (0: a shard on every worker)
    window: int = 128               # in-network aggregation: slots in flight per worker
    overlap: bool = True            # synchronisation overlaps the backward pass
    switch: SwitchCalibration = SwitchCalibration()

    @property
    def nodes(self) -> int:
        return max(1, self.workers // self.gpus_per_node)

    @property
    def packet_s(self) -> float:
        """One packet's serialisation on a link."""
        return WIRE_BYTES * 8 / (self.link_gbps * 1e9)

    @property
    def intra_packet_s(self) -> float:
        return WIRE_BYTES * 8 / (self.intra_gbps * 1e9)

    def hop_s(self, links: int) -> float:
        """One packet's one-way latency over `links` links through `links - 1` switches,
        store and forward."""
        return links * (self.prop_us * 1e-6 + self.packet_s) + (links - 1) * self.forward_us * 1e-6
