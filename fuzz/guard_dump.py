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
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

FORMAT = "llmfuzz-fa-guard-dump/1"
EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2  # as fuzz/cli.py
CALL_JSON = "call.json"
SAFETENSORS_FILE = "tensors.safetensors"
NPY_DIR = "tensors"
# check_varlen_args' tensor parameters in the order it checks their devices.
_DEVICE_ORDER = ("k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table", "slot_mapping")
_QKV = ("q", "k", "v")
_seq = itertools.count(1)


class DumpError(Exception):
    """A folder that is not a readable FA guard dump."""


# -- writing --------------------------------------------------------------------------------
def _slug(text: str, limit: int = 40) -> str:
    out = "".join(c if c.isalnum() or c in "-_" else "_" for c in text)
    return out[:limit].strip("_") or "call"


def _scalar(x):
    """A JSON entry for a non-tensor argument."""
    import torch

    if x is None or isinstance(x, (bool, str)):
        return {"value": x}
    if isinstance(x, int):
        return {"value": int(x)}
    if isinstance(x, float):
        return {"value": x} if math.isfinite(x) else {"float": repr(x)}
    if isinstance(x, (tuple, list)) and all(v is None or isinstance(v, (bool, int, float, str)) for v in x):
        return {"value": list(x), "tuple": isinstance(x, tuple)}
    if isinstance(x, (torch.dtype, torch.device)):
        return {"repr": str(x)}
    if hasattr(x, "__index__"):
        try:
            return {"value": x.__index__()}
        except TypeError:
            pass
    return {"repr": repr(x)[:500]}


def write_dump(dump_dir: str | os.PathLike, target: str, arguments: dict, check_kwargs: dict, *,
               violation=None, values: bool = True, max_float_bytes: int = 16 << 20) -> Path:
    """Write one call as a dump folder under dump_dir; return the folder's path.

    arguments: the call's arguments by parameter name. check_kwargs: the check_varlen_args
    arguments they map to (values identical to an argument are stored as a reference to it).
    violation: the FAInvariantError it raised (or None to record a call that passed).
    values=False stores no tensor values (inside CUDA graph capture)."""
    import torch

    root = Path(dump_dir)
    root.mkdir(parents=True, exist_ok=True)
    tensors, metas, by_id = {}, {}, {}
    budget = [max_float_bytes]

    def put(name: str, t: torch.Tensor) -> dict:
        if id(t) in by_id:
            return {"tensor": by_id[id(t)]}
        key = _slug(name, 80)
        while key in metas:
            key += "_"
        by_id[id(t)] = key
        meta = {"shape": list(t.shape), "stride": list(t.stride()), "storage_offset": t.storage_offset(),
                "dtype": str(t.dtype).removeprefix("torch."), "device": str(t.device), "saved": False}
        from engine.attention.fa_contract import is_fake

        keep = values and not is_fake(t) and not t.is_complex()
        if keep and t.is_floating_point():
            nbytes = t.numel() * t.element_size()
            keep = nbytes <= budget[0]
            budget[0] -= nbytes if keep else 0
        if keep:
            tensors[key] = t.detach().to("cpu", copy=True).contiguous()
            meta["saved"] = True
        metas[key] = meta
        return {"tensor": key}

    def enc(name: str, x) -> dict:
        return put(name, x) if isinstance(x, torch.Tensor) else _scalar(x)

    args_json = {name: enc(name, x) for name, x in arguments.items()}
    check_json = {}
    for name, x in check_kwargs.items():
        same = next((a for a, y in arguments.items() if y is x), None) if isinstance(x, torch.Tensor) else None
        check_json[name] = {"arg": same} if same is not None else enc(f"check.{name}", x)
    record = {
        "format": FORMAT, "target": target,
        "violation": None if violation is None else {
            "argument": violation.argument, "message": violation.message, "index": violation.index,
            "line": f"{target}: {violation.message}"},
        "host_only": not values, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid(),
        "torch": torch.__version__, "tensor_format": None,
        "arguments": args_json, "check": check_json, "tensors": metas,
    }
    stamp = time.strftime("%Y%m%d-%H%M%S")
    what = violation.argument if violation is not None else "pass"
    name = f"{stamp}-{os.getpid()}-{next(_seq):04d}-{_slug(target.rpartition('.')[2], 24)}-{_slug(what, 24)}"
    tmp = root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    if tensors:
        try:
            from safetensors.torch import save_file
        except ImportError:
            (tmp / NPY_DIR).mkdir()
            for key, t in tensors.items():
                _save_npy(tmp / NPY_DIR / f"{key}.npy", t)
            record["tensor_format"] = "npy"
        else:
            save_file(tensors, str(tmp / SAFETENSORS_FILE))
            record["tensor_format"] = "safetensors"
    with open(tmp / CALL_JSON, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    final = root / name
    while final.exists():
        final = root / f"{name}-{uuid.uuid4().hex[:4]}"
    os.rename(tmp, final)  # atomic: readers see the whole folder or none
    return final


def _save_npy(path: Path, t) -> None:
    import numpy as np
    import torch

    try:
        arr = t.numpy()
    except TypeError:  # bfloat16 / float8: store the bits, call.json has the dtype
        arr = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).numpy()
    np.save(path, arr, allow_pickle=False)


# -- reading --------------------------------------------------------------------------------
@dataclass
class Dump:
    path: Path
    target: str
    violation: dict | None
    host_only: bool
    arguments: dict  # parameter name -> value (tensors rebuilt on the CPU or as meta)
    check_kwargs: dict  # check_varlen_args arguments (q/k/v as meta tensors)
    devices: dict  # check_varlen_args tensor argument -> the device it was on
    record: dict


def find_dumps(path: str | os.PathLike) -> list[Path]:
    """The dump folders at path: path itself if it holds call.json, else its children that do."""
    p = Path(path)
    if not p.is_dir():
        raise DumpError(f"{path}: not a directory")
    if (p / CALL_JSON).is_file():
        return [p]
    found = sorted(c for c in p.iterdir() if c.is_dir() and not c.name.startswith(".tmp-")
                   and (c / CALL_JSON).is_file())
    if not found:
        raise DumpError(f"{path}: no FA guard dump here (no {CALL_JSON}, nor any folder holding one)")
    return found


def _dtype(name: str, where: str):
    import torch

    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise DumpError(f"{where}: unknown dtype {name!r}")
    return dt


def load_dump(path: str | os.PathLike) -> Dump:
    """Read a dump folder back; DumpError when it is not a complete, well-formed dump."""
    import torch

    p = Path(path)
    try:
        with open(p / CALL_JSON) as f:
            rec = json.load(f)
    except FileNotFoundError:
        raise DumpError(f"{p}: no {CALL_JSON}") from None
    except (OSError, ValueError) as e:
        raise DumpError(f"{p / CALL_JSON}: unreadable: {e}") from None
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        found = rec.get("format") if isinstance(rec, dict) else None
        raise DumpError(f"{p / CALL_JSON}: not an FA guard dump (format {found!r}, expected {FORMAT!r})")
    for key, typ in (("target", str), ("arguments", dict), ("check", dict), ("tensors", dict)):
        if not isinstance(rec.get(key), typ):
            raise DumpError(f"{p / CALL_JSON}: field {key!r} missing or not a {typ.__name__}")
    for name in ("q", "k", "v", "cu_seqlens_q", "max_seqlen_q", "max_seqlen_k"):
        if name not in rec["check"]:
            raise DumpError(f"{p / CALL_JSON}: check argument {name!r} missing")

    stored = {}
    fmt = rec.get("tensor_format")
    saved = [k for k, m in rec["tensors"].items() if isinstance(m, dict) and m.get("saved")]
    try:
        if saved and fmt == "safetensors":
            from safetensors.torch import load_file

            stored = load_file(str(p / SAFETENSORS_FILE))
        elif saved and fmt == "npy":
            import numpy as np

            stored = {k: torch.from_numpy(np.load(p / NPY_DIR / f"{k}.npy", allow_pickle=False)) for k in saved}
        elif saved:
            raise DumpError(f"{p / CALL_JSON}: tensor_format {fmt!r} unknown")
    except DumpError:
        raise
    except ImportError as e:
        raise DumpError(f"{p}: cannot read {fmt} tensors here: {e}") from None
    except Exception as e:
        raise DumpError(f"{p}: tensor file unreadable: {type(e).__name__}: {e}") from None

    tensors, meta_only = {}, {}
    for key, m in rec["tensors"].items():
        where = f"{p / CALL_JSON}: tensor {key!r}"
        try:
            shape, stride = [int(s) for s in m["shape"]], [int(s) for s in m["stride"]]
            dtype = _dtype(m["dtype"], where)
        except (KeyError, TypeError, ValueError) as e:
            raise DumpError(f"{where}: bad metadata ({e})") from None
        if len(shape) != len(stride):
            raise DumpError(f"{where}: shape {shape} and stride {stride} differ in rank")
        meta_only[key] = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        if not m.get("saved"):
            continue
        vals = stored.get(key)
        if vals is None:
            raise DumpError(f"{p}: tensor {key!r} is marked saved but missing from the tensor file")
        if vals.dtype != dtype:
            if vals.element_size() != torch.empty((), dtype=dtype).element_size():
                raise DumpError(f"{where}: stored as {vals.dtype}, recorded {dtype}")
            vals = vals.view(dtype)
        if vals.numel() != math.prod(shape):
            raise DumpError(f"{where}: {vals.numel()} values stored for shape {shape}")
        try:  # keep the recorded strides: the check looks at stride(-1)
            t = torch.empty_strided(shape, stride, dtype=dtype)
            t.copy_(vals.reshape(shape))
        except RuntimeError:
            t = vals.reshape(shape).clone()
        tensors[key] = t

    def dec(entry, where: str, meta_qkv: bool = False):
        if not isinstance(entry, dict):
            raise DumpError(f"{p / CALL_JSON}: {where}: malformed entry {entry!r}")
        if "tensor" in entry:
            key = entry["tensor"]
            if key not in meta_only:
                raise DumpError(f"{p / CALL_JSON}: {where}: unknown tensor {key!r}")
            return meta_only[key] if meta_qkv else tensors.get(key, meta_only[key])
        if "value" in entry:
            v = entry["value"]
            return tuple(v) if entry.get("tuple") else v
        if "float" in entry:
            return float(entry["float"])
        if "repr" in entry:
            return entry["repr"]
        raise DumpError(f"{p / CALL_JSON}: {where}: malformed entry {entry!r}")

    arguments = {name: dec(e, f"argument {name!r}") for name, e in rec["arguments"].items()}
    check, devices = {}, {}
    for name, e in rec["check"].items():
        entry = e
        if isinstance(e, dict) and "arg" in e:
            if e["arg"] not in rec["arguments"]:
                raise DumpError(f"{p / CALL_JSON}: check {name!r} refers to unknown argument {e['arg']!r}")
            entry = rec["arguments"][e["arg"]]
        # q/k/v are only looked at for shape/dtype/stride: rebuild them as meta, as
        # FACallRecord.varlen_args does for recorded calls.
        check[name] = dec(entry, f"check {name!r}", meta_qkv=name in _QKV)
        if isinstance(entry, dict) and "tensor" in entry:
            devices[name] = rec["tensors"][entry["tensor"]].get("device", "meta")
    viol = rec.get("violation")
    return Dump(p, rec["target"], viol if isinstance(viol, dict) else None, bool(rec.get("host_only")),
                arguments, check, devices, rec)


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
    line on stderr, like fuzz/cli.py's BadInput, before anything is checked)."""
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
    """Register `check-fa DIR` on an argparse subparsers object (fuzz/cli.py's build_parser)."""
    c = subparsers.add_parser("check-fa", help="re-check an FA guard dump: exit 1 if it shows a violation",
                              description="Re-check FA guard dumps (LLMFUZZ_FA_GUARD=dump) with "
                                          "check_varlen_args; print each violation on one line. "
                                          "Exit 0: passes, 1: a violation, 2: not a readable dump.")
    c.add_argument("dir", help="a dump folder (holding call.json) or the dump directory holding several")
    c.add_argument("--json", action="store_true", help="print the results as JSON")
    c.set_defaults(fn=cmd_check_fa)
    return c


def main(argv: list[str] | None = None) -> int:
    """`python -m fuzz.guard_dump DIR`: check-fa without the llmfuzz CLI."""
    p = argparse.ArgumentParser(prog="python -m fuzz.guard_dump")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_check_fa_parser(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv if argv[:1] == ["check-fa"] else ["check-fa", *argv])
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
