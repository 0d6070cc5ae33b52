"""The engine: sequences, scheduler, model runner, and the schedule -> propose -> verify -> postprocess step."""
from .config import EngineConfig, SpecConfig
from .engine import LLMEngine, StepOutput, VerifyBatch
from .sequence import RequestStats, Sequence

__all__ = ["EngineConfig", "SpecConfig", "LLMEngine", "StepOutput", "VerifyBatch", "RequestStats", "Sequence"]
