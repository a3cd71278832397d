"""``mindrlhf-rm`` / ``python -m mindrlhf.rm``: reward-model training on preference pairs.

The recipe, top to bottom: pair rows (``data.text_rows.read_pair_rows``: ReaL's ``pos_answers`` /
``neg_answers`` and TRL's ``chosen`` / ``rejected``, tokenised as TRL does) → each pair as two rows,
prompt + chosen and prompt + rejected → the decoder with HF's ``score`` head read at each row's last
real token (``models.heads.ScoreHead``; an HF ``*ForSequenceClassification`` checkpoint loads as is, a
causal LM gets a new head) → the Bradley–Terry loss over the step's pairs
(``algorithms.supervised.reward_model_loss``) → the shared update, loop, checkpoints and CLI. Metrics
carry TRL's ``RewardTrainer`` names. A checkpoint's model folder exports to an HF
``*ForSequenceClassification`` directory with ``convert_weight.py --reverse``.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Dict, List, Optional, Sequence

import numpy as np
from mindspore import ops

from mindrlhf.algorithms.supervised import reward_model_loss
from mindrlhf.configs.offline import RMConfig, parse_rm_args
from mindrlhf.data.text_rows import read_pair_files, require_pair_file
from mindrlhf.parallel import comm
from mindrlhf.trainer.entry import StageSpec, model_source, run_stage
from mindrlhf.trainer.offline import OfflineTrainer, pad_rows
from mindrlhf.utils.cli import run_cli


class RMObjective:
    """The reward model's loss of one micro-batch (rows ``[chosen_0, rejected_0, chosen_1, ...]``) and the
    sums its metrics are made of (``trainer.update.Objective``)."""

    inputs = ()
    aux = (("pairs", "sum"), ("correct", "sum"), ("margin", "sum"), ("reward", "sum"), ("min_reward", "min"),
           ("max_reward", "max"))

    def __init__(self, center_rewards_coefficient: float = 0.0):
        self.center = float(center_rewards_coefficient)

    def loss(self, scores, num_pairs):
        rewards = scores[:, 0]
        chosen, rejected = rewards[0::2], rewards[1::2]
        margin = ops.stop_gradient(chosen - rejected)
        seen = ops.stop_gradient(rewards)
        return reward_model_loss(chosen, rejected, num_pairs, self.center), (
            ops.ones_like(margin).sum(), (margin > 0).astype(margin.dtype).sum(), margin.sum(), seen.sum(),
            seen.min(), seen.max())

    def metrics(self, reduced: Dict[str, float]) -> Dict[str, float]:
        pairs = max(reduced["pairs"], 1.0)
        return {"accuracy": reduced["correct"] / pairs, "margin": reduced["margin"] / pairs,
                "min_reward": reduced["min_reward"], "mean_reward": reduced["reward"] / (2 * pairs),
                "max_reward": reduced["max_reward"]}


def pair_micro_batches(chosen: Sequence[np.ndarray], rejected: Sequence[np.ndarray], pairs: int, pad_id: int,
                       bucket: int = 32) -> List[Dict[str, np.ndarray]]:
    """Pairs cut into micro-batches of ``pairs`` pairs: rows ``chosen_i, rejected_i`` interleaved, right-padded
    (``trainer.offline.pad_rows``; the score is read at each row's last real token)."""
    out = []
    for s in range(0, len(chosen), pairs):
        ids, mask = pad_rows([r for pair in zip(chosen[s:s + pairs], rejected[s:s + pairs]) for r in pair], pad_id,
                             bucket)
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


class RMTrainer(OfflineTrainer):
    """Reward-model training on the shared loop: one optimizer step per ``batch_size`` pairs."""

    stage = "rm"
    curves = (("loss", "loss.png", "reward model: training loss", "loss"),
              ("accuracy", "accuracy.png", "reward model: pairwise accuracy", "accuracy"))
    math_groups = ("optimizer", "data", "loss")
    headline = "accuracy"
    next_command = ("use it as PPO's reward model: mindrlhf-ppo --reward_model {checkpoint}, or export it: "
                    "mindrlhf-convert-weight --reverse --input_path {checkpoint}/policy.ckpt --output_path DIR")
    lora_next_command = ("merge it into a reward model PPO loads: mindrlhf-convert-weight --reverse --input_path "
                         "{base} --adapter {adapter} --output_path DIR")

    step_metrics = ("accuracy", "margin", "min_reward", "mean_reward", "max_reward")
    eval_metrics = ("accuracy", "margin", "mean_reward")

    def __init__(self, cfg: RMConfig, *, model, updater, tokenizer, layout, train_pairs, valid_pairs=None,
                 reports=()):
        super().__init__(cfg, model=model, updater=updater, tokenizer=tokenizer, layout=layout,
                         columns=_pair_columns(train_pairs), source=train_pairs.source, reports=reports,
                         valid=_pair_columns(valid_pairs) if valid_pairs is not None else None)

    def micro_batches(self, batch, split):
        return pair_micro_batches(batch["chosen"], batch["rejected"], self.micro_rows, self.pad_id)

    def row_tokens(self, columns, i):
        return len(columns["chosen"][i]) + len(columns["rejected"][i])


def _pair_columns(pairs) -> Dict[str, list]:
    """Each pair as its two rows: prompt + chosen and prompt + rejected (ids)."""
    return {"chosen": [np.concatenate([p, c]) for p, c in zip(pairs.prompt_ids, pairs.chosen_ids)],
            "rejected": [np.concatenate([p, r]) for p, r in zip(pairs.prompt_ids, pairs.rejected_ids)]}


def build_trainer(cfg: RMConfig, layout=None):
    """Load the model (with a score head), tokenizer and pairs as the config says; return a ready trainer."""
    from mindrlhf.models.heads import ScoreHead
    from mindrlhf.trainer.entry import load_policy
    from mindrlhf.trainer.experience import bucket
    from mindrlhf.trainer.memory import MicroBatchExtent
    from mindrlhf.trainer.update import build_updater

    require_pair_file(cfg)
    path, tokenizer, config = model_source(cfg.model)  # any decoder: it gets a new score head
    if config.pad_token_id is None and tokenizer.pad_token_id is not None:
        # transformers' *ForSequenceClassification finds each row's last token through pad_token_id: an exported
        # reward model needs it (TRL sets it from the tokenizer too).
        config = replace(config, pad_token_id=tokenizer.pad_token_id)
    train, valid, reports = read_pair_files(cfg, tokenizer, "drop", main=comm.is_main())
    # With LoRA the score head is trained in full beside the adapters (PEFT's modules_to_save, task SEQ_CLS).
    model, masters = load_policy(path, config, layout, cfg.model.dtype, num_labels=1, seed=cfg.train.seed,
                                 lora=cfg.model)
    # Each pair is two rows (chosen, rejected), padded as pad_rows pads them; a score head forms no vocabulary logits.
    longest = max(len(p) + max(len(c), len(r)) for p, c, r in zip(train.prompt_ids, train.chosen_ids,
                                                                   train.rejected_ids))
    extent = MicroBatchExtent.padded(2 * cfg.micro_rows, bucket(longest, 32), logit_rows=0)
    updater = build_updater(cfg, model, RMObjective(cfg.loss.center_rewards_coefficient), head=ScoreHead(1),
                            groups=layout.groups, masters=masters, extent=extent, what="reward model")
    return RMTrainer(cfg, model=model, updater=updater, tokenizer=tokenizer, layout=layout, train_pairs=train,
                     valid_pairs=valid, reports=reports)


RM = StageSpec("rm", parse=parse_rm_args, build=build_trainer, models=lambda cfg: {"--model": cfg.model.model_path})


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``mindrlhf-rm``)."""
    return run_cli(partial(run_stage, RM), argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
