"""The errors an allreduce ends in: `NetaggError` when it cannot complete, `NetaggTimeout`
when the switch or a peer stops answering within the bounded wait, `NetaggRankGone` when a
rank of the job is gone (its heartbeat in the switch stopped, `host.liveness`)."""


class NetaggError(RuntimeError):
    """The allreduce cannot complete."""


class NetaggTimeout(NetaggError, TimeoutError):
    """The switch or a peer stopped answering."""


class NetaggRankGone(NetaggError):
    """Ranks `ranks` of switch job `job` are gone: their heartbeats stopped while the
    others' went on, so what waits on them cannot complete."""

    def __init__(self, message: str, job: int, ranks: tuple[int, ...]):
        super().__init__(message)
        self.job, self.ranks = job, tuple(ranks)

    def __reduce__(self):
        return type(self), (str(self), self.job, self.ranks)
