"""Errors of the model package.

    ModelError (ValueError)
    ├── ConfigError          a config.json that cannot be read or understood
    │   └── UnknownPresetError
    ├── UnknownGpuError      a GPU name not in the catalogue
    └── DeploymentError      a deployment that cannot exist (TP not dividing heads, ...)

Every message is one line a person can act on; the CLI prints it as is.
"""

from __future__ import annotations


class ModelError(ValueError):
    """Base class: the model cannot answer for the given input."""


class ConfigError(ModelError):
    """A model config that is missing, malformed or lacks a required field."""


class UnknownPresetError(ConfigError):
    """A name that is neither a file, a directory nor a bundled preset."""


class UnknownGpuError(ModelError):
    """A GPU name that is not in the catalogue."""


class DeploymentError(ModelError):
    """A deployment setting that cannot work (impossible TP, non-positive sizes, ...)."""
