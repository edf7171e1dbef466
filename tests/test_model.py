"""The Python-driven Verilator model (netagg/sim/model.py) on LoopbackTop: frames in, frames out.

LoopbackTop sends what comes in on rx{i} out of tx{(i+1)%ports}, untouched. Each width is one
Verilator build (about half a minute), cached under the build cache.
"""

import random

import pytest

from netagg.sim.model import ContractError, SimulationTimeout, SwitchModel, bench, random_traffic

PORTS = 4
PARAMS = {"ports": PORTS, "depth": 16}


@pytest.fixture(scope="module", params=[64, 512], ids=lambda w: f"w{w}")
def width(request):
    return request.param


@pytest.fixture(scope="module")
def built(width):
    with SwitchModel("loopback", width=width, **PARAMS) as model:
        yield model


@pytest.fixture
def model(built):
    built.reset()
    built.backpressure()
    built.gaps()
    return built


def random_frames(rng, count, lo=1, hi=1500):
    return [rng.randbytes(rng.randint(lo, hi)) for _ in range(count)]


def send_all(model, rng, per_port, **kw):
    sent = {port: random_frames(rng, per_port, **kw) for port in range(model.ports)}
    for k in range(per_port):  # interleaved across ports, as traffic would come
        for port in range(model.ports):
            model.send(port, sent[port][k])
    return sent


def check_out(model, sent, out):
    got = {port: [] for port in range(model.ports)}
    for port, frame in out:
        got[port].append(frame)
    for port, frames in sent.items():
        tx = (port + 1) % model.ports
        assert len(got[tx]) == len(frames), f"rx{port} -> tx{tx}: frame count"
        for k, (want, have) in enumerate(zip(frames, got[tx])):
            assert have == want, f"rx{port} -> tx{tx}: frame {k} ({len(want)} bytes) differs"


def test_ports_and_width(model, width):
    assert (model.ports, model.width) == (PORTS, width)


def test_frames_in_equal_frames_out(model):
    rng = random.Random(model.width)
    sent = send_all(model, rng, 25)
    out = model.run(idle_cycles=100)
    check_out(model, sent, out)
    # Back to back at one beat per cycle: the busiest port sets the time.
    beats = max(sum(-(-len(f) // (model.width // 8)) for f in frames) for frames in sent.values())
    assert model.cycles <= beats + 100 + 20


def test_edge_lengths(model):
    """Lengths around the beat size: one byte, a beat less one, a beat, a beat and one."""
    size = model.width // 8
    lengths = [1, 2, size - 1, size, size + 1, 2 * size, 2 * size + 1, 60, 64, 1500, 9000]
    rng = random.Random(7)
    sent = {port: [rng.randbytes(n) for n in lengths] for port in range(model.ports)}
    for port in range(model.ports):
        for frame in sent[port]:
            model.send(port, frame)
    check_out(model, sent, model.run())


def test_backpressure_and_gaps(model):
    rng = random.Random(3)
    model.backpressure(pattern="0110100")
    model.gaps(pattern="1101")
    sent = send_all(model, rng, 10)
    check_out(model, sent, model.run(idle_cycles=200))
    patterned = model.cycles

    model.reset()
    model.backpressure(probability=0.3, seed=5)
    model.gaps(probability=0.7, seed=6)
    model.backpressure(port=2)  # one port always ready
    sent = send_all(model, rng, 10)
    check_out(model, sent, model.run(idle_cycles=200))
    assert model.cycles > 0 and patterned > 0


def test_backpressure_slows_down(model):
    rng = random.Random(4)
    frames = send_all(model, rng, 8, lo=1000, hi=1000)
    model.run(idle_cycles=100)
    free = model.cycles - 100
    model.reset()
    model.backpressure(pattern="01")
    for port in range(model.ports):
        for frame in frames[port]:
            model.send(port, frame)
    check_out(model, frames, model.run(idle_cycles=100))
    assert model.cycles - 100 > 1.8 * free


def test_step_counts_cycles_and_collects(model):
    model.send(1, b"x" * 300)
    out = model.step(3)
    assert model.cycles == 3 and out == []
    out = model.step(500)
    assert model.cycles == 503 and out == [(2, b"x" * 300)]
    assert model.queued(1) == 0
    model.reset()
    assert model.cycles == 0


def test_max_cycles_error(model):
    rng = random.Random(5)
    sent = send_all(model, rng, 4, lo=1500, hi=1500)
    with pytest.raises(SimulationTimeout, match="within 50 cycles") as info:
        model.run(max_cycles=50)
    assert "not fully taken in" in str(info.value)
    # The run goes on from where it stopped: nothing lost, nothing twice.
    out = info.value.frames + model.run()
    check_out(model, sent, out)


def test_stuck_sink_times_out(model):
    model.backpressure(port=1, pattern="0")  # tx1 never ready: rx0 fills its FIFO and stops
    model.send(0, bytes(4000))
    model.send(0, bytes(10))
    with pytest.raises(SimulationTimeout, match="port 0 has 2 frame"):
        model.run(max_cycles=2000)
    model.backpressure(port=1)
    out = model.run()
    assert out == [(1, bytes(4000)), (1, bytes(10))]


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="out of range"):
        model.send(PORTS, b"x")
    with pytest.raises(ValueError, match="1 to"):
        model.send(0, b"")
    with pytest.raises(ValueError, match="pattern"):
        model.backpressure(pattern="012")
    with pytest.raises(ValueError, match="probability"):
        model.gaps(probability=1.5)
    model.send(0, bytearray(b"abc"))  # bytes-like is taken as bytes
    assert model.run() == [(1, b"abc")]


def test_bench_functions(built):
    traffic = random_traffic(PORTS, 1024, per_port=4)
    cpp = built.bench_cpp(2048 * 3, traffic)
    py = built.bench_python(2048 * 3, traffic)
    assert cpp["cycles"] == py["cycles"] >= 2048 * 3 and cpp["cycles_per_s"] > 0
    # The same traffic: the same frames out, and all 4 ports at one beat per cycle.
    assert cpp["frames"] == py["frames"] and cpp["bytes"] == py["bytes"] > 0
    assert cpp["bytes"] > 0.9 * PORTS * cpp["cycles"] * built.width // 8
    one_port = built.bench_cpp(2048, [(3, bytes(100)), (3, bytes(1))])
    assert one_port["frames"] > 0 and built.cycles == 0
    result = bench("loopback", seconds=0.02, rounds=1, width=built.width, **PARAMS)
    assert result["python_cycles_per_s"] > 0 and result["cpp_cycles_per_s"] > 0
    assert result["ratio"] == pytest.approx(
        result["python_cycles_per_s"] / result["cpp_cycles_per_s"], rel=1e-2)
    assert result["python_frames_out"] == result["cpp_frames_out"]


def test_not_a_frame_top():
    with pytest.raises(ContractError, match="rx0_tdata"):
        SwitchModel("icrc", width=64)
