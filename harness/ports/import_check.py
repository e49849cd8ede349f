"""A port's import, tried once in a child process before any work.

A port file runs arbitrary code when imported: it may raise, but it may also
call sys.exit(0), os._exit or crash the interpreter. Tried in the parent or in
a sweep worker, an exit at import ended ddcheck with the port's exit code (a
green gate with no output). Here the child reports success with a nonce it
alone knows; a child that exits in any other way, whatever its code, is a
port-import failure, said in one line (a PortError: exit 2).

Layer: ports. Imports the engine and below; never faults, check, report, workflows or cli."""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

from harness.ports.protocol import PortError

IMPORT_TIMEOUT_S = 600   # an 8B-sized SGLang import on a loaded machine takes well under this
_NONCE_ENV = "DDCHECK_PORT_IMPORT_NONCE"


def check_port_imports(labels) -> None:
    """Each distinct FAMILY:PATH loads in a child process as a run would load
    it (harness.ports.registry.load_adapter); PortError otherwise."""
    for label in dict.fromkeys(x for x in labels if x):
        _check_one(label)


def _check_one(label: str) -> None:
    nonce = secrets.token_hex(16)
    root = str(Path(__file__).resolve().parents[2])   # the checkout holding this harness package
    env = {**os.environ, _NONCE_ENV: nonce,
           "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    if "TRITON_INTERPRET" not in env:
        import torch
        if not torch.cuda.is_available():
            env["TRITON_INTERPRET"] = "1"   # as the run itself imports triton
    try:
        proc = subprocess.run([sys.executable, "-m", "harness.ports.import_check", label], env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=IMPORT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PortError(f"--impl {label}: the port's import did not finish in {IMPORT_TIMEOUT_S} s") from None
    reply = [ln[len(nonce) + 1:] for ln in proc.stdout.decode(errors="replace").splitlines()
             if ln.startswith(nonce + " ")]
    if proc.returncode == 0 and reply == ["imported"]:
        return
    if reply and reply[-1].startswith("error "):
        raise PortError(reply[-1][len("error "):])
    how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exited with code {proc.returncode}"
    raise PortError(f"--impl {label}: port import failed: the process importing it {how} before the import "
                    "finished (does the port call sys.exit or os._exit when imported?)")


def _child(label: str) -> None:
    """In the child: load the port, then say so with the parent's nonce."""
    nonce = os.environ.pop(_NONCE_ENV)   # out of the port's sight before it runs
    out = os.fdopen(os.dup(1), "w")
    from harness.ports.registry import load_adapter, parse_impl
    try:
        load_adapter(parse_impl(label))
    except PortError as e:
        out.write(f"{nonce} error {' '.join(str(e).split())}\n")
        out.flush()
        return
    out.write(f"{nonce} imported\n")
    out.flush()


if __name__ == "__main__":
    _child(sys.argv[1])
