"""Load a port's module from the user's file by path.

Utility modules of a serving stack import the server at module level
(schedulers, model runners, server args) for type hints or helpers they do
not need to build a tree or a mask. Such an import is tried for real first;
only when it fails is it replaced by a stub, and every stub is reported, so a
port that really needs the server fails loudly when it touches one.


Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
import types
from dataclasses import dataclass
from pathlib import Path

from harness.ports.protocol import PortError

# a loaded port's module name starts so (crash attribution tells the port's own frames by it)
PORT_MODULE_PREFIX = "ddcheck_port_"
# top-level packages whose submodules may be stubbed when they fail to import
STUBBABLE = ("sglang", "sgl_kernel", "vllm", "flashinfer", "sgl_kernel_npu")


class _Stub:
    """Stands for anything a stubbed module exports: a class to subclass, a
    decorator (returns the function it is given), a constant, a type hint."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return _Stub()

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub()

    def __getitem__(self, item):
        return _Stub()

    def __or__(self, other):
        return _Stub()

    __ror__ = __or__

    def __bool__(self) -> bool:
        return False


class _StubMeta(type):
    """A stubbed name is a class (so it can be subclassed or used in a type
    hint) that also works as a decorator and has any attribute."""

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]) and cls.__module__ == __name__:
            return args[0]
        return super().__call__(*args, **kwargs)

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub()


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {"__module__": __name__})


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []   # a package, so that deeper imports resolve too
        return mod

    def exec_module(self, module) -> None:
        pass


class _StubFinder(importlib.abc.MetaPathFinder):
    """Last on sys.meta_path: only imports that nothing else could find reach it."""

    def __init__(self) -> None:
        self.stubbed: list[str] = []

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] not in STUBBABLE:
            return None
        self.stubbed.append(fullname)
        return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)


@dataclass(frozen=True)
class LoadedPort:
    module: types.ModuleType
    path: Path
    stubbed: tuple[str, ...]   # server modules replaced by stubs


def load_port_module(path: Path) -> LoadedPort:
    """Execute the user's file as a fresh module; PortError when it cannot be read or run."""
    path = Path(path)
    if not path.is_file():
        raise PortError(f"port file {path} does not exist")
    name = PORT_MODULE_PREFIX + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PortError(f"{path} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # dataclasses and pickling look the module up while it runs
    finder = _StubFinder()
    sys.meta_path.append(finder)
    failed: list[str] = []
    try:
        _retry_failing_imports(spec, module, failed)
    except PortError:
        sys.modules.pop(name, None)
        raise
    except Exception as e:  # noqa: BLE001  (the user's module failed at import: say where, exit 2)
        sys.modules.pop(name, None)
        raise PortError(f"{path} failed to import: {type(e).__name__}: {e}".splitlines()[0]) from None
    except SystemExit as e:   # an exit at import is a failure, never the run's own exit (code 0 was a pass)
        sys.modules.pop(name, None)
        raise PortError(f"{path}: port import failed: it called sys.exit({e.code!r}) while being imported") from None
    finally:
        sys.meta_path.remove(finder)
        # the port keeps what it took from its stubs; the process does not (a later load, or a real
        # import of the same name, must not find a stub)
        for name in finder.stubbed + failed:
            if isinstance(sys.modules.get(name), _StubModule):
                del sys.modules[name]
    return LoadedPort(module, path, tuple(dict.fromkeys(finder.stubbed + failed)))


def _retry_failing_imports(spec, module, failed: list[str]) -> None:
    """Run the module; a server import that exists but raises on import
    (missing CUDA, missing optional deps) is stubbed and the module re-run."""
    for _ in range(32):
        try:
            spec.loader.exec_module(module)
            return
        except Exception as e:  # noqa: BLE001  (an import of the server may raise anything)
            broken = _broken_server_module(e)
            if broken is None or broken in failed:
                raise
            failed.append(broken)
            for mod in [m for m in sys.modules if m == broken or m.startswith(broken + ".")]:
                del sys.modules[mod]
            sys.modules[broken] = _StubLoader().create_module(importlib.machinery.ModuleSpec(broken, None))
    raise PortError(f"{spec.origin}: too many server imports fail")


def _broken_server_module(e: Exception) -> str | None:
    """The server module whose import raised (walk the traceback for the
    outermost stubbable module being imported)."""
    tb = e.__traceback__
    while tb is not None:
        mod = tb.tb_frame.f_globals.get("__name__", "")
        if mod.split(".")[0] in STUBBABLE:
            return mod
        tb = tb.tb_next
    name = getattr(e, "name", None) or ""
    return name if name.split(".")[0] in STUBBABLE else None


def require(module: types.ModuleType, path: Path, *names: str):
    """The named functions of the port, or a one-line error naming the missing one."""
    found = []
    for n in names:
        fn = getattr(module, n, None)
        if not callable(fn):
            raise PortError(f"{path}: no function {n}() (the adapter needs {', '.join(names)})")
        found.append(fn)
    return found[0] if len(found) == 1 else tuple(found)


def parameters(fn) -> list[str]:
    """Parameter names of a port function, to tell its versions apart."""
    return list(inspect.signature(fn).parameters)
