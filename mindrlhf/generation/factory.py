"""The one place a rollout backend is chosen from the config."""
from __future__ import annotations

import os
import sys

from mindrlhf.errors import MindRLHFError
from mindrlhf.generation.base import Sampler


def check_sampler_config(cfg) -> None:
    """The config asks for a backend this installation has (checked before any model loads)."""
    g = cfg.generation
    if g.use_vllm:
        check_vllm(vllm_python(cfg), g.vllm_server)


def check_vllm(python: str, server: str = "", flag: str = "") -> None:
    """A vLLM engine can be reached: the socket ``server`` exists, else ``python`` (vLLM's environment) does.
    ``flag``: the option's prefix in the messages ('--' on a command line)."""
    if server:
        if not os.path.exists(server):
            raise MindRLHFError(f"{flag}vllm_server {server}: no such socket; start the engine with "
                                f"`mindrlhf-vllm-serve --socket PATH ...` or leave {flag}vllm_server empty")
        return
    if not os.path.isfile(python):
        raise MindRLHFError(f"{flag}use_vllm: no vLLM environment at {python}; make one with `bash "
                            f"scripts/install_vllm.sh .venv-vllm` (or set {flag}vllm_python / $MINDRLHF_VLLM_PYTHON)")


def vllm_python(cfg) -> str:
    """The Python that runs the vLLM engine: ``vllm_python``, else vLLM-MindSpore's own environment on Ascend (it
    installs beside MindSpore), else the CPU build's virtualenv (``default_vllm_python``)."""
    from mindrlhf.generation.vllm_sampler import default_vllm_python

    if cfg.generation.vllm_python:
        return cfg.generation.vllm_python
    return sys.executable if cfg.parallel.device_target == "Ascend" else default_vllm_python()


def build_sampler(cfg, model) -> Sampler:
    """The sampler a run's config asks for, generating with ``model`` (this rank's generator shard).

    ``cfg`` needs ``generation`` (``use_vllm`` and the vllm_* settings) and ``parallel.jit`` /
    ``parallel.share_prompts``. The vLLM sampler starts from ``model``'s weights (a LoRA model's merged).
    """
    check_sampler_config(cfg)
    if cfg.generation.use_vllm:
        return vllm_sampler(cfg, model)
    return native_sampler(model, jit=cfg.parallel.jit, share_prompts=cfg.parallel.share_prompts)


def vllm_sampler(cfg, model) -> Sampler:
    """A vLLM engine for ``model``'s architecture, holding ``model``'s weights, as the run's config sets it."""
    g = cfg.generation
    return vllm_sampler_for(model, python=vllm_python(cfg), dtype=g.vllm_dtype,
                            max_model_len=g.vllm_max_model_len or g.max_prompt_length + g.max_completion_length,
                            max_num_seqs=g.vllm_max_num_seqs, max_num_batched_tokens=g.vllm_max_num_batched_tokens,
                            kv_cache_gib=g.vllm_kv_cache_gib, server=g.vllm_server, seed=cfg.train.seed,
                            ascend=cfg.parallel.device_target == "Ascend", enforce_eager=g.vllm_enforce_eager)


def vllm_sampler_for(model, *, max_model_len: int, **options) -> Sampler:
    """A vLLM engine for ``model``'s architecture, holding ``model``'s weights (a LoRA model's projections
    merged); ``options``: ``VLLMSampler``'s (python, dtype, server, seed, ...)."""
    from mindrlhf.generation.vllm_sampler import VLLMSampler
    from mindrlhf.models.lora import merged_shard_weights

    sampler = VLLMSampler(model.config, max_model_len=max_model_len, **options)
    sampler.load_weights(merged_shard_weights(model))
    return sampler


def native_sampler(model, *, jit: bool = True, share_prompts: bool = True) -> Sampler:
    """The native sampler generating with ``model``: the rollout stages' (``build_sampler``) and the one SFT and
    DPO evaluate with (they have no generation settings: mindrlhf-eval's, compiled decode steps)."""
    from mindrlhf.generation.native import NativeSampler

    return NativeSampler(model, jit=jit, share_prompts=share_prompts)
