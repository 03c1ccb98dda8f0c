"""What every llmfuzz command shares: exit codes, the bad-input error, and reading the
common arguments (layouts, device and dtype, oracles, a reproducer file, a profile).

A leaf the CLI and the vLLM wing (fuzz/targets/) both import, so neither imports the other
for them.
"""
from __future__ import annotations

EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT, EXIT_UNWRITTEN, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class BadInput(Exception):
    """Reported as one line and exit code 2."""


def parse_layouts(text: str, base) -> list[str]:
    """'tp2pp4,pp8' -> canonical layout names, each checked against `base` (a one-line
    BadInput naming the bad one)."""
    from engine.config import ConfigError, layout_name, parse_layout

    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            tp, pp = parse_layout(item)
            base.replace(tensor_parallel_size=tp, pipeline_parallel_size=pp)
        except ConfigError as e:
            raise BadInput(str(e)) from None
        out.append(layout_name(tp, pp))
    if not out:
        raise BadInput("--layouts: empty list")
    return out


# -- what several commands read from their arguments (imports stay lazy: --help is fast) --

def base_config(args):
    from engine.config import ConfigError
    from fuzz.strategies import FUZZ_MODEL

    if args.device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise BadInput(f"--device {args.device}: CUDA is not available on this machine")
    try:
        return FUZZ_MODEL.replace(device=args.device, world=args.world, dtype=args.dtype,
                                  attention_backend=args.attention_backend)
    except ConfigError as e:
        raise BadInput(str(e)) from None


def oracles(args) -> frozenset[str]:
    """--oracle NAME[,NAME]: oracles that check every Case (fuzz/oracles/__init__.py)."""
    from fuzz.oracles import UnknownOracle, parse_oracles
    from fuzz.oracles.hf import available

    try:
        names = parse_oracles(getattr(args, "oracle", None))
    except UnknownOracle as e:
        raise BadInput(str(e)) from None
    if "transformers" in names and not available():
        raise BadInput("--oracle transformers: transformers is not installed (pip install transformers)")
    return names


def load(path: str):
    from fuzz.case import CaseFormatError
    from fuzz.reproduce import load_reproducer

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
    from fuzz.oracles import ORACLES
    from fuzz.oracles.hf import available

    return frozenset(o for o in ORACLES if o != "transformers" or available())
