"""Allreduce of accelerator (CUDA) tensors through the switch: staged through pinned host
memory in chunks, pipelined on side streams.

The worker reads and writes host memory, so a CUDA tensor's values go to the host and its
sums come back, a chunk at a time, through a ring of `DEPTH` pinned host buffers of
`chunk_bytes` each (`Staging`, one per process group and device; allocated on first use,
reused by every later allreduce: `DEPTH x chunk_bytes` of pinned memory, 12 MiB by default).
One allreduce of tensors (`Staging.prepare` on the caller's thread, `Staging.run` on the
group's completer thread):

- on the caller's thread, an event is recorded on the caller's current stream (the
  producer's: whatever it queued before the all_reduce, the gradients' kernels say, comes
  first), both side streams (`to_host`, `to_device`) wait for it, and the tensors are marked
  as used by them (`record_stream`: the caching allocator keeps their memory until the side
  streams are past it, even if the caller drops them meanwhile);
- the tensors are cut into chunks (`plan`): each tensor in pieces at whole exponent blocks
  (`block` values: a packet's lanes x the worker's block), small tensors packed into one
  chunk, so each piece is summed with the exponents, and to the bits, of the tensor sent
  whole from host memory;
- chunk k: its pieces are copied into buffer k mod DEPTH on `to_host`, an event marks the
  copy; the thread waits for that event alone (`Event.synchronize`, never the whole device)
  and starts the chunk's allreduce in the buffer (in place); then it waits for chunk k-1's
  allreduce and copies chunk k-1's sums back into the tensors on `to_device`, an event marks
  the copy back, and the copy of chunk k-1+DEPTH into the freed buffer is queued on
  `to_host` after that event. So while chunk k is summed, chunk k+1 is on its way to the
  host and chunk k-1 on its way back (and a flat worker has chunks k-1 and k in flight at
  once);
- after the last copy back, an event on `to_device`; the thread waits for it, then
  completes the future with the tensors on `to_device` (a CUDA future records its own events
  there, which a consumer's `wait()` or `value()` makes the consumer's stream wait on): the
  future is done when the sums are in the tensors on the GPU.

A non-contiguous tensor (or one that overlaps another of the call) goes through a contiguous
copy on the device, made on `to_host` and copied back on `to_device`. If an allreduce fails,
the future's error says so and the ring is dropped (a worker may still hold a buffer), and
the tensors hold, in part, sums: never a completed future over stale data.

`Device` is what the pipeline asks of the accelerator (streams, events, an operation queued
on a stream, pinned host memory, its futures); `CudaDevice` is CUDA's. Tests run the same
pipeline on CPU tensors with a stand-in whose streams are threads (tests/test_torch_staging.py).

Cost: per allreduce, 2 events per chunk and 2 more, one thread wake per chunk, and the
copies (at PCIe speed, overlapped with the sums but for the first chunk in and the last
back); `stats` counts the seconds the thread waited on copies that the sums did not hide.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Protocol

import numpy as np
import torch

from netagg.host.torch_tensors import as_array

CHUNK_BYTES = 4 << 20       # one pinned buffer: 1 Mi float32 values
DEPTH = 3                   # buffers: one on its way in, one being summed, one on its way out


class Device(Protocol):
    """The accelerator's operations the pipeline uses (CUDA's: `CudaDevice`)."""

    name: str

    def current_stream(self) -> Any: ...

    def new_stream(self) -> Any: ...

    def new_event(self) -> Any: ...

    def record(self, event, stream) -> None:
        """`event` completes when `stream` reaches this point."""

    def wait(self, stream, event) -> None:
        """`stream` goes on past this point once `event` completes (the host does not wait)."""

    def synchronize(self, event) -> None:
        """The host waits for `event` alone."""

    def launch(self, stream, what: str, operation: Callable[[], object]) -> None:
        """Queue `operation` (device work: copies) on `stream`; `what` names it."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of pinned host memory (uint8)."""

    def keep(self, tensor: torch.Tensor, stream) -> None:
        """`tensor`'s memory stays allocated until `stream` is past what is queued now."""

    def future(self) -> torch.futures.Future: ...

    def complete(self, future: torch.futures.Future, value, stream) -> None:
        """Set `future`'s value, ordered after `stream` for whoever consumes it."""


class CudaDevice:
    """A CUDA device's streams, events, pinned memory and stream-aware futures."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.name = str(self.device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def new_event(self):
        return torch.cuda.Event()

    def record(self, event, stream):
        event.record(stream)

    def wait(self, stream, event):
        stream.wait_event(event)

    def synchronize(self, event):
        event.synchronize()

    def launch(self, stream, what, operation):
        with torch.cuda.stream(stream):
            operation()

    def host_buffer(self, nbytes):
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def keep(self, tensor, stream):
        tensor.record_stream(stream)

    def future(self):
        return torch.futures.Future(devices=[self.device])

    def complete(self, future, value, stream):
        with torch.cuda.stream(stream):
            future.set_result(value)


def device_for(device: torch.device) -> Device | None:
    """The staging device for tensors on `device`: CUDA's, None for the CPU (no staging)."""
    return CudaDevice(device) if device.type == "cuda" else None


@dataclasses.dataclass(frozen=True)
class Piece:
    """Values start..stop of tensor `tensor`, at `offset` in its chunk's buffer."""

    tensor: int
    start: int
    stop: int
    offset: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def plan(sizes: list[int], chunk: int, block: int) -> list[list[Piece]]:
    """Tensors of `sizes` values in chunks of at most `chunk` values (a multiple of `block`):
    a tensor is cut only at multiples of `block` values from its start, and what is left of
    a chunk takes the next tensor's first pieces."""
    if chunk < block or chunk % block:
        raise ValueError(f"a chunk of {chunk} values is not a multiple of the block, {block}")
    chunks: list[list[Piece]] = [[]]
    fill = 0
    for i, n in enumerate(sizes):
        start = 0
        while start < n:
            room = chunk - fill
            take = n - start if n - start <= room else room // block * block
            if take == 0:
                chunks.append([])
                fill = 0
                continue
            chunks[-1].append(Piece(i, start, start + take, fill))
            start += take
            fill += take
    return [c for c in chunks if c]


@dataclasses.dataclass
class StagingStats:
    """What the staging did: allreduces, chunks, bytes each way, and the seconds the thread
    waited for copies to the host that the sums did not hide."""

    allreduces: int = 0
    chunks: int = 0
    bytes: int = 0
    copy_wait_seconds: float = 0.0


@dataclasses.dataclass
class Staged:
    """One allreduce, prepared on the caller's thread: its tensors, the flat tensors the
    copies read and write (the tensors' own memory, or contiguous copies), and the event on
    the producer's stream."""

    tensors: list[torch.Tensor]
    flats: list[torch.Tensor]
    copies: list[int]           # tensors that go through a contiguous copy
    ready: Any


# the worker's allreduce of one chunk: its pieces' host arrays (in place) and the pieces
ChunkAllreduce = Callable[[list[np.ndarray], list[Piece]], Any]


class Staging:
    """The pinned ring, side streams and pipeline of one process group on one device."""

    def __init__(self, device: Device, block: int, chunk_bytes: int = CHUNK_BYTES,
                 depth: int = DEPTH):
        if depth < 2:
            raise ValueError(f"staging needs 2 buffers or more, not {depth}")
        self.device, self.block, self.chunk_bytes, self.depth = device, block, chunk_bytes, depth
        self.to_host = device.new_stream()
        self.to_device = device.new_stream()
        self._ring: list[torch.Tensor] = []
        self.stats = StagingStats()

    def chunk_values(self, dtype: torch.dtype) -> int:
        """Values of `dtype` in one chunk: whole blocks in `chunk_bytes`."""
        values = self.chunk_bytes // dtype.itemsize // self.block * self.block
        if values < self.block:
            raise ValueError(f"{self.device.name}: a staging chunk of {self.chunk_bytes} bytes "
                             f"holds no block of {self.block} {dtype} values")
        return values

    def prepare(self, tensors: list[torch.Tensor]) -> Staged:
        """On the caller's thread: order the side streams after the caller's current stream
        and keep the tensors' memory for them."""
        d = self.device
        ready = d.new_event()
        d.record(ready, d.current_stream())
        flats, copies = [], []
        for i, t in enumerate(tensors):
            if t.is_contiguous() and not any(_overlap(t, u) for u in tensors[:i]):
                flats.append(t.detach().view(-1))
            else:
                flats.append(torch.empty(t.numel(), dtype=t.dtype, device=t.device))
                copies.append(i)
        for t in (*tensors, *flats):
            d.keep(t, self.to_host)
            d.keep(t, self.to_device)
        return Staged(list(tensors), flats, copies, ready)

    def _buffers(self, dtype: torch.dtype, values: int):
        """The ring as `values` values of `dtype` each: torch views (the copies') and the
        worker's arrays (bfloat16 as its int16 bits), both the pinned memory itself."""
        if not self._ring:
            self._ring = [self.device.host_buffer(self.chunk_bytes) for _ in range(self.depth)]
        hosts = [b[:values * dtype.itemsize].view(dtype) for b in self._ring]
        return hosts, [as_array(h) for h in hosts]

    def run(self, staged: Staged, allreduce: ChunkAllreduce, timeout: float | None):
        """The pipeline (above), on the completer thread; `allreduce(arrays, pieces)`
        starts one chunk's allreduce in place and returns its handle (`wait(timeout)`).
        Returns the tensors once their sums are in them."""
        d, ins, outs = self.device, self.to_host, self.to_device
        d.wait(ins, staged.ready)
        d.wait(outs, staged.ready)
        for i in staged.copies:
            flat, t = staged.flats[i], staged.tensors[i]
            d.launch(ins, f"contiguous {i}", lambda f=flat, t=t: f.view(t.shape).copy_(t))
        dtype = staged.tensors[0].dtype
        chunks = plan([f.numel() for f in staged.flats], self.chunk_values(dtype), self.block)
        hosts, rings = self._buffers(dtype, self.chunk_values(dtype))
        copied_in: list[Any] = [None] * len(chunks)
        copied_back: list[Any] = [None] * len(chunks)
        handles: list[Any] = [None] * len(chunks)

        def copy_in(k: int):
            host = hosts[k % self.depth]
            if k >= self.depth:             # its buffer's previous chunk is back on the device
                d.wait(ins, copied_back[k - self.depth])
            for p in chunks[k]:
                src = staged.flats[p.tensor][p.start:p.stop]
                dst = host[p.offset:p.offset + p.size]
                d.launch(ins, f"in {k}", lambda dst=dst, src=src: _copy(dst, src))
            copied_in[k] = d.new_event()
            d.record(copied_in[k], ins)

        def copy_back(k: int):
            host = hosts[k % self.depth]
            for p in chunks[k]:
                dst = staged.flats[p.tensor][p.start:p.stop]
                src = host[p.offset:p.offset + p.size]
                d.launch(outs, f"back {k}", lambda dst=dst, src=src: _copy(dst, src))
            copied_back[k] = d.new_event()
            d.record(copied_back[k], outs)

        def finish(k: int):
            handles[k].wait(timeout)
            handles[k] = None
            copy_back(k)
            if k + self.depth < len(chunks):
                copy_in(k + self.depth)

        try:
            for k in range(min(self.depth, len(chunks))):
                copy_in(k)
            for k, pieces in enumerate(chunks):
                began = time.perf_counter()
                d.synchronize(copied_in[k])
                self.stats.copy_wait_seconds += time.perf_counter() - began
                ring = rings[k % self.depth]
                handles[k] = allreduce([ring[p.offset:p.offset + p.size] for p in pieces],
                                       pieces)
                if k:
                    finish(k - 1)
            if chunks:
                finish(len(chunks) - 1)
            for i in staged.copies:
                flat, t = staged.flats[i], staged.tensors[i]
                d.launch(outs, f"scatter {i}",
                         lambda f=flat, t=t: t.detach().copy_(f.view(t.shape)))
            done = d.new_event()
            d.record(done, outs)
            d.synchronize(done)
        except BaseException:
            self._ring = []         # a worker's chunk in flight or a copy may still use it
            raise
        self.stats.allreduces += 1
        self.stats.chunks += len(chunks)
        self.stats.bytes += sum(f.numel() for f in staged.flats) * dtype.itemsize
        return staged.tensors

    def complete(self, future: torch.futures.Future, value):
        """Set the future's value, ordered after the copies back."""
        self.device.complete(future, value, self.to_device)


def _copy(dst: torch.Tensor, src: torch.Tensor):
    """An asynchronous copy between the device and pinned host memory."""
    dst.copy_(src, non_blocking=True)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of `a` and `b` overlap (same storage, intersecting bytes)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + _extent(b) and b0 < a0 + _extent(a)


def _extent(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to just past its last."""
    if t.numel() == 0:
        return 0
    return (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()
