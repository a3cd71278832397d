"""The one place a rollout backend is chosen from the config."""
from __future__ import annotations

from mindrlhf.errors import MindRLHFError
from mindrlhf.generation.base import Sampler


def check_sampler_config(cfg) -> None:
    """The config asks for a backend this installation has (checked before any model loads)."""
    if cfg.generation.use_vllm:
        raise MindRLHFError("use_vllm: the vLLM-MindSpore backend is not wired in yet; use the native sampler "
                            "(use_vllm false)")


def build_sampler(cfg, model) -> Sampler:
    """The sampler a run's config asks for, generating with ``model`` (this rank's generator shard).

    ``cfg`` needs ``generation.use_vllm`` and ``parallel.jit`` / ``parallel.share_prompts``. The
    vLLM-MindSpore backend would implement ``Sampler`` (see docs/design.md) and be returned here.
    """
    check_sampler_config(cfg)
    return native_sampler(model, jit=cfg.parallel.jit, share_prompts=cfg.parallel.share_prompts)


def native_sampler(model, *, jit: bool = True, share_prompts: bool = True) -> Sampler:
    """The native sampler generating with ``model``: the rollout stages' (``build_sampler``) and the one SFT and
    DPO evaluate with (they have no generation settings: mindrlhf-eval's, compiled decode steps)."""
    from mindrlhf.generation.native import NativeSampler

    return NativeSampler(model, jit=jit, share_prompts=share_prompts)
