"""The interface every rollout backend implements (native MindSpore, vLLM-MindSpore, …)."""
from __future__ import annotations

import abc
from typing import Any, Dict, List, Mapping, Sequence

import numpy as np

from mindrlhf.generation.params import Completion, SamplingParams


class Sampler(abc.ABC):
    """Generates completions for token-id prompts and receives new policy weights."""

    #: Timing/size numbers of the last ``generate`` call (for metrics), e.g. prefill_s, decode_s, tokens.
    last_stats: Dict[str, Any]
    #: Tokens generated over the sampler's lifetime.
    tokens_generated: int

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> List[Completion]:
        """``params.n`` completions per prompt, prompt-major: prompt 0's n completions, then prompt 1's, …"""

    @abc.abstractmethod
    def load_weights(self, named_arrays: Mapping[str, np.ndarray]) -> None:
        """Replace the model weights (HF parameter names → arrays) in place."""
