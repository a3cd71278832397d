"""Rollout engines behind one interface: ``Sampler.generate(prompts, SamplingParams) -> [Completion]``.

``NativeSampler`` is the MindSpore KV-cache sampler (jit-compiled steps, host-side token selection).
"""
from mindrlhf.generation.base import Sampler
from mindrlhf.generation.factory import build_sampler
from mindrlhf.generation.native import CachedDecoder, NativeSampler
from mindrlhf.generation.params import Completion, SamplingParams
from mindrlhf.generation.selection import apply_repetition_penalty, filter_weights, select_tokens

__all__ = ["Sampler", "build_sampler", "NativeSampler", "CachedDecoder", "SamplingParams", "Completion",
           "select_tokens", "filter_weights", "apply_repetition_penalty"]
