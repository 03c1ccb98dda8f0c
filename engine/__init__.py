"""llmfuzz reference engine: a small vLLM-v1-shaped engine whose bugs are made on purpose.

The public names load on first use (PEP 562), so importing one submodule -- the FA contract,
say, which the guard loads into other engines' processes -- runs nothing else of the engine.
"""
from __future__ import annotations

import importlib

# name -> the module that defines it
_EXPORTS = {
    "ConfigError": "engine.config",
    "EngineConfig": "engine.config",
    "parse_layout": "engine.config",
    "EngineInvariantError": "engine.llm_engine",
    "LLMEngine": "engine.llm_engine",
    "Trace": "engine.llm_engine",
    "Schedule": "engine.schedule",
    "SamplingParams": "engine.sample.sampling_params",
}

__all__ = ["ConfigError", "EngineConfig", "EngineInvariantError", "LLMEngine", "SamplingParams", "Schedule",
           "Trace", "parse_layout"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        # Also how `from engine import cpu_graph` falls through to importing the submodule.
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
