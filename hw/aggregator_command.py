"""What the aggregator hands the egress ports, and what its stages hand each other: the
actions a decided packet takes, the largest control payload, and the layouts of a result's
descriptor and of an egress beat. Plain declarations, no logic."""

import enum

from amaranth import signed
from amaranth.lib import data

from . import headers as H
from .beat import BeatLayout

MAX_CONTROL_PAYLOAD = H.MAX_CONTROL_RECORDS * H.CONTROL_RECORD.length     # 512 bytes


class Action(enum.IntEnum):
    DRAIN = 0        # consume the payload, change nothing
    OVERWRITE = 1    # first contribution of a use: the sums become the payload
    ADD = 2          # add the payload to the sums
    REPLAY = 3       # send the sums again
    CONTROL = 4      # apply the records, send the reply


def result_descriptor(max_workers: int):
    """What an egress port needs to address a result or a control reply (whose addresses
    its port's ingress holds)."""
    return data.StructLayout({
        "control": 1,
        "job": 4, "dests": max_workers, "slot": 12, "version": 1, "count": 6,
        "exponent": signed(8), "overflow": 1, "offset": 64, "length": 11, "psn": 24,
    })


def egress_beat(width: int, ports: int, max_workers: int):
    """A result's payload beat, the ports that send it, and (on the last beat) its
    descriptor."""
    return data.StructLayout({
        "beat": BeatLayout(width), "ports": ports, "desc": result_descriptor(max_workers),
    })


def slot_copy(max_workers: int):
    """A slot copy's state: its contributors, their number (0: no use in progress), how many
    brought data (not null), the payload length and the low bits of the use's message
    number."""
    return data.StructLayout({"bitmap": max_workers, "count": 6, "data": 6, "length": 11,
                              "msn": 16})


def sums_row(lanes: int):
    """A row of a slot copy's sums: its int32 lanes, whether one saturated, the largest
    exponent field."""
    return data.StructLayout({
        "lanes": data.ArrayLayout(signed(32), lanes), "overflow": 1, "exponent": signed(8),
    })


def command(ports: int, slots: int, max_workers: int):
    """What decide hands the payload stage for each packet: its action, ingress port,
    whether it has a payload, emits a result or is null, its slot copy, the ports that send
    the result and the result's descriptor."""
    return data.StructLayout({
        "action": Action, "port": range(max(ports, 2)), "has_payload": 1, "emit": 1,
        "null": 1, "index": range(slots), "ports": ports,
        "desc": result_descriptor(max_workers),
    })
