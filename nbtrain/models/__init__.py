"""Reference models: a readable GPT with GPT-2 and LLaMA-2 presets, and adapters for Hugging Face models."""

from nbtrain.models.gpt import GPT, GPTConfig
from nbtrain.models.presets import PRESETS, build_preset, preset_config

__all__ = ["GPT", "GPTConfig", "PRESETS", "build_preset", "preset_config"]
