"""A pending allreduce (`Handle`) and the hierarchical allreduce's step.

Hierarchical (`Worker(local_size=L)`): at the call each local worker copies its tensors into
the node's shared memory (`host.node.NodeShm`) and arrives; the step, run by the handle's
`wait` (one step of a node at a time, in submission order), waits for the node's workers,
submits this worker's shard of every tensor (whole exponent blocks: shard i of L, or of the
G leaders when the switch has fewer jobs) with every local worker's input as a source,
waits for it, says whether it failed as it arrives (the others then raise naming it rather
than take its result), and copies the node's shared result into `outs`. A step that failed
stays failed: its handle's `wait` raises the error again.
"""

from __future__ import annotations

import numpy as np


class Handle:
    """A pending allreduce; `wait()` returns the result (an array, or a list for a list)."""

    def __init__(self, worker, works, outs, single, finish=None):
        self.worker, self.works, self.outs, self.single = worker, works, outs, single
        self._finish = finish
        self._result = None
        self._done = False
        self.error = None           # the node's step failed (hierarchical)

    def stats(self) -> list[dict]:
        """Per tensor (shard) of this worker: chunks, droppable chunks and droppable packets
        sent, contributions lost from its sums, chunks scaled up and chunks filled in."""
        return [w.stats() for w in self.works]

    def done(self) -> bool:
        if not self._done and self._finish is None:
            self.worker.advance(0.0)
        return all(w.done for w in self.works) and self._finish is None

    def wait(self, timeout: float | None = None):
        if self._done:
            return self._result
        if self._finish is not None:
            self._finish(self)
        if self.error is not None:
            raise self.error
        self.worker.wait_works(self.works, timeout)
        for w in self.works:
            if w.error is not None:
                raise w.error
        self._done = True
        self._result = self.outs[0] if self.single else self.outs
        return self._result


def hierarchical(worker, arrays, fmts, outs, mean, single, loss) -> Handle:
    """Start `worker`'s hierarchical allreduce of `arrays` (formats `fmts`, results into
    `outs`, `loss` per tensor): the handle runs the node's step at `wait`."""
    sizes = [a.nbytes for a in arrays]
    offsets = np.cumsum([0] + [-(-s // 64) * 64 for s in sizes]).tolist()
    total = offsets[-1]
    region = worker.shm.region(total)          # same sizes on every local worker
    for a, off in zip(arrays, offsets):
        view = region.input(worker.local_rank, off, a)
        view[...] = np.ascontiguousarray(a).reshape(-1)
    worker.shm.arrive()

    def step(handle):
        while worker.node_steps and worker.node_steps[0] is not handle:
            worker.node_steps[0].wait()
        worker.shm.wait_all()
        works = []
        per = worker.lanes * worker.block
        for a, f, off, lp in zip(arrays, fmts, offsets, loss):
            if worker.engine is None:     # not one of the node's leaders
                break
            n = a.size
            blocks = -(-n // per)
            b0 = blocks * worker.local_rank // worker.leaders
            b1 = blocks * (worker.local_rank + 1) // worker.leaders
            lo, hi = b0 * per, min(b1 * per, n)
            if hi <= lo:
                continue
            sources = [region.input(i, off, a)[lo:hi] for i in range(worker.local_size)]
            out = region.result(off, a)[lo:hi]
            works.append(worker.make_work(f, sources, out, mean,
                                          [worker.proposals(s, f) for s in sources], lp))
        worker.submit(works)
        handle.works = works
        try:
            worker.wait_works(works, None)
            error = next((w.error for w in works if w.error is not None), None)
        except BaseException as e:
            error = e
        worker.shm.arrive(failed=error is not None)   # the others must not take the result
        if error is not None:
            raise error
        worker.shm.wait_all()     # raises for a local worker that failed or is gone
        for a, o, off in zip(arrays, outs, offsets):
            o.reshape(-1)[...] = region.result(off, a)
        worker.shm.arrive()       # everyone has copied out: the region may be reused
        worker.shm.wait_all()

    def finish(handle):
        """The node's step, once: a step that failed stays failed (its handle's `wait`
        raises its error again) and leaves the worker's pending steps."""
        try:
            step(handle)
        except BaseException as e:
            handle.error = e
            raise
        finally:
            handle._finish = None
            if handle in worker.node_steps:
                worker.node_steps.remove(handle)

    handle = Handle(worker, [], outs, single, finish)
    worker.node_steps.append(handle)
    return handle

