"""The FA guard dump's layout on disk, shared by its writer and its reader.

A dump folder holds `call.json` (format tag FORMAT) and the tensor values, in
`tensors.safetensors` or, without safetensors, `tensors/<name>.npy`. Standard library only:
fuzz/guard/dump_write.py, fuzz/guard/dump_read.py and fuzz/guard/dump.py (check-fa) import it.
"""
from __future__ import annotations

FORMAT = "llmfuzz-fa-guard-dump/1"
CALL_JSON = "call.json"
SAFETENSORS_FILE = "tensors.safetensors"
NPY_DIR = "tensors"
_QKV = ("q", "k", "v")


class DumpError(Exception):
    """A folder that is not a readable FA guard dump."""
