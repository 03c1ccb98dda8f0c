"""Reading the arguments every llmfuzz command shares: layouts, device and dtype, the
attention kernels, oracles, a reproducer file, a profile. Bad input is a one-line BadInput."""
from __future__ import annotations

import sys

from fuzz.errors import BadInput


def parse_layouts(text: str, base) -> list[str]:
    """'tp2pp4,pp8' -> canonical layout names, each checked against `base` (a one-line
    BadInput naming the bad one)."""
    from engine.config import ConfigError, parse_layouts as parse

    try:
        out = parse(text, base)
    except ConfigError as e:
        raise BadInput(str(e)) from None
    if not out:
        raise BadInput("--layouts: empty list")
    return out


# -- what several commands read from their arguments (imports stay lazy: --help is fast) --

def _require_cuda(args) -> None:
    if args.device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise BadInput(f"--device {args.device}: CUDA is not available on this machine")


def _kernels_and_dtype(args, several: bool) -> tuple[list[str], str]:
    """--attention-backend and --dtype with their device defaults. CPU: the reference backend
    in float32. CUDA: what users run, bf16 on the real kernels (torch_flash, plus flash_attn
    when the flash-attn package is importable and `several` kernels are wanted); an explicit
    float32/float64 or `--attention-backend reference` is the old leg, fp32 reference."""
    given = [k.strip() for k in (getattr(args, "attention_backend", None) or "").split(",") if k.strip()]
    if len(given) > 1 and not several:
        raise BadInput(f"--attention-backend: this command takes one kernel, not {','.join(given)}")
    dtype = getattr(args, "dtype", None)
    cuda = args.device != "cpu"
    if not given:
        if not cuda or dtype in ("float32", "float64"):
            given = ["reference"]
        else:
            given = ["torch_flash"]
            if several:
                from engine.attention.flash_attn_backend import INSTALL_HINT
                from engine.attention.selector import FlashAttnBackend

                if FlashAttnBackend.unavailable() is None:
                    given.append("flash_attn")
                else:
                    print(f"llmfuzz: flash_attn is not importable ({INSTALL_HINT}): fuzzing torch_flash only",
                          file=sys.stderr)
    if dtype is None:
        dtype = "bfloat16" if cuda and given != ["reference"] else "float32"
    return given, dtype


def base_configs(args, several: bool = True) -> list:
    """One base config per attention kernel the command fuzzes (`run`: kernels are cells of
    the campaign); prints one line naming the flash-attn entry point when flash_attn is one."""
    from engine.attention.selector import get_attn_backend_cls
    from engine.config import ConfigError
    from fuzz.cases.strategies import FUZZ_MODEL

    named = [k.strip() for k in (getattr(args, "attention_backend", None) or "").split(",") if k.strip()]
    try:
        # The backend selector first: a package to install needs no GPU to say so.
        for k in named:
            get_attn_backend_cls(k)
        _require_cuda(args)
        kernels, dtype = _kernels_and_dtype(args, several)
        out = [FUZZ_MODEL.replace(device=args.device, world=args.world, dtype=dtype, attention_backend=k)
               for k in kernels]
    except ConfigError as e:
        raise BadInput(str(e)) from None
    if "flash_attn" in kernels:
        from engine.attention.flash_attn_backend import probe

        print(f"llmfuzz: {probe().line()}", file=sys.stderr)
    return out


def base_config(args):
    return base_configs(args, several=False)[0]


def oracles(args) -> frozenset[str]:
    """--oracle NAME[,NAME]: oracles that check every Case (fuzz/verdict/oracles/__init__.py)."""
    from fuzz.verdict.oracles import UnknownOracle, parse_oracles
    from fuzz.verdict.oracles.hf import available

    try:
        names = parse_oracles(getattr(args, "oracle", None))
    except UnknownOracle as e:
        raise BadInput(str(e)) from None
    if "transformers" in names and not available():
        raise BadInput("--oracle transformers: transformers is not installed (pip install transformers)")
    return names


def load(path: str):
    from fuzz.cases.case import CaseFormatError
    from fuzz.campaign.reproduce import load_reproducer

    try:
        repro = load_reproducer(path)
    except CaseFormatError as e:
        raise BadInput(str(e)) from None
    if repro.case.config.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise BadInput(f"{path}: the case runs on {repro.case.config.device}, and CUDA is not available here")
    return repro


def load_profile(name: str | None) -> str:
    from fuzz import profiles

    try:
        return profiles.load(name)
    except ValueError as e:
        raise BadInput(str(e)) from None


def replay_oracles() -> frozenset[str]:
    from fuzz.verdict.oracles import ORACLES
    from fuzz.verdict.oracles.hf import available

    return frozenset(o for o in ORACLES if o != "transformers" or available())


def poison(args) -> str | None:
    """--poison: what every engine reset leaves in memory (engine/poison.py); "both" (the
    default): each Case draws NaN or stale, so a campaign alternates them."""
    from engine.poison import POISON_MODES

    if args.poison not in (*POISON_MODES, "both"):
        raise BadInput(f"--poison: {args.poison!r} is not one of {', '.join(POISON_MODES)}, both")
    return None if args.poison == "both" else args.poison
