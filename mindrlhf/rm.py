"""``mindrlhf-rm`` / ``python -m mindrlhf.rm``: reward-model training on preference pairs.

The recipe, top to bottom: pair rows (``data.text_rows.read_pair_rows``: ReaL's ``pos_answers`` /
``neg_answers`` and TRL's ``chosen`` / ``rejected``, tokenised as TRL does) → each pair as two rows,
prompt + chosen and prompt + rejected, packed behind one copy of their prompt (``models.packing``; padded
rows under pipeline stages) → the decoder with HF's ``score`` head read at each row's last real token
(``models.heads.ScoreHead``; an HF ``*ForSequenceClassification`` checkpoint loads as is, a causal LM gets a
new head) → the Bradley–Terry loss over the step's pairs
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
from mindrlhf.trainer.offline import (
    OfflineTrainer,
    Shape,
    pair_lengths,
    pair_rows,
    pair_shape_grid,
    prompt_completion_extent,
    prompt_completion_micro_batches,
)
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


def pair_micro_batches(prompts: Sequence[np.ndarray], chosen: Sequence[np.ndarray], rejected: Sequence[np.ndarray],
                       pairs: int, pad_id: int, bucket: int = 32, shapes: Optional[Sequence[Shape]] = None
                       ) -> List[Dict[str, np.ndarray]]:
    """Pairs cut into micro-batches of ``pairs`` pairs, rows ``prompt_i + chosen_i, prompt_i + rejected_i``
    interleaved, in the log-prob head's prompt / completion layout (``trainer.offline.prompt_completion_micro_batches``)
    so a pair's two rows share their prompt and pack together (``models.packing``). That layout drops each row's
    last column, so every completion gets one padding column after it (never attended: its mask is 0), and
    ``score_index`` (the completion's length) names the position of the row's last real token
    (``models.heads.ScoreHead(packed=True)``). ``shapes``: the (prompt, completion) widths allowed (``shape_grid``)."""
    rows_p, rows_c = pair_rows(prompts, chosen, rejected)
    out = prompt_completion_micro_batches(rows_p, [np.r_[c, pad_id] for c in rows_c], 2 * pairs, pad_id,
                                          bucket=bucket, shapes=shapes)
    for n, mb in enumerate(out):
        lengths = np.array([len(c) for c in rows_c[n * 2 * pairs:(n + 1) * 2 * pairs]], np.int32)
        width_p = mb["input_ids"].shape[1] - (mb["completion_ids"].shape[1] - 1)
        after = width_p + lengths  # each row's padding column (dropped with the last column if it is there)
        kept = after < mb["attention_mask"].shape[1]
        mb["attention_mask"][np.flatnonzero(kept), after[kept]] = 0
        mb["score_index"] = lengths
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
                 reports=(), shapes: Optional[Sequence[Shape]] = None):
        """``shapes``: the micro-batches' (prompt, completion) widths allowed (``trainer.offline.shape_grid``)."""
        super().__init__(cfg, model=model, updater=updater, tokenizer=tokenizer, layout=layout,
                         columns=_pair_columns(train_pairs), source=train_pairs.source, reports=reports,
                         valid=_pair_columns(valid_pairs) if valid_pairs is not None else None)
        self.shapes = shapes

    def micro_batches(self, batch, split):
        return pair_micro_batches(batch["prompt"], batch["chosen"], batch["rejected"], self.micro_rows, self.pad_id,
                                  shapes=self.shapes)

    def row_tokens(self, columns, i):
        # Real tokens of the pair's two rows (prompt + chosen, prompt + rejected), as TRL counts them.
        return 2 * len(columns["prompt"][i]) + len(columns["chosen"][i]) + len(columns["rejected"][i])


def _pair_columns(pairs) -> Dict[str, list]:
    """A pair's prompt, chosen and rejected ids: its two rows are prompt + chosen and prompt + rejected."""
    return {"prompt": list(pairs.prompt_ids), "chosen": list(pairs.chosen_ids), "rejected": list(pairs.rejected_ids)}


def build_trainer(cfg: RMConfig, layout=None):
    """Load the model (with a score head), tokenizer and pairs as the config says; return a ready trainer."""
    from mindrlhf.models.heads import ScoreHead
    from mindrlhf.trainer.entry import load_policy
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
    # A pair's two rows share their prompt: packed, it is encoded once (not under pipeline stages: padded rows).
    share = layout.train.pp == 1
    rows_p, rows_c = pair_rows(train.prompt_ids, train.chosen_ids, train.rejected_ids)
    # The largest micro-batch pair_micro_batches forms (each completion one column longer); no vocabulary logits.
    extent = replace(prompt_completion_extent([len(p) for p in rows_p], [len(c) + 1 for c in rows_c],
                                              2 * cfg.micro_rows), logit_rows=0)
    shapes = pair_shape_grid(cfg, *pair_lengths(train.prompt_ids, train.chosen_ids, train.rejected_ids, extra=1))
    updater = build_updater(cfg, model, RMObjective(cfg.loss.center_rewards_coefficient),
                            head=ScoreHead(1, packed=True), groups=layout.groups, masters=masters,
                            share_prompts=share, extent=extent, what="reward model")
    return RMTrainer(cfg, model=model, updater=updater, tokenizer=tokenizer, layout=layout, train_pairs=train,
                     valid_pairs=valid, reports=reports, shapes=shapes)


RM = StageSpec("rm", parse=parse_rm_args, build=build_trainer, models=lambda cfg: {"--model": cfg.model.model_path})


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``mindrlhf-rm``)."""
    return run_cli(partial(run_stage, RM), argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
