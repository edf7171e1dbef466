"""netagg's host side: number formats, the protocol engine, transports, the worker API
(`Worker`), switch control, and the "netagg" torch.distributed backend with its DDP hook."""

from netagg.host.control import SwitchControl
from netagg.host.engine import NetaggError, NetaggTimeout
from netagg.host.worker import Handle, Worker

__all__ = ["Worker", "Handle", "SwitchControl", "NetaggError", "NetaggTimeout"]
