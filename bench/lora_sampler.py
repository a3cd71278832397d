"""LoRA and the sampler: the adapters applied in the sampler's own layers (the policy as its generator: what GRPO
with LoRA does) against the merged delta loaded into a plain copy after each update (``merged_weights`` +
``NativeSampler.load_weights``). Random weights, random prompts; the two kinds interleaved (a shared box), the best
of three of each.

    python bench/lora_sampler.py tiny    # the test suite's tiny Qwen2 (9.8 M parameters)
    python bench/lora_sampler.py small   # hidden 512, 4 layers (89.9 M parameters, most in the embedding)
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mindrlhf.generation.native import NativeSampler
from mindrlhf.generation.params import SamplingParams
from mindrlhf.models import load_model
from mindrlhf.models.lora import LoRASpec, adapter_weights, apply_lora, merged_weights, set_adapter_weights
from mindrlhf.testing import lora_numpy_init, make_tiny_qwen2

SHAPES = {"tiny": {}, "small": dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                                    num_key_value_heads=2, num_hidden_layers=4)}


def best(fn, reps: int = 1) -> float:
    """The shortest of ``reps`` timed calls of ``fn``."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(size: str) -> None:
    """Print both ways' seconds for 8 prompts x 4 completions x 64 tokens, rank-16 adapters on every projection."""
    model_dir = make_tiny_qwen2(Path(tempfile.mkdtemp()) / "model", seed=5, **SHAPES[size])
    lora, plain = load_model(model_dir), load_model(model_dir)
    apply_lora(lora, LoRASpec(r=16, alpha=32.0))
    set_adapter_weights(lora, {k: lora_numpy_init(k, v.shape, 11) for k, v in adapter_weights(lora).items()})
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, plain.config.vocab_size - 10, 48).tolist() for _ in range(8)]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=64, seed=1)
    adapted, merged = NativeSampler(lora), NativeSampler(plain)

    def merge():
        merged.load_weights(merged_weights(lora))

    merge()
    adapted.generate(prompts, params)
    merged.generate(prompts, params)  # compiled, warm
    t_merge = best(merge, 3)
    t_adapted, t_merged = [], []
    for _ in range(3):
        t_merged.append(best(lambda: merged.generate(prompts, params)))
        t_adapted.append(best(lambda: adapted.generate(prompts, params)))
    count = sum(int(np.prod(p.shape)) for p in plain.get_parameters()) / 1e6
    print(f"{size} ({count:.1f} M parameters), 32 completions x 64 tokens: adapters in the layers "
          f"{min(t_adapted):.3f} s; merged copy {min(t_merged):.3f} s + merge and load {t_merge:.3f} s per update "
          f"(and a second copy of the weights)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tiny")
