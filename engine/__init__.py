"""llmfuzz reference engine: a small vLLM-v1-shaped engine whose bugs are made on purpose."""
from engine.config import ConfigError, EngineConfig, parse_layout
from engine.llm_engine import EngineInvariantError, LLMEngine, Trace
from engine.schedule import Schedule

__all__ = ["ConfigError", "EngineConfig", "EngineInvariantError", "LLMEngine", "Schedule", "Trace",
           "parse_layout"]
