"""The engine: sequences, scheduler, model runner, and the schedule -> propose -> verify -> postprocess step."""
from .config import EngineConfig, SpecConfig
from .engine import LLMEngine, StepOutput, Verification
from .sequence import RequestStats, Sequence

__all__ = ["EngineConfig", "SpecConfig", "LLMEngine", "StepOutput", "Verification", "RequestStats", "Sequence"]
