"""The ICRC of the datagrams a UDP socket receives (`netagg.contract.wire`'s format): `IcrcCheck`
makes their canonical IPv4 and UDP headers from their sender and the socket, caches the CRC state
per (sender, length, BTH start), and checks one datagram or a whole run of them at once."""

from __future__ import annotations

import numpy as np
from zlib_ng.zlib_ng import crc32  # zlib's CRC-32, the ICRC's, with carry-less multiply

from netagg.contract.wire import ICRC_LEN, ICRC_STRUCT, Endpoint, icrc_state, ip_udp_header


class IcrcCheck:
    """Checks the ICRC of the datagrams a UDP socket receives, for the canonical IPv4 and UDP
    headers from their sender to the socket: the CRC state of each (sender, length, BTH
    start) is cached, so a datagram costs one CRC-32 over its BTH onwards."""

    def __init__(self, local: Endpoint):
        self.local = local
        self._states: dict[tuple, int] = {}
        self._covered: dict[tuple[int, int], list[slice]] = {}

    def state_of(self, sender: tuple[str, int], end: int, head: bytes) -> int:
        """The CRC state after the canonical IPv4 and UDP headers of a datagram from
        `sender` whose ICRC starts at `end`, and its first 8 bytes `head` (cached)."""
        key = (sender, end, head)
        state = self._states.get(key)
        if state is None:
            if len(self._states) > 4096:
                self._states.clear()
            ip_udp = ip_udp_header(sender[0], self.local.ip, sender[1], self.local.port,
                                   end + ICRC_LEN)
            state = self._states[key] = icrc_state(ip_udp + head)
        return state

    def holds(self, body: bytes, sender: tuple[str, int]) -> bool:
        end = len(body) - ICRC_LEN
        if end < 8:
            return False
        return crc32(memoryview(body)[8:end], self.state_of(sender, end, bytes(body[:8]))) == \
            ICRC_STRUCT.unpack_from(body, end)[0]

    def run(self, data: bytes, size: int, sender: tuple[str, int]) -> tuple[list, int]:
        """The datagrams of a run of `size`-byte datagrams from one sender (as UDP_GRO merges
        them) whose ICRC holds, and how many did not. Whole datagrams sharing their first 8
        bytes (a switch's results to a worker) share a CRC state; others go one at a time."""
        view = memoryview(data)
        datagrams = [view[at:at + size] for at in range(0, len(data), size)]
        full = len(data) // size
        words = np.frombuffer(data, "<u4").reshape(full, size // 4) \
            if size % 4 == 0 and full * size == len(data) and size >= 8 + ICRC_LEN else None
        if words is None or (words[:, :2] != words[0, :2]).any():
            good = [d for d in datagrams if self.holds(d, sender)]
            return good, len(datagrams) - len(good)
        state = self.state_of(sender, size - ICRC_LEN, bytes(view[:8]))
        covered = self._covered.get((size, full))
        if covered is None:             # what each one's ICRC covers after its first 8 bytes
            covered = self._covered[size, full] = [slice(at + 8, at + size - ICRC_LEN)
                                                   for at in range(0, full * size, size)]
        crcs = np.fromiter(map(crc32, map(view.__getitem__, covered), [state] * full),
                           np.uint32, full)
        good = [d for d, ok in zip(datagrams, (crcs == words[:, -1]).tolist()) if ok]
        return good, full - len(good)
