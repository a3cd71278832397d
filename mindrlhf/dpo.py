"""``mindrlhf-dpo`` / ``python -m mindrlhf.dpo``: direct preference optimisation on preference pairs.

The recipe, top to bottom: pair rows (``data.text_rows.read_pair_rows``, tokenised as TRL does: the
prompt's tokens, then each completion with its EOS; each sequence cut to ``max_length``) → each pair as
two rows, prompt + chosen and prompt + rejected, sharing the prompt (with ``share_prompts`` the prompt
is encoded once for both, ``models.packing``) → sequence log-probs (sum over completion tokens; token
mean for a length-normalised loss such as IPO) of the policy and of the frozen reference (run each step,
or once before training with ``precompute_ref_log_probs``) → the registered DPO loss
(``algorithms.supervised``) over the step's pairs → the shared update, loop, checkpoints and CLI; the
same objective on the validation pairs is the evaluation. Metrics carry TRL's ``DPOTrainer`` names.
"""
from __future__ import annotations

import gc
import logging
from functools import partial
from typing import Dict, List, Optional, Sequence

import numpy as np
from mindspore import ops

from mindrlhf.algorithms.supervised import dpo_logits, get_preference_loss, is_length_normalized
from mindrlhf.configs.offline import DPOConfig, parse_dpo_args
from mindrlhf.data.text_rows import read_pair_files, require_pair_file
from mindrlhf.parallel import comm
from mindrlhf.trainer.entry import StageSpec, model_source, run_stage
from mindrlhf.trainer.metrics import EVAL_CURVE
from mindrlhf.trainer.offline import (
    PolicyOfflineTrainer,
    Shape,
    pair_lengths,
    pair_rows,
    pair_shape_grid,
    prompt_completion_extent,
    prompt_completion_micro_batches,
)
from mindrlhf.utils.cli import run_cli

log = logging.getLogger("mindrlhf")


class DPOObjective:
    """The DPO loss of one micro-batch (rows ``[chosen_0, rejected_0, chosen_1, ...]``) and the sums its
    metrics are made of (``trainer.update.Objective``). ``ref_logp``: the reference's per-token log-probs
    of the rows, reduced to sequence log-probs exactly as the policy's are (so a reference equal to the
    policy gives margins of exactly 0, as in TRL's first step)."""

    inputs = ("completion_mask", "ref_logp")
    aux = (("pairs", "sum"), ("chosen_reward", "sum"), ("rejected_reward", "sum"), ("correct", "sum"),
           ("chosen_logp", "sum"), ("rejected_logp", "sum"))

    def __init__(self, loss_type: str, beta: float, label_smoothing: float):
        self.loss_fn = get_preference_loss(loss_type)
        # A length-normalised loss (IPO) compares per-token log-likelihoods: token means, not sums.
        self.token_mean = is_length_normalized(self.loss_fn)
        self.beta, self.label_smoothing = float(beta), float(label_smoothing)

    def loss(self, logp, completion_mask, ref_logp, num_pairs):
        mask = completion_mask.astype(logp.dtype)
        seq, ref = (logp * mask).sum(-1), ops.stop_gradient(ref_logp * mask).sum(-1)
        if self.token_mean:
            count = ops.maximum(mask.sum(-1), 1.0)
            seq, ref = seq / count, ref / count
        chosen, rejected = seq[0::2], seq[1::2]
        logits = dpo_logits(chosen, rejected, ref[0::2], ref[1::2])
        loss = self.loss_fn(logits, self.beta, self.label_smoothing).sum() / ops.maximum(num_pairs, 1.0)
        # TRL's implicit rewards: beta * (policy - reference) log-likelihood of each completion.
        rc = ops.stop_gradient(self.beta * (chosen - ref[0::2]))
        rr = ops.stop_gradient(self.beta * (rejected - ref[1::2]))
        return loss, (ops.ones_like(rc).sum(), rc.sum(), rr.sum(), (rc > rr).astype(rc.dtype).sum(),
                      ops.stop_gradient(chosen).sum(), ops.stop_gradient(rejected).sum())

    def metrics(self, reduced: Dict[str, float]) -> Dict[str, float]:
        pairs = max(reduced["pairs"], 1.0)
        chosen, rejected = reduced["chosen_reward"] / pairs, reduced["rejected_reward"] / pairs
        return {"rewards/chosen": chosen, "rewards/rejected": rejected,
                "rewards/accuracies": reduced["correct"] / pairs, "rewards/margins": chosen - rejected,
                "logps/chosen": reduced["chosen_logp"] / pairs,
                "logps/rejected": reduced["rejected_logp"] / pairs}


def pair_logp_micro_batches(prompts: Sequence[np.ndarray], chosen: Sequence[np.ndarray],
                            rejected: Sequence[np.ndarray], pairs: int, pad_id: int, bucket: int = 32,
                            shapes: Optional[Sequence[Shape]] = None) -> List[Dict[str, np.ndarray]]:
    """Pairs cut into micro-batches of ``pairs`` pairs in the log-prob head's layout
    (``trainer.offline.prompt_completion_micro_batches``): rows ``chosen_i, rejected_i`` interleaved, so a
    pair's rows share their prompt and pack together. ``shapes``: the (prompt, completion) widths
    allowed (``trainer.offline.shape_grid``)."""
    rows_p, rows_c = pair_rows(prompts, chosen, rejected)
    return prompt_completion_micro_batches(rows_p, rows_c, 2 * pairs, pad_id, bucket=bucket, shapes=shapes)


class DPOTrainer(PolicyOfflineTrainer):
    """DPO on the shared loop: one optimizer step per ``batch_size`` pairs."""

    stage = "dpo"
    curves = (("loss", "loss.png", "DPO: training loss", "loss"),
              ("rewards/accuracies", "accuracy.png", "DPO: implicit-reward accuracy", "rewards/accuracies"), EVAL_CURVE)
    prompt_column = "prompt"
    math_groups = ("optimizer", "data", "loss")
    headline = "rewards/accuracies"

    step_metrics = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                    "logps/rejected")
    eval_metrics = ("rewards/accuracies", "rewards/margins")

    def __init__(self, cfg: DPOConfig, *, model, updater, tokenizer, layout, train_pairs, ref_runner,
                 valid_pairs=None, reports=(), shapes: Optional[Sequence[Shape]] = None):
        """``shapes``: the micro-batches' (prompt, completion) widths allowed (``trainer.offline.shape_grid``)."""
        super().__init__(cfg, model=model, updater=updater, tokenizer=tokenizer, layout=layout,
                         columns=train_pairs.columns(), source=train_pairs.source, reports=reports,
                         valid=valid_pairs.columns() if valid_pairs is not None else None)
        self.shapes = shapes
        self.ref_runner = ref_runner
        # Reference per-token log-probs of each completion (2 per pair), when precomputed.
        self.ref_logps: Dict[str, List[np.ndarray]] = {}
        if cfg.loss.precompute_ref_log_probs:
            self.ref_logps["train"] = self._reference_all(self.dataset.columns)
            if self.valid is not None:
                self.ref_logps["valid"] = self._reference_all(self.valid)
            self.ref_runner = None  # the reference model is no longer referenced: its memory goes
            gc.collect()
            if comm.is_main():
                log.info("precompute_ref_log_probs: the reference ran over %d training pairs and was released",
                         len(self.ref_logps["train"]) // 2)

    # -- the reference ---------------------------------------------------------------------------
    def _micro(self, prompts, chosen, rejected) -> List[Dict[str, np.ndarray]]:
        return pair_logp_micro_batches(prompts, chosen, rejected, self.micro_rows, self.pad_id,
                                       shapes=self.shapes)

    def _reference_all(self, columns) -> List[np.ndarray]:
        """The reference's per-token log-probs of every pair's two completions (a flat list, chosen then
        rejected per pair): each replica runs its share, then one sum over the world."""
        n = len(columns["prompt"])
        lengths = [len(c) for pair in zip(columns["chosen"], columns["rejected"]) for c in pair]
        flat = np.zeros(sum(lengths))
        starts = np.r_[0, np.cumsum(lengths)]
        mine = np.arange(n)[self.layout.groups.dp_rank::self.cfg.parallel.train_dp]
        if len(mine):
            micro = self._micro(*[[columns[k][i] for i in mine] for k in ("prompt", "chosen", "rejected")])
            rows = [row for mb, lp in zip(micro, self.ref_runner.forward(micro))
                    for row, m in zip(lp, mb["completion_mask"]) for row in [row[m > 0]]]
            for k, row in zip([2 * i + j for i in mine for j in (0, 1)], rows):
                flat[starts[k]:starts[k + 1]] = row
        flat = self.replica_sum(flat)
        return [flat[starts[k]:starts[k + 1]].astype(np.float32) for k in range(2 * n)]

    @staticmethod
    def _place(micro, rows: Sequence[np.ndarray]) -> None:
        """Put per-row completion log-probs into each micro-batch's ``ref_logp`` (B, C) at its completion tokens."""
        it = iter(rows)
        for mb in micro:
            ref = np.zeros(mb["completion_mask"].shape, np.float32)
            for b, m in enumerate(mb["completion_mask"]):
                ref[b, m > 0] = next(it)
            mb["ref_logp"] = ref

    # -- the step ---------------------------------------------------------------------------------
    def micro_batches(self, batch, split):
        """The pairs' micro-batches with the reference's per-token log-probs as ``ref_logp`` (precomputed, or
        run now)."""
        micro = self._micro(batch["prompt"], batch["chosen"], batch["rejected"])
        if split in self.ref_logps:
            ref = self.ref_logps[split]
            self._place(micro, [ref[2 * i + j] for i in batch["index"] for j in (0, 1)])
        else:
            for mb, lp in zip(micro, self.ref_runner.forward(micro)):
                mb["ref_logp"] = lp
        return micro

    def row_tokens(self, columns, i):
        # The prompt is read twice (once with each completion).
        return 2 * len(columns["prompt"][i]) + len(columns["chosen"][i]) + len(columns["rejected"][i])


def build_trainer(cfg: DPOConfig, layout=None):
    """Load the policy, the reference, the tokenizer and the pairs as the config says; return a ready trainer."""
    from mindrlhf.models import require_causal_lm
    from mindrlhf.models.heads import LogProbHead
    from mindrlhf.parallel.resharding import checkpoint_config
    from mindrlhf.trainer.entry import load_policy, reference_runner
    from mindrlhf.trainer.update import build_updater

    require_pair_file(cfg)
    m = cfg.model
    path, tokenizer, config = model_source(m, "the policy DPO trains")
    if m.ref_model_path:  # checked before any weights or rows are read
        require_causal_lm(checkpoint_config(m.ref_model_path), m.ref_model_path, "--ref_model", "DPO's reference",
                          "pass the policy's causal LM (e.g. the SFT checkpoint), or omit --ref_model to use the "
                          "initial policy")
    train, valid, reports = read_pair_files(cfg, tokenizer, "truncate", main=comm.is_main())
    policy, masters = load_policy(path, config, layout, m.dtype, lora=m, seed=cfg.train.seed)
    share = layout.train.pp == 1  # the pair's two rows share their prompt: encode it once
    # '': the initial policy in the compute dtype (with LoRA: the policy's own base, its adapters switched off)
    ref_runner = reference_runner(cfg, policy, layout, LogProbHead(), m.ref_model_path, share_prompts=share)
    objective = DPOObjective(cfg.loss.loss_type, cfg.loss.beta, cfg.loss.label_smoothing)
    rows_p, rows_c = pair_rows(train.prompt_ids, train.chosen_ids, train.rejected_ids)
    extent = prompt_completion_extent([len(p) for p in rows_p], [len(c) for c in rows_c], 2 * cfg.micro_rows)
    shapes = pair_shape_grid(cfg, *pair_lengths(train.prompt_ids, train.chosen_ids, train.rejected_ids))
    updater = build_updater(cfg, policy, objective, head=LogProbHead(), groups=layout.groups, masters=masters,
                            share_prompts=share, extent=extent)
    return DPOTrainer(cfg, model=policy, updater=updater, tokenizer=tokenizer, layout=layout, train_pairs=train,
                      ref_runner=ref_runner, valid_pairs=valid, reports=reports, shapes=shapes)


DPO = StageSpec("dpo", parse=parse_dpo_args, build=build_trainer,
                models=lambda cfg: {"--model": cfg.model.model_path, "--ref_model": cfg.model.ref_model_path})


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``mindrlhf-dpo``)."""
    return run_cli(partial(run_stage, DPO), argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
