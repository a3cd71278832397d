"""Decoder models (one spec per family in ``models.family``) and their loading.

The MindSpore parts (``CausalLM``, weights) are imported on first use, so ``models.family``,
``models.config`` and ``models.dtypes`` stay importable without MindSpore (configs, converters).
"""
from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any, Union

from mindrlhf.models.config import DecoderConfig, require_causal_lm

if TYPE_CHECKING:  # pragma: no cover
    from mindrlhf.models.decoder import CausalLM

__all__ = ["CausalLM", "DecoderConfig", "load_model", "build_model", "cast_weights_into", "get_weights", "set_weights",
           "resolve_dtype", "require_causal_lm"]

_LAZY = {"CausalLM": "mindrlhf.models.decoder", "resolve_dtype": "mindrlhf.models.decoder",
         "cast_weights_into": "mindrlhf.models.weights", "get_weights": "mindrlhf.models.weights",
         "set_weights": "mindrlhf.models.weights"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_model(config: Union[DecoderConfig, str, os.PathLike], dtype: str = "float32") -> "CausalLM":
    """A randomly initialised model for ``config`` (a DecoderConfig, config.json or HF dir)."""
    from mindrlhf.models.decoder import CausalLM

    if not isinstance(config, DecoderConfig):
        config = DecoderConfig.from_file(config)
    return CausalLM(config, dtype=dtype)


def load_model(path: Union[str, os.PathLike], dtype: str = "float32") -> "CausalLM":
    """Load a model from an HF directory (config.json + safetensors, sharded or not) or from a
    MindSpore checkpoint written by ``convert_weight.py`` (config.json next to it).

    Weights are streamed tensor by tensor into the model and cast to ``dtype``
    (float32 | bfloat16 | float16); every tensor's shape is checked against the config.
    """
    from mindrlhf.checkpoint.hf_io import open_weights
    from mindrlhf.models.decoder import CausalLM, resolve_dtype
    from mindrlhf.models.weights import set_weights

    resolve_dtype(dtype)  # fail on a bad dtype before reading anything
    source = open_weights(path)
    model = CausalLM(DecoderConfig.from_hf_dict(source.config, source=str(source.config_path)), dtype=dtype)
    set_weights(model, source, source=str(path))
    return model
