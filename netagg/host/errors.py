"""The errors an allreduce ends in: `NetaggError` when it cannot complete, `NetaggTimeout`
when the switch or a peer stops answering within the bounded wait, `NetaggRankGone` when a
rank of the job is gone (its heartbeat in the switch stopped, `host.liveness`),
`NetaggSwitchGone` when the switch stopped answering this worker (`host.liveness`), and
`NetaggUnreachable` when this host cannot send to the switch at all (`host.transport`)."""


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


class NetaggJobTakenOver(NetaggError):
    """Switch job `job` was configured again by another run (epoch `epoch`, enabled by the
    address `owner`, 0 where the job is disabled) while this run used it."""

    def __init__(self, message: str, job: int, epoch: int, owner: int):
        super().__init__(message)
        self.job, self.epoch, self.owner = job, epoch, owner

    def __reduce__(self):
        return type(self), (str(self), self.job, self.epoch, self.owner)


class NetaggSwitchGone(NetaggTimeout):
    """The switch at `switch` ("ip:port") answered nothing for `silent` seconds while rank
    `rank` of switch job `job` kept asking: it (or the path to it) is down."""

    def __init__(self, message: str, switch: str, job: int, rank: int, silent: float):
        super().__init__(message)
        self.switch, self.job, self.rank, self.silent = switch, job, rank, silent

    def __reduce__(self):
        return type(self), (str(self), self.switch, self.job, self.rank, self.silent)


class NetaggUnreachable(NetaggError):
    """This host cannot send to the switch at `switch` ("ip:port"): the OS refused the send
    with `errno` (`reason`: its words and what it suggests). `who` names the worker ("rank 1
    of job 0"), once known (`named`)."""

    def __init__(self, switch: str, reason: str, errno: int | None = None, who: str = ""):
        super().__init__(f"{who} cannot reach the switch at {switch}: {reason}" if who else
                         f"cannot reach the switch at {switch}: {reason}")
        self.switch, self.reason, self.errno, self.who = switch, reason, errno, who

    def named(self, who: str) -> "NetaggUnreachable":
        """The same error, naming the worker `who` (unless it names one already)."""
        if self.who:
            return self
        named = type(self)(self.switch, self.reason, self.errno, who)
        named.__cause__ = self.__cause__
        return named

    def __reduce__(self):
        return type(self), (self.switch, self.reason, self.errno, self.who)
