"""Argument types of the `netagg` command line: each turns a command-line word into its value
or raises `argparse.ArgumentTypeError`, so that a bad argument ends in argparse's one-line
usage error (exit status 2) naming the option, never in a traceback or a run that cannot
succeed."""

from __future__ import annotations

import argparse
import re
import socket

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(K|KB|M|MB|G|GB)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
               "G": 1 << 30, "GB": 1 << 30}


def positive(text: str) -> int:
    """A whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1, not {value}")
    return value


def positives(text: str) -> list[int]:
    """Comma-separated whole numbers of at least 1 (``4,8``)."""
    return [positive(part) for part in text.split(",")]


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


def sizes(text: str) -> list[int]:
    """Comma-separated sizes (``1M,8M,32M``)."""
    return [size(part) for part in text.split(",")]


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
