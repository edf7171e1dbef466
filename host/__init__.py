"""netagg's host side: the wire format, number formats, the protocol engine, transports, the
worker API (`Worker`) and the `netagg` command line."""

from host.control import SwitchControl
from host.engine import NetaggError, NetaggTimeout
from host.worker import Handle, Worker

__all__ = ["Worker", "Handle", "SwitchControl", "NetaggError", "NetaggTimeout"]
