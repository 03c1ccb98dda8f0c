"""Reading FA guard dumps back: `call.json` and the stored tensor values, as a `Dump`.

Index tensors come back with their values (on the CPU, with the recorded strides); tensors
stored without values, and q/k/v for the check, come back as meta tensors. torch is imported
only when reading. The layout is fuzz/guard/dump_format.py's; fuzz/guard/dump.py re-checks.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from fuzz.guard.dump_format import _QKV, CALL_JSON, FORMAT, NPY_DIR, SAFETENSORS_FILE, DumpError


@dataclass
class Dump:
    """One dump folder, read back."""

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


def load_dump(path: str | os.PathLike) -> Dump:
    """Read a dump folder back; DumpError when it is not a complete, well-formed dump."""
    p = Path(path)
    rec = _read_record(p)
    tensors, meta_only = _rebuild_tensors(p, rec, _load_stored(p, rec))
    dec = _decoder(p / CALL_JSON, tensors, meta_only)
    arguments = {name: dec(e, f"argument {name!r}") for name, e in rec["arguments"].items()}
    check, devices = _decode_check(p / CALL_JSON, rec, dec)
    viol = rec.get("violation")
    return Dump(p, rec["target"], viol if isinstance(viol, dict) else None, bool(rec.get("host_only")),
                arguments, check, devices, rec)


def _read_record(p: Path) -> dict:
    """call.json, with the fields the rest of the reading relies on."""
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
    return rec


def _load_stored(p: Path, rec: dict) -> dict:
    """The tensor values the dump saved, by key, as the tensor file holds them."""
    import torch

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
    return stored


def _rebuild_tensors(p: Path, rec: dict, stored: dict) -> tuple[dict, dict]:
    """(tensors with values, with the recorded strides; every tensor as a meta tensor)."""
    import torch

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
    return tensors, meta_only


def _decoder(call_json: Path, tensors: dict, meta_only: dict):
    """dec(entry, where, meta_qkv=False): one call.json entry back to its value."""

    def dec(entry, where: str, meta_qkv: bool = False):
        if not isinstance(entry, dict):
            raise DumpError(f"{call_json}: {where}: malformed entry {entry!r}")
        if "tensor" in entry:
            key = entry["tensor"]
            if key not in meta_only:
                raise DumpError(f"{call_json}: {where}: unknown tensor {key!r}")
            return meta_only[key] if meta_qkv else tensors.get(key, meta_only[key])
        if "value" in entry:
            v = entry["value"]
            return tuple(v) if entry.get("tuple") else v
        if "float" in entry:
            return float(entry["float"])
        if "repr" in entry:
            return entry["repr"]
        raise DumpError(f"{call_json}: {where}: malformed entry {entry!r}")

    return dec


def _decode_check(call_json: Path, rec: dict, dec) -> tuple[dict, dict]:
    """check_varlen_args' arguments (references to call arguments resolved), and the
    device each tensor among them was on."""
    check, devices = {}, {}
    for name, e in rec["check"].items():
        entry = e
        if isinstance(e, dict) and "arg" in e:
            if e["arg"] not in rec["arguments"]:
                raise DumpError(f"{call_json}: check {name!r} refers to unknown argument {e['arg']!r}")
            entry = rec["arguments"][e["arg"]]
        # q/k/v are only looked at for shape/dtype/stride: rebuild them as meta, as
        # FACallRecord.varlen_args does for recorded calls.
        check[name] = dec(entry, f"check {name!r}", meta_qkv=name in _QKV)
        if isinstance(entry, dict) and "tensor" in entry:
            devices[name] = rec["tensors"][entry["tensor"]].get("device", "meta")
    return check, devices


def _dtype(name: str, where: str):
    import torch

    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise DumpError(f"{where}: unknown dtype {name!r}")
    return dt
