"""The package's modules talk through public names: no module reads or calls a private
attribute (`_name`, not a dunder) that another module of `netagg` defines, on anything but
`self`, `cls` or `super()`, nor imports another module's private name
(`from netagg.sim.golden import _signed`).

The scan is by the source (`ast`), without importing anything:

- A module *owns* a private attribute name when one of its classes defines it (a method, a
  class variable, or `self._name = ...` in a method) or it is one of the module's own
  top-level names (read through the module object: `module._name`).
- `base._name` in module U is a crossing when U does not own `_name` as an attribute (for
  `module._name`, when `module` is not U's own import of the module that defines it) and
  another module of the package does. A private name no module of the package defines is a
  library's (`os._exit`, cocotb's `dut._log`, amaranth's `_driving`): not the package's to
  rename, and not scanned.

A name two modules both own (two classes with their own `_state`) is taken as the using
module's own: the scan cannot tell the objects' classes apart without running the code.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "netagg"

# (module, attribute): crossings kept on purpose, each with its reason. Empty: none is.
ALLOWED: dict[tuple[str, str], str] = {}

# `collections.namedtuple`'s own public methods and fields, underscored only so that they
# cannot clash with a tuple's field names (`Extension._make(...)`): not private.
NAMEDTUPLE = {"_make", "_replace", "_asdict", "_fields", "_field_defaults"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) \
        and name not in NAMEDTUPLE


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


class _Module:
    """One module's source: the private attribute names its classes define, its top-level
    names, the module each local name imports, and every private attribute it reads."""

    def __init__(self, path: Path):
        self.path, self.name = path, _module_name(path)
        self.tree = ast.parse(path.read_text(), str(path))
        self.attributes: set[str] = set()       # defined by its classes
        self.top: set[str] = set()              # its top-level names
        self.imports: dict[str, str] = {}       # local name -> module it names
        for node in self.tree.body:
            self.top.update(_bound(node))
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    self.attributes.update(_bound(item))
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) \
                            and isinstance(sub.value, ast.Name) \
                            and sub.value.id in ("self", "cls"):
                        self.attributes.add(sub.attr)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.imports[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def private_imports(self):
        """Every `from netagg... import _name`: (line, module, name)."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] == "netagg":
                for alias in node.names:
                    if _private(alias.name):
                        yield node.lineno, node.module, alias.name

    def reads(self):
        """Every `base._name` on a base other than self, cls and super(): (line, base as
        text, the local name of the base if a plain name, attribute)."""
        for node in ast.walk(self.tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) \
                    and base.func.id in ("super", "type"):
                continue
            local = base.id if isinstance(base, ast.Name) else None
            yield node.lineno, ast.unparse(base), local, node.attr


def _bound(node: ast.stmt) -> set[str]:
    """The names a class-body or module-level statement binds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    targets = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def crossings() -> list[str]:
    modules = [_Module(p) for p in sorted(PACKAGE.rglob("*.py"))]
    by_name = {m.name: m for m in modules}
    owners: dict[str, set[str]] = defaultdict(set)
    for m in modules:
        for attr in m.attributes:
            owners[attr].add(m.name)
    found = []
    for m in modules:
        for line, module, name in m.private_imports():
            if module != m.name and (m.name, name) not in ALLOWED:
                found.append(f"{m.path.relative_to(PACKAGE.parent)}:{line}: "
                             f"from {module} import {name}")
        for line, base, local, attr in m.reads():
            if (m.name, attr) in ALLOWED:
                continue
            imported = by_name.get(m.imports.get(local, "")) if local else None
            if imported is not None:            # a module's top-level private name
                if imported is not m and attr in imported.top:
                    found.append(f"{m.path.relative_to(PACKAGE.parent)}:{line}: "
                                 f"{base}.{attr} (top-level in {imported.name})")
                continue
            others = owners.get(attr, set()) - {m.name}
            if others and attr not in m.attributes:
                found.append(f"{m.path.relative_to(PACKAGE.parent)}:{line}: {base}.{attr} "
                             f"(defined in {', '.join(sorted(others))})")
    return found


def test_no_private_attribute_crosses_a_module():
    found = crossings()
    assert not found, ("private attributes read across modules (make them public, with a name "
                       "from the domain, or move the code to the module that owns them):\n"
                       + "\n".join(found))


def test_the_scan_sees_a_crossing(tmp_path, monkeypatch):
    """The scan itself: a read of another module's private method is found, one of its own
    class's, of self's, or of a library's is not."""
    pkg = tmp_path / "netagg"
    pkg.mkdir()
    (pkg / "a.py").write_text("class A:\n    def _step(self):\n        self._n = 1\n"
                              "_TABLE = {}\n")
    (pkg / "b.py").write_text("import os\nfrom netagg import a\nfrom netagg.a import _TABLE\n\n"
                              "class B:\n    def _own(self):\n        pass\n\n"
                              "def f(x, y):\n    x._step()\n    y._own()\n    os._exit(0)\n"
                              "    return a._TABLE, x._n\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    found = sorted(f.split(": ", 1)[1] for f in crossings())
    assert found == ["a._TABLE (top-level in netagg.a)", "from netagg.a import _TABLE",
                     "x._n (defined in netagg.a)", "x._step (defined in netagg.a)"]
