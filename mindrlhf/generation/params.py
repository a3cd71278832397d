"""Sampling parameters and the completion record every sampler returns."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

from mindrlhf.errors import MindRLHFError


@dataclass
class SamplingParams:
    """How to sample completions (vLLM/TRL meaning for every field).

    - ``n``: completions per prompt (GRPO's group size).
    - ``temperature``: logits are divided by it; ``0`` means greedy (argmax).
    - ``top_p`` in (0, 1]: keep the smallest set of most likely tokens whose probability mass
      reaches ``top_p`` (1 = off). ``top_k``: keep the k most likely tokens (0 = off).
      ``min_p`` in [0, 1): drop tokens whose probability is below ``min_p`` × the top one (0 = off).
      Applied in Hugging Face's order: temperature, top-k, top-p, min-p.
    - ``repetition_penalty`` > 0 (1 = off): Hugging Face semantics, applied to the raw logits of every
      token present in the prompt or generated so far: positive logits are divided by it, negative
      ones multiplied.
    - ``max_tokens``: at most this many new tokens; ``min_tokens``: stop tokens are suppressed
      until this many tokens have been generated.
    - ``stop_token_ids``: generation of a completion ends when it emits one of them; the stop token
      IS included in the completion (the policy must learn to emit it).
    - ``seed``: every ``generate`` call derives its random numbers from this seed alone, so the
      same request with the same seed gives the same completions whatever ran before.
    - ``entropy``: also report, per generated token, the entropy of softmax(logits / T) it was
      drawn from (``Completion.entropies``; before top-k/top-p, like ``logprobs``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: List[int] = field(default_factory=list)
    seed: int = 0
    entropy: bool = False

    def validate(self, vocab_size: Optional[int] = None) -> "SamplingParams":
        """Raise ``MindRLHFError`` (a ``ValueError``) naming the first bad field; return self."""

        def bad(name: str, why: str) -> MindRLHFError:
            return MindRLHFError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: {why}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.n) or self.n < 1:
            raise bad("n", "the number of completions per prompt must be an integer >= 1")
        if not is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0 (0 = greedy)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1] (1 = off)")
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 = off)")
        if not is_num(self.min_p) or not 0 <= self.min_p < 1:
            raise bad("min_p", "must be in [0, 1) (0 = off)")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be a number > 0 (1 = off)")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(is_int(t) and t >= 0
                                                                          for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if t >= vocab_size:
                    raise bad("stop_token_ids", f"token id {t} is outside the vocabulary (size {vocab_size})")
        if not is_int(self.seed):
            raise bad("seed", "must be an integer")
        return self


@dataclass
class Completion:
    """One sampled completion.

    ``token_ids`` are the generated tokens (the stop token included when ``finish_reason`` is
    ``"stop"``); ``logprobs[i]`` is ``log_softmax(logits / T)[token_ids[i]]`` under the model that
    sampled it, taken BEFORE top-k/top-p/min-p/repetition penalty/stop suppression (as TRL does),
    with T = 1 for greedy decoding, so it equals what the trainer recomputes with the same weights.
    A tool-using completion holds every turn's tokens and the tool results' between them (``tool_mask``).
    """

    prompt_index: int
    token_ids: List[int]
    logprobs: List[float]
    finish_reason: str  # "stop" | "length"
    entropies: List[float] = field(default_factory=list)  # per token, when SamplingParams.entropy
    #: A tool-using rollout (``generation.tool_loop``): per token, 1 where the policy sampled it, 0 for the tool
    #: results' tokens the loop appended (their log-probs and entropies are 0). Empty: every token is the policy's.
    tool_mask: List[int] = field(default_factory=list)
    tool_calls: int = 0      #: calls the completion made (a malformed one counts)
    tool_failures: int = 0   #: of those, the ones whose result is an error
    turns: int = 1           #: assistant turns: 1 + the tool rounds it continued after
    #: An environment's ``get_reward()`` after the completion's last turn (``generation.tool_loop``); None without.
    env_reward: Optional[float] = None
