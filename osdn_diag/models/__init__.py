"""Model loading (local Hugging Face directories of fla models, random presets)."""

from .loading import PRESETS, LoadedModel, load_model

__all__ = ["PRESETS", "LoadedModel", "load_model"]
