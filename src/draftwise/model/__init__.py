"""The Llama-family model runner: config, module, paged attention, loading."""
from .config import ModelConfig, ModelLoadError
from .llama import LlamaModel
from .loader import LoadedModel, load_model, save_model

__all__ = ["ModelConfig", "ModelLoadError", "LlamaModel", "LoadedModel", "load_model", "save_model"]
