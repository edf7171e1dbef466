"""A CPU stand-in for an accelerator, for `host.torch_staging`'s tests: the same pipeline
moves real CPU tensors, each stream a thread that runs its operations in order, each event
a flag set when its stream reaches it, and every operation asked of the device recorded in
order (`log`), with when each queued operation ran.

Like a GPU, a stream does not wait for the host: `launch` returns at once and the copy runs
later on the stream's thread; `wait` makes a stream (not the host) wait for an event;
`synchronize` blocks the host on one event. Work the test queues on `producer` (the
caller's current stream) before an allreduce, written late on purpose, shows whether the
pipeline waited for it: the sums would be wrong if it had not.
"""

from __future__ import annotations

import itertools
import queue
import threading

import torch

WAIT = 30.0         # seconds a stream or the host waits for an event before the test fails


class Event:
    def __init__(self, n: int):
        self.n = n
        self.flag = threading.Event()


class Stream:
    """Operations run in order on a thread of the stream's own; an error is kept and
    raised by the host's next `synchronize`."""

    def __init__(self, name: str):
        self.name = name
        self.errors: list[BaseException] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, name=f"stand-in {name}", daemon=True).start()

    def put(self, operation):
        self._queue.put(operation)

    def _run(self):
        while (operation := self._queue.get()) is not None:
            try:
                operation()
            except BaseException as e:      # raised at the host's next synchronize
                self.errors.append(e)

    def close(self):
        self._queue.put(None)


class StandIn:
    """The `host.torch_staging.Device` of CPU tensors, threads for streams, recording."""

    name = "stand-in"

    def __init__(self):
        self.log: list[tuple] = []
        self._lock = threading.Lock()
        self._events = itertools.count()
        self.streams: list[Stream] = []
        self.producer = self.new_stream("producer")

    def note(self, *entry):
        with self._lock:
            self.log.append(entry)

    def current_stream(self):
        return self.producer

    def new_stream(self, name: str | None = None):
        stream = Stream(name or f"side{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def new_event(self):
        return Event(next(self._events))

    def record(self, event, stream):
        self.note("record", event.n, stream.name)
        stream.put(event.flag.set)

    def wait(self, stream, event):
        self.note("wait", stream.name, event.n)

        def blocked():
            if not event.flag.wait(WAIT):
                raise TimeoutError(f"stream {stream.name} waited for event {event.n}")
        stream.put(blocked)

    def synchronize(self, event):
        self.note("synchronize", event.n)
        if not event.flag.wait(WAIT):
            raise TimeoutError(f"the host waited for event {event.n}")
        for s in self.streams:
            if s.errors:
                raise s.errors[0]

    def launch(self, stream, what, operation):
        self.note("launch", what, stream.name)

        def run():
            operation()
            self.note("ran", what)
        stream.put(run)

    def host_buffer(self, nbytes):
        self.note("host_buffer", nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8)

    def keep(self, tensor, stream):
        self.note("keep", stream.name)

    def future(self):
        return torch.futures.Future()

    def complete(self, future, value, stream):
        self.note("complete", stream.name)
        future.set_result(value)

    def close(self):
        for s in self.streams:
            s.close()
