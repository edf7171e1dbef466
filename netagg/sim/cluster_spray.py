"""Spraying netagg's packets over a fabric's spines with the kernel's traffic control: each
contribution and result goes by the spine its slot picks, whatever spine the route's hash
picked.

A packet's slot's low six bits are its bucket (`BUCKETS`, dealt over the live spines in
turn). On each of a namespace's spine links (devices sS), a u32 filter per bucket that
belongs elsewhere matches the packet at the link's egress (clsact) and redirects it (mirred)
to its own link. The keys are offsets from the IPv4 header: the protocol byte (UDP), the BTH
opcode, for contributions the UDP destination port (RoCEv2's), and the ImmDt's slot bits,
whose place in a contribution's and a result's ImmDt comes from `netagg.contract.wire`'s layouts
(`SLOT_SHIFT`). A redirected frame keeps the Ethernet header the route gave it: every spine's
end of a leaf's (or the switch's) links must have one MAC (`sim.cluster_fabric` gives them
one), so the spine it reaches takes it as its own. Other traffic passes untouched.
"""

from __future__ import annotations

import dataclasses

from netagg.contract import wire as W

BUCKETS = 64                    # a packet goes by its slot's low 6 bits
IMM_OFFSET = W.IP_LEN + W.UDP_LEN + W.BTH_LEN + W.RETH_LEN     # the ImmDt, from IPv4's start
SLOT_SHIFT = {layout: shift for layout, fields in (("request", W.REQUEST_IMM),
                                                    ("result", W.RESULT_IMM))
              for name, shift, _ in fields if name == "slot"}
ETH_P_IP = 0x0800
CLSACT_EGRESS = 0xFFFFFFF3
_UDP = "0x00110000/0x00ff0000+8"     # u32 keys, 0xVALUE/0xMASK+OFFSET: the protocol byte
_OPCODE = W.IP_LEN + W.UDP_LEN       # the BTH's first byte


@dataclasses.dataclass(frozen=True)
class Packets:
    """Which packets are sprayed: u32 `keys` beside the protocol's, and where their slot
    lies in the ImmDt (`slot_shift`)."""

    keys: tuple[str, ...]
    slot_shift: int


CONTRIBUTIONS = Packets((f"0x{W.OP_CONTRIBUTION:02x}000000/0xff000000+{_OPCODE}",
                         f"0x{W.ROCEV2_PORT:08x}/0x0000ffff+{W.IP_LEN}"),
                        SLOT_SHIFT["request"])
RESULTS = Packets((f"0x{W.OP_RESULT:02x}000000/0xff000000+{_OPCODE}",), SLOT_SHIFT["result"])


def steer(namespace: str, live: list[int], spines: int, packets: Packets):
    """On each of `namespace`'s `spines` spine links, send `packets` by the spine their
    slot's bucket picks among `live` (none: no filters, the route's hash alone)."""
    from pyroute2 import NetNS
    mask = (BUCKETS - 1) << packets.slot_shift
    with NetNS(namespace) as ns:
        links = [ns.link_lookup(ifname=f"s{s}")[0] for s in range(spines)]
        for spine, index in enumerate(links):
            if any(q.get_attr("TCA_KIND") == "clsact" for q in ns.get_qdiscs(index=index)):
                ns.tc("del", "clsact", index=index)
            if spine not in live:
                continue
            ns.tc("add", "clsact", index=index)
            for bucket in range(BUCKETS):
                target = live[bucket % len(live)]
                if target == spine:
                    continue
                slot = f"0x{bucket << packets.slot_shift:08x}/0x{mask:08x}+{IMM_OFFSET}"
                ns.tc("add-filter", "u32", index=index, parent=CLSACT_EGRESS,
                      prio=10 + bucket, protocol=ETH_P_IP, target=0x10001,
                      keys=[_UDP, *packets.keys, slot],
                      action={"kind": "mirred", "direction": "egress", "action": "redirect",
                              "ifindex": links[target]})
