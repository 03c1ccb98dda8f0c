"""FA guard dumps: one folder per violating call, and `llmfuzz check-fa DIR` to re-check them.

A dump folder holds `call.json` (the entry point, the violation, every argument by
parameter name: scalars as JSON, tensors as shape/stride/dtype/device, and how the call's
arguments map onto `check_varlen_args`) and the tensor values: `tensors.safetensors`, or
`tensors/<name>.npy` when safetensors is not installed (pickle-based torch.save is never
used). Index tensors (cu_seqlens, seqused_k, block_table, ...) are always stored by value;
float tensors (q, k, v, a KV cache) only within a byte budget, since the check looks at
their shape/stride/dtype only. A dump written during CUDA graph capture holds no values
(copying them would break the capture) and re-checks shapes only.

Folders are written under a `.tmp-` name and renamed into place, so a reader never sees a
half-written dump. This module imports torch only when it reads or writes a dump.

The pieces: fuzz/guard/dump_format.py (the layout), fuzz/guard/dump_write.py (write_dump),
fuzz/guard/dump_read.py (find_dumps, load_dump); this module re-checks dumps (recheck,
`llmfuzz check-fa`) and keeps all of their names importable from here.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from fuzz.guard.dump_format import _QKV, CALL_JSON, FORMAT, NPY_DIR, SAFETENSORS_FILE, DumpError
from fuzz.guard.dump_read import Dump, find_dumps, load_dump
from fuzz.guard.dump_write import write_dump

__all__ = ["CALL_JSON", "EXIT_BAD_INPUT", "EXIT_FAIL", "EXIT_OK", "FORMAT", "NPY_DIR", "SAFETENSORS_FILE", "Dump",
           "DumpError", "add_check_fa_parser", "check_fa", "cmd_check_fa", "find_dumps", "load_dump", "main",
           "recheck", "write_dump"]

EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2  # as fuzz/cli/main.py
# check_varlen_args' tensor parameters in the order it checks their devices.
_DEVICE_ORDER = ("k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table", "slot_mapping")


def recheck(dump: Dump):
    """Run the check on a dump again; return the FAInvariantError it raises now, or None.

    Full check_varlen_args when every index tensor's values were stored, else the
    host-visible subset (dumps written inside CUDA graph capture). q/k/v are meta tensors,
    so device agreement is checked afterwards from the recorded devices."""
    import torch

    from engine.attention.fa_contract import FAInvariantError, check_varlen_args, check_varlen_shapes

    kw = dict(dump.check_kwargs)
    values_missing = any(isinstance(v, torch.Tensor) and v.device.type == "meta"
                         for n, v in kw.items() if n not in _QKV)
    try:
        (check_varlen_shapes if values_missing else check_varlen_args)(**kw)
    except FAInvariantError as e:
        return e
    except TypeError as e:
        raise DumpError(f"{dump.path}: arguments do not fit check_varlen_args: {e}") from None
    qdev = dump.devices.get("q", "meta")
    for name in _DEVICE_ORDER:
        dev = dump.devices.get(name)
        if dev is not None and kw.get(name) is not None and "meta" not in (dev, qdev) and dev != qdev:
            return FAInvariantError(name, f"{name} is on {dev} but q is on {qdev}")
    return None


# -- CLI ------------------------------------------------------------------------------------
def _result(path: Path, dump: Dump, err) -> dict:
    recorded = (dump.violation or {}).get("line")
    line = f"{dump.target}: {err.message}" if err is not None else None
    return {"dump": str(path), "target": dump.target, "violation": line,
            "argument": getattr(err, "argument", None), "index": getattr(err, "index", None),
            "recorded": recorded, "host_only": dump.host_only}


def check_fa(path: str | os.PathLike) -> list[dict]:
    """Re-check every dump at path (one dump folder or a directory of them). DumpError
    before anything is checked if any of them cannot be read."""
    dumps = [(d, load_dump(d)) for d in find_dumps(path)]
    return [_result(d, dump, recheck(dump)) for d, dump in dumps]


def cmd_check_fa(args) -> int:
    """`llmfuzz check-fa DIR`: 0 every dump passes, 1 one shows a violation, 2 bad dir (one
    line on stderr, like fuzz/cli/main.py's BadInput, before anything is checked)."""
    try:
        results = check_fa(args.dir)
    except DumpError as e:
        print(f"llmfuzz: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for r in results:
            if r["violation"]:
                print(f"{r['dump']}: {r['violation']}" + (" (shapes only: no values in this dump)"
                                                           if r["host_only"] else ""))
            else:
                note = f"; recorded: {r['recorded']}" if r["recorded"] else ""
                print(f"{r['dump']}: ok: {r['target']} call passes the FA invariants{note}")
    return EXIT_FAIL if any(r["violation"] for r in results) else EXIT_OK


def add_check_fa_parser(subparsers) -> argparse.ArgumentParser:
    """Register `check-fa DIR` on an argparse subparsers object (fuzz/cli/main.py's build_parser)."""
    c = subparsers.add_parser("check-fa", help="re-check an FA guard dump: exit 1 if it shows a violation",
                              description="Re-check FA guard dumps (LLMFUZZ_FA_GUARD=dump) with "
                                          "check_varlen_args; print each violation on one line. "
                                          "Exit 0: passes, 1: a violation, 2: not a readable dump.")
    c.add_argument("dir", help="a dump folder (holding call.json) or the dump directory holding several")
    c.add_argument("--json", action="store_true", help="print the results as JSON")
    c.set_defaults(fn=cmd_check_fa)
    return c


def main(argv: list[str] | None = None) -> int:
    """`python -m fuzz.guard.dump DIR`: check-fa without the llmfuzz CLI."""
    p = argparse.ArgumentParser(prog="python -m fuzz.guard.dump")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_check_fa_parser(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv if argv[:1] == ["check-fa"] else ["check-fa", *argv])
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
