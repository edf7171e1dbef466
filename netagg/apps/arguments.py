"""Argument types of the `netagg` command line: each turns a command-line word into its value
or raises `argparse.ArgumentTypeError`, so that a bad argument ends in argparse's one-line
usage error (exit status 2) naming the option, never in a traceback or a run that cannot
succeed. argparse applies a type to a default given as text too, so a default reads as a
user would write it (``--hosts 4,8``) and arrives parsed.

Nothing here imports the simulation stack (Amaranth, cocotb, scapy, `netagg.hw`,
`netagg.sim`): the names the command line offers that those packages define are repeated
below, and tests/test_cli_arguments.py holds each copy to its source.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import socket
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

# The boards `netagg.bitstreams` targets (its BOARDS), named here so that `--board`'s choices
# do not import Amaranth.
BOARDS = ("colorlight_5a75b", "versa_ecp5_5g")
# The datapath's widths in bits (`netagg.hw.beat.WIDTHS`).
WIDTHS = (64, 128, 256, 512)
# A switch's ports, jobs, workers per job and slots: the most the request's immediate field
# addresses (`netagg.hw.headers` MAX_JOBS, MAX_WORKERS, MAX_SLOTS) and the ports the switch
# is built with, as `sim.golden.GoldenSwitch` and `hw.switch.Switch` check them.
PORTS, JOBS, MAX_WORKERS, SLOTS = (2, 16), (1, 16), (1, 32), (1, 4096)

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(K|KB|M|MB|G|GB)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
               "G": 1 << 30, "GB": 1 << 30}
# tc's words, as `sim.cluster_links` reads them: rates in bits per second, queues in bytes.
_RATE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?bit)?\s*", re.IGNORECASE)
_TC_SIZE = re.compile(r"\s*(\d+)\s*([km]?b)?\s*", re.IGNORECASE)
_TOPOLOGY = re.compile(r"(\d+)x(\d+)", re.IGNORECASE)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_]{0,31}")


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number, not {text!r}") from None


def positive(text: str) -> int:
    """A whole number of at least 1."""
    value = _whole(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1, not {value}")
    return value


def between(low: int, high: int) -> Callable[[str], int]:
    """The type of a whole number from `low` to `high`."""
    def read(text: str) -> int:
        value = _whole(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{low} to {high}, not {value}")
        return value
    read.__name__ = "number"
    return read


def natural(text: str) -> int:
    """A whole number of at least 0."""
    value = _whole(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"at least 0, not {value}")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number, not {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"a finite number, not {text!r}")
    return value


def positive_float(text: str) -> float:
    """A number above 0 (seconds, a ratio, a rate)."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a number above 0, not {text!r}")
    return value


def share(text: str) -> float:
    """A share from 0 to 1 (``0.1``: a tenth)."""
    value = _number(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"a share from 0 to 1, not {text!r}")
    return value


def inner_share(text: str) -> float:
    """A share strictly between 0 and 1 (``0.5``: halfway)."""
    value = _number(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"a share between 0 and 1 (0.5: halfway), "
                                         f"not {text!r}")
    return value


def percent(text: str) -> float:
    """A percentage from 0 up to (not including) 100: its fraction (``5`` is 0.05)."""
    value = _number(text)
    if not 0 <= value < 100:
        raise argparse.ArgumentTypeError(f"a percentage from 0 to below 100, not {text!r}")
    return value / 100


def comma_list(item: Callable[[str], T]) -> Callable[[str], list[T]]:
    """The type of comma-separated words, each read by `item` (``4,8``)."""
    def read(text: str) -> list[T]:
        return [item(part.strip()) for part in text.split(",")]
    read.__name__ = f"{item.__name__}s"
    return read


def one_of(choices: Iterable) -> Callable[[str], object]:
    """The type of one of `choices` (names, or whole numbers written as words)."""
    by_word = {str(c): c for c in choices}

    def read(text: str):
        if text not in by_word:
            raise argparse.ArgumentTypeError(f"one of {', '.join(by_word)}, not {text!r}")
        return by_word[text]
    read.__name__ = "choice"
    return read


positives = comma_list(positive)
positive_floats = comma_list(positive_float)
percents = comma_list(percent)
widths = comma_list(one_of(WIDTHS))


def size(text: str) -> int:
    """Bytes: a number with an optional K, M or G (powers of 1024): ``1M``, ``256K``, ``4096``."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"a size is a number and K, M or G (1M, 256K), "
                                         f"not {text!r}")
    value = int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").upper()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"a size of at least 1 byte, not {text!r}")
    return value


sizes = comma_list(size)


def count(text: str) -> int:
    """A count of at least 1, with an optional K, M or G (powers of 1024): ``4M``, ``200000``."""
    m = _SIZE.fullmatch(text.strip())
    value = int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").upper()]) if m else 0
    if not m or value < 1 or (not m.group(2) and "." in text):
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, with K, M or G if "
                                         f"you like (4M), not {text!r}")
    return value


def rate(text: str) -> str:
    """A link's rate as tc writes it (``100mbit``, ``1gbit``), above 0: the text."""
    m = _RATE.fullmatch(text)
    if not m:
        raise argparse.ArgumentTypeError(f"a rate is a number and a unit (bit, kbit, mbit, "
                                         f"gbit: 100mbit), not {text!r}")
    if float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"a rate above 0, not {text!r}")
    return text


def queue(text: str) -> str:
    """Bytes of a queue as tc writes them (``256kb``, ``1mb``, ``65536``), above 0: the
    text."""
    m = _TC_SIZE.fullmatch(text)
    if not m:
        raise argparse.ArgumentTypeError(f"a queue is a number and a unit (b, kb, mb: 256kb), "
                                         f"not {text!r}")
    if int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"a queue of at least 1 byte, not {text!r}")
    return text


def topology(leaves: int, spines: int) -> Callable[[str], str]:
    """The type of ``LEAVESxSPINES`` (``2x2``): 1 to `leaves` leaves, 1 to `spines` spines;
    the text."""
    def read(text: str) -> str:
        m = _TOPOLOGY.fullmatch(text.strip())
        if not m:
            raise argparse.ArgumentTypeError(f"LEAVESxSPINES (2x2), not {text!r}")
        if not (1 <= int(m.group(1)) <= leaves and 1 <= int(m.group(2)) <= spines):
            raise argparse.ArgumentTypeError(f"LEAVESxSPINES of 1 to {leaves} leaves and 1 to "
                                             f"{spines} spines, not {text!r}")
        return text
    read.__name__ = "topology"
    return read


# The leaves and spines of a simulated fabric (`sim.topology.Topology`: a leaf's uplinks are
# at most the spray field's 4) and of an emulated one (`sim.cluster_fabric.Topology`).
simulated_fabric = topology(15, 4)
emulated_fabric = topology(60, 60)


def ipv4(text: str) -> str:
    """An IPv4 address (``10.0.0.1``)."""
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an IPv4 address, not {text!r}") from None
    return text


ipv4s = comma_list(ipv4)


def name(text: str) -> str:
    """A name of letters, digits and _, up to 32 (a prefix of namespaces)."""
    if not _NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"letters, digits and _ (up to 32, the first not _), "
                                         f"not {text!r}")
    return text


def existing_file(text: str) -> str:
    """A file that exists and can be read."""
    if not os.path.isfile(text) or not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"no readable file {text!r}")
    return text


def switch_url(text: str) -> str:
    """``udp://HOST:PORT`` whose host resolves to an IPv4 address."""
    from netagg.host.transport import parse_udp_url
    try:
        host, port = parse_udp_url(text)
        socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text}: no IPv4 address for {host!r} "
                                         f"({e.strerror or e})") from None
    return text
