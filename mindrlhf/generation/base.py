"""The interface every rollout backend implements (native MindSpore, vLLM-MindSpore, …).

The contract a backend keeps (docs/design.md, "The Sampler contract"): ``generate`` returns
``params.n`` completions per prompt with the sampled tokens' log-probs (and entropies when asked),
reproducibly for a given ``params.seed``; ``load_weights`` receives, after every update, THIS rank's
weights in the sampler's own layout (HF names; tensor-parallel slices already cut by the trainer)
and writes them in place; ``release`` frees what the backend holds between rollouts (compiled
graphs, KV caches) when memory is needed elsewhere; inside ``reuse_prefixes`` a backend may keep the computed
state of finished completions for prompts that continue them (a multi-turn rollout's next turn).
"""
from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Sequence, Tuple, Union

import numpy as np

from mindrlhf.generation.params import Completion, SamplingParams


class Sampler(abc.ABC):
    """Generates completions for token-id prompts and receives new policy weights."""

    #: Timing/size numbers of the last ``generate`` call (for metrics), e.g. prefill_s, decode_s, tokens.
    last_stats: Dict[str, Any]
    #: Tokens generated over the sampler's lifetime.
    tokens_generated: int
    #: Whether ``generate`` reports per-token entropies (``SamplingParams.entropy``); a sampler that does not
    #: refuses the request.
    reports_entropy: bool = True

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> List[Completion]:
        """``params.n`` completions per prompt, prompt-major: prompt 0's n completions, then prompt 1's, …"""

    @abc.abstractmethod
    def load_weights(self, named_arrays: Union[Mapping[str, np.ndarray], Iterable[Tuple[str, np.ndarray]]]) -> int:
        """Replace the model weights in place: this rank's arrays in the sampler's layout, by HF parameter
        name (a mapping, or pairs so a large model streams tensor by tensor); returns how many were set."""

    @abc.abstractmethod
    def release(self) -> None:
        """Free compiled graphs and caches until the next ``generate`` (which rebuilds them)."""

    @contextlib.contextmanager
    def reuse_prefixes(self, keep: Callable[[Sequence[int]], bool]) -> Iterator[None]:
        """Within the block, a finished completion whose generated ids satisfy ``keep`` may have its computed
        state (its KV cache) kept, so that a later ``generate`` of the block whose prompt begins with that
        completion's prompt and ids prefills only the rest (the next turn of a multi-turn rollout). Results are
        the same as without it; nothing is kept after the block. Default: nothing kept (a backend with prefix
        caching of its own, as vLLM, needs nothing here)."""
        yield

    def holds(self, model: Any) -> bool:
        """Whether the sampler generates with ``model`` itself (then its weights need no sync)."""
        return False
