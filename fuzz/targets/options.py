"""A black-box target's switches that have no EngineConfig field. They travel in a Case's
`target_options`, so a reproducer carries them; each target's options are a frozen dataclass
with this mixin (fuzz.targets.vllm.configs.VLLMOptions, fuzz.targets.transformers_cb.configs.CBOptions)."""
from __future__ import annotations

from dataclasses import asdict, fields, replace


class TargetOptions:
    __slots__ = ()
    target = ""  # the Case target these options are for
    label = ""  # what an error calls them

    def to_dict(self) -> dict:
        """The fields that differ from the defaults (a default config has one form)."""
        d, default = asdict(self), asdict(type(self)())
        return {k: v for k, v in d.items() if v != default[k]}

    @classmethod
    def from_dict(cls, d: dict | None):
        d = dict(d or {})
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"{cls.label}: unknown field {unknown[0]!r}")
        return cls(**d)

    @classmethod
    def of(cls, case):
        """A Case's options (the defaults for a Case that has none)."""
        return cls.from_dict(case.target_options)

    def drawn_config(self, cfg):
        """The config workloads are drawn for (fuzz.cases.strategies.workloads): `cfg` with the
        EngineConfig fields these options stand for set as they are (a target's prefix caching
        decides how often prompts share prefixes)."""
        return cfg

    def on(self, case):
        """`case` for this target with these options."""
        return replace(case, target=self.target, target_options=self.to_dict())


DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def differing(cfg, default, spelled: dict[str, str]) -> str:
    """'-b16-s2': each field of `cfg` named in `spelled` whose value differs from `default`'s,
    in that order, as its format with the value in `{}` (a dtype by its short name). Cell
    names say only what differs from the target's model, so a default config has one name."""
    out = ""
    for name, fmt in spelled.items():
        value = getattr(cfg, name)
        if value != getattr(default, name):
            out += "-" + fmt.format(DTYPE_SHORT.get(value, value) if name == "dtype" else value)
    return out
