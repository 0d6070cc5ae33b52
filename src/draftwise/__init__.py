"""draftwise: a speculative-decoding engine and lab.

    from draftwise import LLM, SamplingParams, SpecConfig
"""
from .engine import EngineConfig, SpecConfig
from .llm import LLM, Output
from .sampling import SamplingParams

__all__ = ["LLM", "Output", "SamplingParams", "SpecConfig", "EngineConfig"]
