"""The errors an allreduce ends in: `NetaggError` when it cannot complete, `NetaggTimeout`
when the switch or a peer stops answering within the bounded wait."""


class NetaggError(RuntimeError):
    """The allreduce cannot complete."""


class NetaggTimeout(NetaggError, TimeoutError):
    """The switch or a peer stopped answering."""
