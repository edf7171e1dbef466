"""What the aggregator's parts hand each other and the egress ports: the actions a decided
packet takes and the command that the decide stage queues for the payload stages, one per
packet; the largest control payload; the result beats the payload stages give the egress
ports, with the descriptor that addresses a result or a control reply; and the layouts of
the slots' state and sums. Plain declarations, no logic."""

import enum

from amaranth import signed
from amaranth.lib import data

from netagg.contract import headers as C
from netagg.contract import regmap as R

from . import headers as H
from .beat import BeatLayout
from .fabric import NO_FABRIC, Fabric, copy_fields, descriptor_fields, msn_bits

MAX_CONTROL_PAYLOAD = C.MAX_CONTROL_RECORDS * H.CONTROL_RECORD.length     # 512 bytes


class Action(enum.IntEnum):
    DRAIN = 0        # consume the payload, change nothing
    OVERWRITE = 1    # first contribution of a use: the sums become the payload
    ADD = 2          # add the payload to the sums
    REPLAY = 3       # send the sums again
    CONTROL = 4      # apply the records, send the reply
    CLOSE = 5        # send the sums to every worker: a use closed short at its deadline


def result_descriptor(max_workers: int, fabric: Fabric = NO_FABRIC):
    """What an egress port needs to address a result or a control reply (whose addresses
    its port's ingress holds); on a spine, more (`hw.fabric.descriptor_fields`)."""
    return data.StructLayout({
        "control": 1,
        "job": 4, "dests": max_workers, "slot": 12, "version": 1, "count": 6,
        "exponent": signed(8), "overflow": 1, "offset": 32, "length": 11, "psn": 24,
        **descriptor_fields(fabric),
    })


def egress_beat(width: int, ports: int, max_workers: int, fabric: Fabric = NO_FABRIC):
    """A result's payload beat, the ports that send it, and (on the last beat) its
    descriptor."""
    return data.StructLayout({
        "beat": BeatLayout(width), "ports": ports,
        "desc": result_descriptor(max_workers, fabric),
    })


def slot_copy(max_workers: int, fabric: Fabric = NO_FABRIC):
    """A slot copy's state: its contributors (`bitmap`), their number (`count`, 0: no use in
    progress), how many brought data (`data`: not null), the payload length, the use's
    message number (`msn`: its low 16 bits, its 32 on a switch that takes partials,
    `hw.fabric.msn_bits`) and the tick its use began at (`begun`); a leaf's more
    (`hw.fabric.copy_fields`)."""
    return data.StructLayout({"bitmap": max_workers, "count": 6, "data": 6, "length": 11,
                              "msn": msn_bits(fabric), "begun": R.DEADLINE_BITS,
                              **copy_fields(fabric)})


def slot_state(max_workers: int, fabric: Fabric = NO_FABRIC):
    """A slot's state: its two copies, one per version (the shadow copies of SwitchML)."""
    return data.ArrayLayout(slot_copy(max_workers, fabric), 2)


def sums_row(lanes: int):
    """A row of a slot copy's sums: its int32 lanes, whether a lane saturated since the use
    began, and the use's exponent (the largest of its contributions')."""
    return data.StructLayout({
        "lanes": data.ArrayLayout(signed(32), lanes), "overflow": 1, "exponent": signed(8),
    })


def command(ports: int, slots: int, max_workers: int, fabric: Fabric = NO_FABRIC):
    """What to do with a packet's payload: its `action`; the ingress `port` it comes from;
    whether it has a payload to take (`has_payload`) and whether it is a null contribution's,
    made of zeros (`null`); the slot (`index`); and whether beats go out (`emit`), from which
    `ports`, with which descriptor (`desc`)."""
    return data.StructLayout({
        "action": Action, "port": range(max(ports, 2)), "has_payload": 1, "emit": 1, "null": 1,
        "index": range(slots), "ports": ports, "desc": result_descriptor(max_workers, fabric),
    })
