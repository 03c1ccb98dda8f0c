"""setuptools build hook: install `llmfuzz_guard.pth` at the top of site-packages.

A `.pth` file only works at the top of a site directory, and setuptools has no pyproject
setting that puts a file there portably (`[tool.setuptools.data-files]` installs relative
to the prefix: `{"" = [...]}` lands in the venv root, and spelling out
`lib/python3.X/site-packages` breaks on other Pythons, on Windows and on Debian's
dist-packages). This `build_py` writes the file into the build tree's root, which becomes
the wheel's root and so site-packages (`pip install .`, `python -m build`); in an editable
install (`pip install -e .`, setuptools >= 64) it writes it into the editable wheel beside
setuptools' own `__editable__.*.pth`. Its content is `fuzz.guard.autoinstall.PTH_LINE`,
so an sdist needs no extra MANIFEST entry. pip records it, so uninstalling removes it.

The build imports this module in the (isolated) build environment, which has setuptools
but not torch: `fuzz/__init__.py` and `fuzz/guard/autoinstall.py` must stay free of
third-party imports.

pyproject.toml:

    [tool.setuptools.cmdclass]
    build_py = "fuzz.guard.build.build_py"
"""
from __future__ import annotations

import os

from setuptools.command.build_py import build_py as _build_py

def _load_pth_constants() -> tuple[str, str]:
    # setuptools imports this file by path, without the project on sys.path (a fresh build
    # environment has no `fuzz` package): load the sibling module by path as well.
    import importlib.util

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "autoinstall.py")
    spec = importlib.util.spec_from_file_location("_llmfuzz_guard_autoinstall", here)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.PTH_LINE, mod.PTH_NAME


PTH_LINE, PTH_NAME = _load_pth_constants()


class build_py(_build_py):
    def _pth_dir(self) -> str:
        if getattr(self, "editable_mode", False):
            # setuptools' editable_wheel points `install` at the unpacked editable wheel; files
            # there go into the wheel as they are (build_lib is thrown away in that mode).
            install_lib = getattr(self.get_finalized_command("install"), "install_lib", None)
            if install_lib:
                return install_lib
        return self.build_lib

    def run(self) -> None:
        super().run()
        target = self._pth_dir()
        os.makedirs(target, exist_ok=True)
        path = os.path.join(target, PTH_NAME)
        with open(path, "w", encoding="utf-8") as f:
            f.write(PTH_LINE)
        self.announce(f"writing {path}", level=2)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, PTH_NAME))
        return outputs
