"""A control request to a simulated board from a UDP socket, run inside the board's network
namespace by tests/test_board.py (``ip netns exec NS python -m tests.board_client ...``).

The request is built with scapy (an independent oracle of the format): a UC SEND Only to the
switch's control QP whose payload is records (address u32, value u32, big-endian), its ICRC
computed over the IPv4 and UDP headers Linux sends from an unconnected socket with
IP_MTU_DISCOVER = IP_PMTUDISC_DO (identification 0, DF, TTL 64). The socket is bound to
``--src`` and sends with ``sendto``. Prints one JSON object on stdout: the reply's records
as [address, value] pairs and its BTH fields, or {"reply": null} when none came within
``--timeout`` seconds.
"""

import argparse
import json
import socket
import struct

from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP
from scapy.packet import Raw, raw

from netagg.contract.headers import CONTROL_QPN, OP_CONTROL, ROCEV2_PORT
from netagg.host.udp_socket import IP_MTU_DISCOVER, IP_PMTUDISC_DO

BTH_BYTES, ICRC_BYTES = 12, 4


def request(src: str, dst: str, sport: int, psn: int, addresses: list[int],
            corrupt_icrc: bool = False) -> bytes:
    """The UDP payload (BTH, records, ICRC) of a control request reading `addresses`."""
    records = b"".join(struct.pack(">II", address, 0) for address in addresses)
    packet = (IP(src=src, dst=dst, id=0, flags="DF", ttl=64)
              / UDP(sport=sport, dport=ROCEV2_PORT, chksum=0)
              / BTH(opcode=OP_CONTROL, dqpn=CONTROL_QPN, psn=psn) / Raw(records))
    datagram = raw(packet)[20 + 8:]
    if corrupt_icrc:
        datagram = datagram[:-1] + bytes([datagram[-1] ^ 0x01])
    return datagram


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", required=True, help="the host address to bind to")
    parser.add_argument("--dst", required=True, help="the board's address")
    parser.add_argument("--read", type=lambda text: int(text, 0), action="append",
                        required=True, help="a register address to read (repeat)")
    parser.add_argument("--psn", type=int, default=1)
    parser.add_argument("--corrupt-icrc", action="store_true")
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args()

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        sock.bind((args.src, 0))
        sport = sock.getsockname()[1]
        sock.settimeout(args.timeout)
        sock.sendto(request(args.src, args.dst, sport, args.psn, args.read, args.corrupt_icrc),
                    (args.dst, ROCEV2_PORT))
        try:
            reply, sender = sock.recvfrom(4096)
        except TimeoutError:
            print(json.dumps({"reply": None}))
            return
    opcode, _flags, _pkey, dqpn, psn = struct.unpack_from("!BBHII", reply)
    body = reply[BTH_BYTES:len(reply) - ICRC_BYTES]
    records = [list(struct.unpack_from(">II", body, k)) for k in range(0, len(body), 8)]
    print(json.dumps({"reply": {"from": list(sender), "opcode": opcode,
                                "dqpn": dqpn & 0xFFFFFF, "psn": psn & 0xFFFFFF,
                                "records": records}}))


if __name__ == "__main__":
    main()
