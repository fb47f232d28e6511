"""kvgate: KV-cache-aware admission control for vLLM."""

__version__ = "0.1.0"
