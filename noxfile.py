"""nox sessions: tests (the README's test command), lint, bench."""

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.default_venv_backend = "venv"


@nox.session
def tests(session):
    session.install("-e", ".[test]")
    session.run("pytest", "-n", "2", "--dist", "loadgroup", *session.posargs)


@nox.session
def lint(session):
    session.install("ruff>=0.6")
    session.run("ruff", "check", "hw", "sim", "host", "tests", "noxfile.py")


@nox.session
def bench(session):
    session.install("-e", ".")
    session.run("netagg", "bench", "datapath", *session.posargs)
