"""Where a target's source lives, which files are mutated, and the scratch copy a mutant runs from.

A target's source is a package (`engine` for the reference engine, `vllm` for vLLM) found
under a source root; `--paths` globs are relative to that root. A mutant never touches the
tree it was drawn from: `scratch_copy` copies the whole package into a temporary directory,
writes the mutated file there, and the mutant's process gets that directory first on its
PYTHONPATH, so `import engine` (or `import vllm`) loads the copy.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import shutil
from dataclasses import dataclass

from fuzz.errors import BadInput
from fuzz.mutate.points import Mutant, apply

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The reference engine's bookkeeping: scheduling, KV cache, batch preparation, PP stages,
# graph dispatch, attention metadata, speculative decoding and the engine loop.
DEFAULT_PATHS = ("engine/scheduler.py", "engine/kv_cache.py", "engine/kv_cache_utils.py", "engine/input_prep.py",
                 "engine/input_batch.py", "engine/pp_stage.py", "engine/graph_runner.py",
                 "engine/attention/metadata*.py", "engine/spec_decode.py", "engine/llm_engine.py")
# vLLM v1's counterparts.
VLLM_DEFAULT_PATHS = ("vllm/v1/core/sched/scheduler.py", "vllm/v1/core/kv_cache_manager.py",
                      "vllm/v1/core/block_pool.py", "vllm/v1/core/kv_cache_utils.py",
                      "vllm/v1/worker/gpu_input_batch.py", "vllm/v1/worker/block_table.py")
TARGETS = ("reference", "vllm")


@dataclass(frozen=True)
class Source:
    target: str
    root: str  # the directory holding the package
    package: str  # its top-level name: what the copy shadows on PYTHONPATH
    # Copy the package's __pycache__ too: vLLM is some 2600 modules, imported afresh by every
    # process it spawns; without its bytecode each import compiles them all again. A .pyc is
    # checked against its source's mtime and size, which the copy keeps (copy2); the mutated
    # file's own .pyc is deleted all the same.
    bytecode: bool = False

    def files(self, globs: tuple[str, ...]) -> list[str]:
        """The .py files the globs name, relative to the root, sorted; a glob that matches
        nothing, or a file outside the package, is bad input."""
        out: set[str] = set()
        for g in globs:
            hits = [os.path.relpath(p, self.root) for p in glob.glob(os.path.join(self.root, g), recursive=True)]
            hits = [h.replace(os.sep, "/") for h in hits if h.endswith(".py")]
            if not hits:
                raise BadInput(f"--paths: {g!r} matches no .py file under {self.root}")
            for h in hits:
                if not h.startswith(self.package + "/"):
                    raise BadInput(f"--paths: {h} is outside the {self.package} package")
            out.update(hits)
        return sorted(out)

    def read(self, rel: str) -> str:
        with open(os.path.join(self.root, rel), encoding="utf-8") as f:
            return f.read()


def find_source(target: str) -> Source:
    if target == "reference":
        return Source("reference", REPO_ROOT, "engine")
    if target == "vllm":
        spec = importlib.util.find_spec("vllm")  # finds the package without importing it
        if spec is None or not spec.submodule_search_locations:
            raise BadInput("--target vllm: vllm is not installed in this Python")
        pkg_dir = list(spec.submodule_search_locations)[0]
        return Source("vllm", os.path.dirname(pkg_dir), "vllm", bytecode=True)
    raise BadInput(f"--target: unknown target {target!r} (known: {', '.join(TARGETS)})")


def default_paths(target: str) -> tuple[str, ...]:
    return VLLM_DEFAULT_PATHS if target == "vllm" else DEFAULT_PATHS


def scratch_copy(src: Source, mutant: Mutant | None, into: str) -> str:
    """Copy `src`'s package into directory `into` (compiled files left out
    unless `src.bytecode`) with `mutant`
    applied to its file (None: the unmutated package, for the baseline); return `into`, the
    directory to put first on PYTHONPATH. The original tree is only read."""
    dest = os.path.join(into, src.package)
    skip = () if src.bytecode else ("__pycache__", "*.pyc")
    shutil.copytree(os.path.join(src.root, src.package), dest, ignore=shutil.ignore_patterns(*skip), symlinks=True)
    if mutant is not None:
        path = os.path.join(into, mutant.file)
        text = apply(src.read(mutant.file), mutant)
        where = os.path.dirname(path)
        os.chmod(where, os.stat(where).st_mode | 0o700)  # the copy keeps modes: a read-only install stays one
        os.unlink(path)  # then a new file: nothing is ever written through to the original
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        stem = os.path.splitext(os.path.basename(path))[0]
        for pyc in glob.glob(os.path.join(where, "__pycache__", f"{stem}.*.pyc")):
            os.unlink(pyc)  # the original's bytecode: never run for the mutant
    return into
