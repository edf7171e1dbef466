"""A Verilator model of a multi-port frame top, driven from Python a whole frame at a time.

    model = SwitchModel("loopback", ports=4, width=64)
    model.send(0, frame)                  # queue a frame on port 0's rx
    for port, out in model.run():         # clock until idle; frames seen on the tx ports
        ...

The top (see `sim.tops.TOPS`) has a clock ``clk``, a reset ``rst`` and, per port ``i``,
``rx{i}_{tdata,tkeep,tlast,tvalid}`` in / ``rx{i}_tready`` out, ``tx{i}_{tdata,tkeep,tlast,
tvalid}`` out / ``tx{i}_tready`` in. Byte 0 of a frame is the least significant byte of tdata;
every beat is full but the last, whose keep is packed from bit 0. Other ports are ignored.

The clock runs in C++ (netagg/sim/cpp/harness.cpp) beside the model: it drives each port's queued
frames on rx one beat per cycle while the design is ready, keeps tx ready (or follows a
backpressure pattern) and gathers the frames that come out. Python crosses into C++ a few
times per `run` or `step` (queue the frames sent since the last call, clock, fetch what came
out), never per cycle or per signal, so the Python-driven model keeps most of the speed of a
pure C++ loop over the same model: `bench` measures both (`SwitchModel.bench_cpp` is the C++
loop with a traffic generator of its own).

Build: `sim.verilated.build_library` turns the top's Verilog and the harness into one shared
library with Verilator, loaded with ctypes, cached by a hash of both and built under a file
lock, so parallel test workers build each model once. The frame exchange (what `send` queued,
what `run` returns) goes through a few functions of CPython's stable ABI that the harness
calls itself, through ``ctypes.PyDLL``: a batch of frames crosses in one call each way, with
no Python loop over frames or beats.

Why not pyverilator (pyverilator-mm 0.7.6), the chosen way to drive a Verilator model from
Python where it serves: its own interface is per-signal get/set functions plus ``eval``, the
per-cycle crossing this module exists to avoid (36k-51k cycles/s, measured on 2 cores). It can
host a C++ loop, but only from the side: a ``.cpp`` passed in ``build(args=[...])`` is compiled
and linked into its library (tried: a loop over ``Vtop*`` called as ``sim.lib.f(sim.model, n)``
with ctypes runs), so the loop is still reached through ctypes, and pyverilator adds only
costs: it forces ``--trace`` and ``--std=c++11``, rebuilds from scratch on every ``build`` (no
cache), runs ``make`` serially, and wants the Verilog file named after its module. The harness
here is that same kind of ctypes library, built and cached by netagg.
"""

from __future__ import annotations

import ctypes
import random
import time
from pathlib import Path

from netagg.contract import wire as W

from .verilated import ContractError, Harness, LoadedModel, build_library, check_port

# Part of every model's key: bump it when what this module writes for the harness
# (netagg_ports.h) or expects of it changes.
HARNESS_ABI = 3
RECEIVE_IDLE = 600          # quiet cycles that end a `receive` (a control request's records)
RUN_IDLE = 128              # quiet cycles that end a `run`: a packet's, last beat in to first
                            # out (a spine's is about 84)
BENCH_KEY = 0x5EEDC0DE      # the benchmarks' job's KEY, every contribution's RETH.rkey
_PORT_SIGNALS = ("rx{i}_tdata", "rx{i}_tkeep", "rx{i}_tlast", "rx{i}_tvalid", "rx{i}_tready",
                 "tx{i}_tdata", "tx{i}_tkeep", "tx{i}_tlast", "tx{i}_tvalid", "tx{i}_tready")
_INPUTS = {"rx{i}_tdata", "rx{i}_tkeep", "rx{i}_tlast", "rx{i}_tvalid", "tx{i}_tready"}


class ProtocolError(RuntimeError):
    """The design broke the frame format on a tx port (keep not packed, short beat). The
    model keeps reporting it on every `run` or `step` until `reset`."""


class SimulationTimeout(RuntimeError):
    """`run` did not reach idle within its cycle budget. `frames` holds what came out."""

    def __init__(self, message: str, frames: list[tuple[int, bytes]]):
        super().__init__(message)
        self.frames = frames


def _port_header(signals: dict[str, tuple[str, int]], top: str) -> str:
    """netagg_ports.h for the harness, after checking the top against the port contract."""
    count = 0
    while f"rx{count}_tdata" in signals:
        count += 1
    if count == 0:
        raise ContractError(f"top {top!r} has no rx0_tdata port: not a frame-port top")
    if "clk" not in signals:
        raise ContractError(f"top {top!r} has no clk input")
    width = signals["rx0_tdata"][1]
    if width % 8 or not 8 <= width <= 512:
        raise ContractError(f"top {top!r}: tdata of {width} bits (8..512, whole bytes)")
    for i in range(count):
        for pattern in _PORT_SIGNALS:
            name = pattern.format(i=i)
            want_dir = "IN" if pattern in _INPUTS else "OUT"
            want_width = width if "tdata" in name else width // 8 if "tkeep" in name else 1
            check_port(signals, top, name, want_dir, want_width)
    each = " ".join(f"X({i})" for i in range(count))
    return (f"#define NETAGG_PORTS {count}\n#define NETAGG_WIDTH {width}\n"
            f"#define NETAGG_HAS_RST {int('rst' in signals)}\n"
            f"#define NETAGG_HAS_TICK {int('tick' in signals)}\n"
            f"#define NETAGG_HAS_LINK_DOWN {int('link_down' in signals)}\n"
            f"#define NETAGG_FOR_EACH_PORT(X) {each}\n")


HARNESS = Harness(sources=("harness.cpp",), header=_port_header, abi=HARNESS_ABI)


def build_model(top: str, **params):
    """The shared library of `top` with `params` and the frame-port harness, built if not
    cached (see `sim.verilated`)."""
    return build_library(top, HARNESS, **params)


def _load(library: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library))
    handle, u64, i64, p = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p
    sigs = {
        "nm_ports": ([], ctypes.c_int), "nm_width": ([], ctypes.c_int),
        "nm_create": ([], handle), "nm_destroy": ([handle], None),
        "nm_reset": ([handle, ctypes.c_uint], None), "nm_cycles": ([handle], u64),
        "nm_step": ([handle, u64], None), "nm_tick": ([handle], ctypes.c_int),
        "nm_link_down": ([handle, ctypes.c_uint32], ctypes.c_int),
        "nm_run_until_idle": ([handle, u64, u64], ctypes.c_int),
        "nm_port_state": ([handle, ctypes.c_int, p], None),
        "nm_queued": ([handle, ctypes.c_int], i64),
        "nm_set_pattern": ([handle, ctypes.c_int, ctypes.c_int, u64, ctypes.c_uint, u64], None),
        "nm_errors": ([handle, ctypes.c_char_p, ctypes.c_int], u64),
        "nm_bench": ([handle, u64, u64, p], None),
    }
    for name, (argtypes, restype) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
    # The frame exchange builds and reads Python objects, so it runs holding the GIL (PyDLL);
    # the calls above release it while they clock the model.
    pylib = ctypes.PyDLL(str(library))
    pylib.nm_push_list.argtypes = [handle, ctypes.py_object, ctypes.py_object]
    pylib.nm_push_list.restype = ctypes.c_int
    pylib.nm_take_output.argtypes = [handle]
    pylib.nm_take_output.restype = ctypes.py_object
    pylib.nm_bench_traffic.argtypes = [handle, ctypes.py_object, ctypes.py_object,
                                       ctypes.py_object]
    pylib.nm_bench_traffic.restype = ctypes.c_int
    return lib, pylib


_LIBRARIES: dict[Path, tuple[ctypes.CDLL, ctypes.PyDLL]] = {}


class SwitchModel(LoadedModel):
    """A multi-port frame top in Verilator, clocked in C++, fed and drained from Python.

    `top` names a top of `sim.tops.TOPS`; `params` go to its constructor (for example
    ``ports``, ``width``). `ports` and `width` are read back from the built model.

    One model is driven from one thread at a time; `run` and `step` release the GIL while the
    clock runs, so other Python threads (sockets, other models) go on meanwhile.
    """

    def __init__(self, top: str = "switch", **params):
        self.top = top
        self.params = dict(params)
        self.library = build_model(top, **params)
        if self.library not in _LIBRARIES:
            _LIBRARIES[self.library] = _load(self.library)
        self._lib, self._pylib = _LIBRARIES[self.library]
        self.ports = self._lib.nm_ports()
        self.width = self._lib.nm_width()
        self._destroy = self._lib.nm_destroy
        self._h = self._lib.nm_create()
        self._pend_ports: list[int] = []
        self._pend_frames: list[bytes] = []
        self._links_down = 0

    # -- frames in and out --------------------------------------------------------------

    def send(self, port: int, frame: bytes) -> None:
        """Queue `frame` (1 or more bytes) to go in on `port`'s rx after those before it."""
        if type(frame) is not bytes:
            frame = bytes(frame)
        if not (frame and 0 <= port < self.ports and len(frame) < 1 << 31):
            if not 0 <= port < self.ports:
                raise ValueError(f"port {port!r} out of range: the model has {self.ports} ports")
            raise ValueError(f"a frame has 1 to 2**31-1 bytes, not {len(frame)}")
        self._pend_ports.append(port)
        self._pend_frames.append(frame)

    def run(self, max_cycles: int = 1_000_000,
            idle_cycles: int = 1000) -> list[tuple[int, bytes]]:
        """Clock until every frame sent is taken in and the ports have been quiet (no beat
        offered on rx or tx, no frame half out) for `idle_cycles` cycles; return the frames
        that came out, as (tx port, bytes) in the order their last beats left.

        Raises SimulationTimeout (with the frames that did come out) if that takes more than
        `max_cycles` cycles, ProtocolError if the design broke the frame format.
        """
        self._flush()
        timed_out = self._lib.nm_run_until_idle(self._h, max_cycles, idle_cycles)
        frames = self._collect()
        if timed_out:
            raise SimulationTimeout(
                f"{self.top}: not idle for {idle_cycles} cycles within {max_cycles} cycles "
                f"(now at cycle {self.cycles}): {self._stuck()}", frames)
        return frames

    def step(self, cycles: int) -> list[tuple[int, bytes]]:
        """Clock exactly `cycles` cycles; return the frames that came out meanwhile."""
        self._flush()
        self._lib.nm_step(self._h, cycles)
        return self._collect()

    def tick(self) -> list[tuple[int, bytes]]:
        """One cycle with the top's `tick` input high (after the frames queued so far are
        handed over); the frames that came out in it. ValueError for a top without one."""
        self._flush()
        if not self._lib.nm_tick(self._h):
            raise ValueError(f"top {self.top!r} has no tick input")
        return self._collect()

    def set_link(self, port: int, up: bool) -> None:
        """Port `port`'s MAC reports its link up or lost (a leaf's `link_down`), from the
        next cycle (call it between runs). ValueError for a top without the input."""
        self._links_down = self._links_down & ~(1 << port) | (0 if up else 1 << port)
        if not self._lib.nm_link_down(self._h, self._links_down):
            raise ValueError(f"top {self.top!r} has no link_down input (not a leaf)")

    @property
    def cycles(self) -> int:
        """Cycles since the last reset."""
        return self._lib.nm_cycles(self._h)

    def queued(self, port: int) -> int:
        """Frames sent on `port` and not yet fully taken in by the design."""
        pending = sum(1 for p in self._pend_ports if p == port)
        return pending + self._lib.nm_queued(self._h, port)

    def port_state(self, port: int) -> dict:
        state = (ctypes.c_int64 * 6)()
        self._lib.nm_port_state(self._h, port, state)
        names = ("queued", "frames_in", "beats_in", "frames_out", "beats_out", "partial_bytes")
        return dict(zip(names, state))

    def reset(self, cycles: int = 4) -> None:
        """Drop every queued and partial frame, every link back up, hold rst for `cycles`
        cycles, count from 0."""
        self._pend_ports.clear()
        self._pend_frames.clear()
        self._links_down = 0
        self._lib.nm_link_down(self._h, 0)
        self._lib.nm_reset(self._h, cycles)

    # -- traffic shaping ----------------------------------------------------------------

    def backpressure(self, port: int | None = None, pattern: str | None = None,
                     probability: float | None = None, seed: int = 1) -> None:
        """Set when tx ready is high on `port` (all ports if None): `pattern` is a string of
        '1' (ready) and '0' (not), 1 to 64 cycles, repeated; `probability` makes it random
        (seeded) with that chance of ready each cycle; neither means always ready."""
        self._pattern(1, port, pattern, probability, seed)

    def gaps(self, port: int | None = None, pattern: str | None = None,
             probability: float | None = None, seed: int = 1) -> None:
        """Same as `backpressure` for rx valid: cycles at '0' put no new beat on rx (a beat
        already offered stays until taken, as the stream rules require)."""
        self._pattern(0, port, pattern, probability, seed)

    def _pattern(self, which, port, pattern, probability, seed):
        if pattern is not None and probability is not None:
            raise ValueError("give a pattern or a probability, not both")
        if pattern is not None:
            if not 1 <= len(pattern) <= 64 or set(pattern) - {"0", "1"}:
                raise ValueError(f"a pattern is 1 to 64 characters '0' or '1', not {pattern!r}")
            bits, period = int(pattern[::-1], 2), len(pattern)
        elif probability is not None:
            if not 0.0 <= probability <= 1.0:
                raise ValueError(f"a probability is within 0..1, not {probability!r}")
            bits, period = min(int(probability * (1 << 32)), 1 << 32), 0
        else:
            bits, period = 1, 1
        for p in range(self.ports) if port is None else [port]:
            if not 0 <= p < self.ports:
                raise ValueError(f"port {p!r} out of range: the model has {self.ports} ports")
            self._lib.nm_set_pattern(self._h, p, which, bits, period,
                                     (seed * 0x9E3779B1 + p + 1) & (1 << 64) - 1)

    # -- internals ------------------------------------------------------------------------

    def _flush(self) -> None:
        if self._pend_frames:
            ports, frames = self._pend_ports, self._pend_frames
            self._pend_ports, self._pend_frames = [], []
            if self._pylib.nm_push_list(self._h, ports, frames):
                raise ValueError("frames must be bytes of 1 to 2**31-1 bytes on a valid port")

    def _collect(self) -> list[tuple[int, bytes]]:
        frames = self._pylib.nm_take_output(self._h)
        text = ctypes.create_string_buffer(256)
        errors = self._lib.nm_errors(self._h, text, 256)
        if errors:
            raise ProtocolError(f"{self.top}: {errors} bad tx beat(s), first at "
                                f"{text.value.decode()}")
        return frames

    def _stuck(self) -> str:
        parts = []
        for port in range(self.ports):
            s = self.port_state(port)
            if s["queued"]:
                parts.append(f"port {port} has {s['queued']} frame(s) not fully taken in")
            if s["partial_bytes"]:
                parts.append(f"port {port} has {s['partial_bytes']} bytes of a frame "
                             "without its last beat")
        return "; ".join(parts) or "the design kept offering beats"

    # -- speed ----------------------------------------------------------------------------

    def _traffic(self, traffic, chunk: int):
        """Per-port frame pools and how many frames to keep queued on each port so that it
        never runs dry within `chunk` cycles."""
        pools = {port: [] for port in range(self.ports)}
        for port, frame in traffic:
            if not 0 <= port < self.ports:
                raise ValueError(f"port {port!r} out of range: the model has {self.ports} ports")
            if not frame:
                raise ValueError("a frame has at least 1 byte")
            pools[port].append(bytes(frame))
        beat = self.width // 8
        keep = [chunk // -(-min(map(len, f)) // beat) + 2 if f else 0 for f in pools.values()]
        return pools, keep

    def bench_cpp(self, cycles: int, traffic: list[tuple[int, bytes]], chunk: int = 512) -> dict:
        """The C++ reference loop: the frames of `traffic` ((port, frame) pairs) sent over and
        over, every port kept supplied, `chunk` cycles per step, frames out dropped, without
        returning to Python. Resets the model before and after."""
        pools, keep = self._traffic(traffic, chunk)
        ports = [port for port, frames in pools.items() for _ in frames]
        frames = [frame for frames in pools.values() for frame in frames]
        self.reset()
        if self._pylib.nm_bench_traffic(self._h, ports, frames, keep):
            raise ValueError("bad benchmark traffic")
        stats = (ctypes.c_int64 * 4)()
        cpu = time.process_time()
        self._lib.nm_bench(self._h, cycles, chunk, stats)
        cpu = time.process_time() - cpu
        self._pylib.nm_bench_traffic(self._h, [], [], [0] * self.ports)
        self.reset()
        seconds = stats[3] / 1e9
        return {"cycles_per_s": stats[0] / seconds, "cpu_cycles_per_s": stats[0] / cpu,
                "cycles": stats[0], "frames": stats[1], "bytes": stats[2], "seconds": seconds}

    def bench_python(self, cycles: int, traffic: list[tuple[int, bytes]],
                     chunk: int = 512) -> dict:
        """The same from Python: every port kept supplied with `send`, `step(chunk)`, every
        frame that comes out taken as bytes. Resets the model before and after."""
        pools, keep = self._traffic(traffic, chunk)
        nexts = [0] * self.ports
        frames = nbytes = 0
        self.reset()
        start = self.cycles
        cpu = time.process_time()
        t0 = time.perf_counter()
        while self.cycles - start < cycles:
            for port, pool in pools.items():
                if pool:
                    for _ in range(keep[port] - self.queued(port)):
                        self.send(port, pool[nexts[port] % len(pool)])
                        nexts[port] += 1
            out = self.step(chunk)
            frames += len(out)
            nbytes += sum(len(f) for _, f in out)
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - cpu
        done = self.cycles - start
        self.reset()
        return {"cycles_per_s": done / seconds, "cpu_cycles_per_s": done / cpu, "cycles": done,
                "frames": frames, "bytes": nbytes, "seconds": seconds}


def random_traffic(ports: int, frame_len: int = 1024, per_port: int = 16,
                   seed: int = 1) -> list[tuple[int, bytes]]:
    """`per_port` frames of `frame_len` random bytes for each port."""
    rng = random.Random(seed)
    return [(port, rng.randbytes(frame_len)) for port in range(ports) for _ in range(per_port)]


def bench(top: str = "loopback", seconds: float = 0.5, frame_len: int = 1024,
          traffic: list[tuple[int, bytes]] | None = None, chunk: int = 512, rounds: int = 3,
          **params) -> dict:
    """Cycles per second of `top` (built with `params`) driven from Python against a pure C++
    loop over the same model, both sending the frames of `traffic` ((port, frame) pairs; by
    default `random_traffic` of `frame_len` bytes on every port) over and over, back to back.
    Both step `chunk` cycles at a time (512 keeps queued and returned frames in the caches;
    2048 measured about 15% slower on both sides, more on the Python side at 512 bits).
    The two alternate for `rounds` rounds of about `seconds` each; each keeps its best round,
    by wall clock (and, as ``*_cpu_*``, by this process's CPU time, steadier on a busy
    machine).

    Returns {"python_cycles_per_s", "cpp_cycles_per_s", "ratio", ...}: ratio is Python-driven
    over C++.
    """
    started = time.monotonic()
    model = SwitchModel(top, **params)
    build_s = time.monotonic() - started
    with model:
        if traffic is None:
            traffic = random_traffic(model.ports, frame_len)
        probe = model.bench_cpp(4 * chunk, traffic, chunk)
        cycles = max(chunk, int(probe["cycles_per_s"] * seconds) // chunk * chunk)
        py, cpp = [], []
        for _ in range(rounds):
            py.append(model.bench_python(cycles, traffic, chunk))
            cpp.append(model.bench_cpp(cycles, traffic, chunk))
    best = {name: (max(r["cycles_per_s"] for r in runs), max(r["cpu_cycles_per_s"] for r in runs))
            for name, runs in (("python", py), ("cpp", cpp))}
    return {
        "python_cycles_per_s": round(best["python"][0]),
        "cpp_cycles_per_s": round(best["cpp"][0]),
        "ratio": round(best["python"][0] / best["cpp"][0], 3),
        "python_cpu_cycles_per_s": round(best["python"][1]),
        "cpp_cpu_cycles_per_s": round(best["cpp"][1]),
        "ratio_cpu": round(best["python"][1] / best["cpp"][1], 3),
        "top": top, "params": params, "ports": model.ports, "width": model.width,
        "traffic_frames": len(traffic), "cycles_per_round": cycles, "rounds": rounds,
        "python_frames_out": py[-1]["frames"], "cpp_frames_out": cpp[-1]["frames"],
        "build_or_load_s": round(build_s, 1),
    }


class RtlSwitch(SwitchModel):
    """The switch's RTL (`sim.tops.SwitchTop`) as a backend for the host: the golden model's
    interface (`send`, `run`) and parameters, frames in and out of its ports, cycle-accurate.
    `run` returns once the ports have been quiet for `idle_cycles`; a frame the switch is
    still working on then comes out of a later `run`."""

    def __init__(self, ports: int = 4, jobs: int = 4, max_workers: int = 8, slots: int = 64,
                 width: int = 64, **params):
        """`params`: more of `hw.switch.Switch`'s (``max_payload``, say)."""
        super().__init__("switch", ports=ports, width=width, jobs=jobs,
                         max_workers=max_workers, slots=slots, **params)
        self.reset()
        self.busy, self._sent = False, False        # busy: it may still hold work, run again
        self._control, self._control_left = False, 0   # a control request in since the last
        # run; the cycles `advance` still clocks for it (RECEIVE_IDLE)

    def send(self, port: int, frame: bytes) -> None:
        super().send(port, frame)
        self._sent = True
        # a control request's records take longer than a quiet `run`: its run waits longer
        if len(frame) > W.BTH_OFFSET and frame[W.BTH_OFFSET] == W.OP_CONTROL:
            self._control, self._control_left = True, RECEIVE_IDLE

    def run(self, max_cycles: int = 10_000_000,
            idle_cycles: int = RUN_IDLE) -> list[tuple[int, bytes]]:
        """Clock until the ports are quiet for `idle_cycles` (longer than a packet takes from
        its last beat in to its first beat out); nothing at all when nothing was sent and the
        last run brought nothing out. A frame still inside (a control request's records take
        about 2 cycles each) comes out of a later run: `busy` says when to call again."""
        if not (self._sent or self.busy):
            return []
        self._sent = False
        if self._control:
            idle_cycles, self._control, self._control_left = max(idle_cycles, RECEIVE_IDLE), \
                False, 0
        frames = super().run(max_cycles, idle_cycles)
        self.busy = bool(frames)
        return frames

    def receive(self, port: int, frame: bytes) -> list[tuple[int, bytes]]:
        """One frame in and every frame it makes out (the golden model's `receive`), for a
        network that delivers one frame at a time: clocks until the switch is quiet for
        longer than a control request of 64 records takes."""
        self.send(port, frame)
        out = self.run(idle_cycles=RECEIVE_IDLE)
        while self.busy:
            out += self.run(idle_cycles=RECEIVE_IDLE)
        return out

    SLICE = 1024          # cycles per `advance`
    fed = property(lambda self: self._sent, doc="Frames were sent since the clock last ran.")

    def advance(self, cycles: int | None = None) -> list[tuple[int, bytes]]:
        """Clock a slice of at most `cycles` (default `SLICE`) and return what came out (a
        server's switch, as a board works; a fabric's time, `sim.topology_time`). It ends
        early once the ports have been quiet as long as a `run` waits (idle cycles are not
        clocked); `busy`: it did not, or a control request came in fewer than RECEIVE_IDLE
        cycles ago (the switch may hold work: advance again)."""
        self._sent = False
        self._flush()
        start = self.cycles
        quiet = not self._lib.nm_run_until_idle(self._h, cycles or self.SLICE, RUN_IDLE)
        self._control_left = max(0, self._control_left - (self.cycles - start))
        self._control = self._control_left > 0
        self.busy = not quiet or self._control
        return self._collect()


def make_switch(*, spine: bool = False, uplinks: int = 0, **params) -> RtlSwitch:
    """The RTL backend of `netagg sim serve --backend rtl`, of the host's tests and of a
    fabric's switches: `spine`, a switch whose jobs may take leaves' partials (CONFIG.partials,
    docs/leafspine.md); `uplinks`, a leaf's (`hw.switch.Switch`'s parameters; each build is
    cached apart, and a switch built as neither is the one the boards carry)."""
    if spine:
        params["spine"] = True
    if uplinks:
        params["uplinks"] = uplinks
    return RtlSwitch(**params)
