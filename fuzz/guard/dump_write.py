"""Writing FA guard dumps: one folder per call, `call.json` and the tensor values.

Index tensors (cu_seqlens, seqused_k, block_table, ...) are always stored by value; float
tensors (q, k, v, a KV cache) only within a byte budget, since the check looks at their
shape/stride/dtype only. A dump written during CUDA graph capture holds no values (copying
them would break the capture). Folders are written under a `.tmp-` name and renamed into
place, so a reader never sees a half-written dump. torch is imported only when writing.
The layout is fuzz/guard/dump_format.py's; fuzz/guard/dump_read.py reads it back.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import time
import uuid
from pathlib import Path

from fuzz.guard.dump_format import CALL_JSON, FORMAT, NPY_DIR, SAFETENSORS_FILE

_seq = itertools.count(1)


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
    root = Path(dump_dir)
    root.mkdir(parents=True, exist_ok=True)
    enc = _Encoder(values, max_float_bytes)
    args_json = {name: enc(name, x) for name, x in arguments.items()}
    check_json = _encode_check(enc, arguments, check_kwargs)
    record = _record(target, violation, values, args_json, check_json, enc.metas)
    return _write_folder(root, _folder_name(target, violation), record, enc.tensors)


class _Encoder:
    """Arguments as call.json entries. Each tensor is recorded once (by identity) under a
    unique key; its values are kept for the tensor file when `values`, floats only within
    the byte budget."""

    def __init__(self, values: bool, max_float_bytes: int) -> None:
        self.values = values
        self.tensors, self.metas, self.by_id = {}, {}, {}
        self.budget = max_float_bytes

    def __call__(self, name: str, x) -> dict:
        import torch

        return self.put(name, x) if isinstance(x, torch.Tensor) else _scalar(x)

    def put(self, name: str, t) -> dict:
        if id(t) in self.by_id:
            return {"tensor": self.by_id[id(t)]}
        key = _slug(name, 80)
        while key in self.metas:
            key += "_"
        self.by_id[id(t)] = key
        meta = {"shape": list(t.shape), "stride": list(t.stride()), "storage_offset": t.storage_offset(),
                "dtype": str(t.dtype).removeprefix("torch."), "device": str(t.device), "saved": False}
        from engine.attention.fa_contract import is_fake

        keep = self.values and not is_fake(t) and not t.is_complex()
        if keep and t.is_floating_point():
            nbytes = t.numel() * t.element_size()
            keep = nbytes <= self.budget
            self.budget -= nbytes if keep else 0
        if keep:
            self.tensors[key] = t.detach().to("cpu", copy=True).contiguous()
            meta["saved"] = True
        self.metas[key] = meta
        return {"tensor": key}


def _encode_check(enc: _Encoder, arguments: dict, check_kwargs: dict) -> dict:
    """check_varlen_args' arguments; a tensor that is one of the call's arguments is stored
    as a reference to it."""
    import torch

    check_json = {}
    for name, x in check_kwargs.items():
        same = next((a for a, y in arguments.items() if y is x), None) if isinstance(x, torch.Tensor) else None
        check_json[name] = {"arg": same} if same is not None else enc(f"check.{name}", x)
    return check_json


def _record(target: str, violation, values: bool, args_json: dict, check_json: dict, metas: dict) -> dict:
    """call.json's content (its tensor_format is set once the values are written)."""
    import torch

    return {
        "format": FORMAT, "target": target,
        "violation": None if violation is None else {
            "argument": violation.argument, "message": violation.message, "index": violation.index,
            "line": f"{target}: {violation.message}"},
        "host_only": not values, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid(),
        "torch": torch.__version__, "tensor_format": None,
        "arguments": args_json, "check": check_json, "tensors": metas,
    }


def _folder_name(target: str, violation) -> str:
    """Unique and sortable: time, pid, sequence number, entry point, bad argument."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    what = violation.argument if violation is not None else "pass"
    return f"{stamp}-{os.getpid()}-{next(_seq):04d}-{_slug(target.rpartition('.')[2], 24)}-{_slug(what, 24)}"


def _write_folder(root: Path, name: str, record: dict, tensors: dict) -> Path:
    """Write the folder under a `.tmp-` name, then rename it into place."""
    tmp = root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    if tensors:
        record["tensor_format"] = _save_tensors(tmp, tensors)
    with open(tmp / CALL_JSON, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    final = root / name
    while final.exists():
        final = root / f"{name}-{uuid.uuid4().hex[:4]}"
    os.rename(tmp, final)  # atomic: readers see the whole folder or none
    return final


def _save_tensors(folder: Path, tensors: dict) -> str:
    """Write the kept tensor values into folder; return the tensor_format written."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        (folder / NPY_DIR).mkdir()
        for key, t in tensors.items():
            _save_npy(folder / NPY_DIR / f"{key}.npy", t)
        return "npy"
    save_file(tensors, str(folder / SAFETENSORS_FILE))
    return "safetensors"


def _save_npy(path: Path, t) -> None:
    import numpy as np
    import torch

    try:
        arr = t.numpy()
    except TypeError:  # bfloat16 / float8: store the bits, call.json has the dtype
        arr = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).numpy()
    np.save(path, arr, allow_pickle=False)
