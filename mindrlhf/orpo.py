"""``mindrlhf-orpo`` / ``python -m mindrlhf.orpo``: odds-ratio preference optimisation on preference pairs.

ORPO (Hong et al. 2024) is supervised fine-tuning with a penalty on the rejected answer, in one stage and
with no reference model: the loss is the NLL of the chosen row plus lambda times the mean over the pairs
of ``-log sigmoid(log odds ratio)``, the odds of each completion read from its token-mean log-prob (the
formulas: ``algorithms.supervised.orpo_log_odds`` / ``odds_ratio_loss``, from TRL 1.16's
``trl/experimental/orpo/orpo_trainer.py``).

The recipe, top to bottom: pair rows (``data.text_rows.read_pairs``, tokenised as for DPO: the prompt's
tokens, then each completion with its EOS; each sequence cut to ``max_length``) → each pair as two rows,
prompt + chosen and prompt + rejected, whose every token after the first is scored (TRL's NLL covers the
chosen row's prompt tokens too, so the prompt is not encoded once for both rows as in DPO) → the
objective: token-mean log-probs of the completions, the odds-ratio term, the chosen rows' NLL as a token
mean over the step → the shared update, loop, checkpoints and CLI. Metrics carry TRL's ``ORPOTrainer``
names. One tokenisation difference: TRL's ORPO prepends the tokenizer's BOS to a prompt that does not start
with it; the pair reader (DPO's, as TRL's DPOTrainer) adds none. Qwen2.5 has no BOS and chat-templated
SmolLM2 prompts start with theirs, so both give the same ids there.
"""
from __future__ import annotations

from functools import partial
from typing import Dict, List, Optional, Sequence

import numpy as np
from mindspore import ops

from mindrlhf.algorithms.supervised import log_sigmoid, odds_ratio_loss, orpo_log_odds, sft_loss
from mindrlhf.configs.offline import ORPOConfig, parse_orpo_args
from mindrlhf.data.text_rows import read_pair_files, require_pair_file
from mindrlhf.trainer.entry import StageSpec, model_source, run_stage
from mindrlhf.trainer.metrics import EVAL_CURVE
from mindrlhf.trainer.offline import (
    PolicyOfflineTrainer,
    Shape,
    pair_lengths,
    pair_shape_grid,
    prompt_completion_extent,
    prompt_completion_micro_batches,
)
from mindrlhf.utils.cli import run_cli

#: TRL ORPOTrainer's metric names, each a mean over the step's pairs (``nll_loss``: over its chosen rows' tokens).
#: TRL's ``logits/chosen`` / ``logits/rejected`` (mean raw logits) are not logged: the log-prob head never forms
#: the vocabulary-wide logits outside its graph.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen")


class ORPOObjective:
    """ORPO's loss of one micro-batch (rows ``[chosen_0, rejected_0, chosen_1, ...]``, each scored from its
    second token: ``orpo_micro_batches``) and the sums its metrics are made of (``trainer.update.Objective``).
    ``completion_mask`` marks each row's completion tokens (the odds' token-mean log-probs), ``nll_mask`` the
    chosen rows' scored tokens. The step's scalars: its pair count and its ``nll_mask`` token count."""

    inputs = ("completion_mask", "nll_mask")
    aux = (("pairs", "sum"), ("chosen_logp", "sum"), ("rejected_logp", "sum"), ("correct", "sum"),
           ("nll", "sum"), ("nll_tokens", "sum"), ("log_odds_ratio", "sum"), ("log_odds", "sum"))

    def __init__(self, beta: float):
        self.beta = float(beta)

    def loss(self, logp, completion_mask, nll_mask, num_pairs, num_nll_tokens):
        mask = completion_mask.astype(logp.dtype)
        mean = (logp * mask).sum(-1) / ops.maximum(mask.sum(-1), 1.0)  # token-mean log-prob of each completion
        chosen, rejected = mean[0::2], mean[1::2]
        log_odds = orpo_log_odds(chosen, rejected)
        nll_mask = nll_mask.astype(logp.dtype)
        loss = sft_loss(logp, nll_mask, num_nll_tokens) \
            + odds_ratio_loss(log_odds, self.beta).sum() / ops.maximum(num_pairs, 1.0)
        c, r, z = ops.stop_gradient(chosen), ops.stop_gradient(rejected), ops.stop_gradient(log_odds)
        return loss, (ops.ones_like(c).sum(), c.sum(), r.sum(), (c > r).astype(c.dtype).sum(),
                      -ops.stop_gradient(logp * nll_mask).sum(), nll_mask.sum(), log_sigmoid(z).sum(), z.sum())

    def metrics(self, reduced: Dict[str, float]) -> Dict[str, float]:
        """TRL's names: rewards are ``beta * logps`` (ORPO has no reference); ``log_odds_ratio`` is the mean
        ``log sigmoid(log odds)``, ``log_odds_chosen`` the mean log odds ratio itself."""
        pairs = max(reduced["pairs"], 1.0)
        chosen, rejected = reduced["chosen_logp"] / pairs, reduced["rejected_logp"] / pairs
        return {"rewards/chosen": self.beta * chosen, "rewards/rejected": self.beta * rejected,
                "rewards/accuracies": reduced["correct"] / pairs, "rewards/margins": self.beta * (chosen - rejected),
                "logps/chosen": chosen, "logps/rejected": rejected,
                "nll_loss": reduced["nll"] / max(reduced["nll_tokens"], 1.0),
                "log_odds_ratio": reduced["log_odds_ratio"] / pairs, "log_odds_chosen": reduced["log_odds"] / pairs}


def nll_token_count(prompts: Sequence[np.ndarray], chosen: Sequence[np.ndarray]) -> int:
    """Tokens of the chosen rows in ORPO's NLL: every token of ``prompt + chosen`` but the first."""
    return sum(len(p) + len(c) - 1 for p, c in zip(prompts, chosen))


def orpo_micro_batches(prompts: Sequence[np.ndarray], chosen: Sequence[np.ndarray], rejected: Sequence[np.ndarray],
                       pairs: int, pad_id: int, bucket: int = 32, shapes: Optional[Sequence[Shape]] = None
                       ) -> List[Dict[str, np.ndarray]]:
    """Pairs cut into micro-batches of ``pairs`` pairs in the log-prob head's layout
    (``trainer.offline.prompt_completion_micro_batches``), rows ``chosen_i, rejected_i`` interleaved: each row's
    first token is the context and every later one is scored, ``completion_mask`` on the completion's tokens,
    ``nll_mask`` on all scored tokens of the chosen rows (TRL's ORPO NLL: prompt and completion). ``shapes``:
    the (prompt, completion) widths allowed (``trainer.offline.shape_grid``)."""
    rows, trained = [], []
    for p, pair in zip(prompts, zip(chosen, rejected)):
        for c in pair:
            rows.append(np.r_[p, c])
            # the scored tokens are the row's from its second on: the prompt's (none left of an empty prompt), then
            # the completion's (without its first when the prompt is empty: that token is the context)
            trained.append(np.r_[np.zeros(max(len(p) - 1, 0), np.float32),
                                 np.ones(len(c) - (0 if len(p) else 1), np.float32)])
    micro = prompt_completion_micro_batches([r[:1] for r in rows], [r[1:] for r in rows], 2 * pairs, pad_id,
                                            trained=trained, bucket=bucket, shapes=shapes)
    at = 0
    for mb in micro:
        nll = np.zeros_like(mb["completion_mask"])
        for b in range(0, len(nll), 2):
            nll[b, :len(rows[at + b]) - 1] = 1.0
        mb["nll_mask"] = nll
        at += len(nll)
    return micro


class ORPOTrainer(PolicyOfflineTrainer):
    """ORPO on the shared loop: one optimizer step per ``batch_size`` pairs."""

    stage = "orpo"
    curves = (("loss", "loss.png", "ORPO: training loss", "loss"),
              ("rewards/accuracies", "accuracy.png", "ORPO: log-prob accuracy (chosen > rejected)",
               "rewards/accuracies"), EVAL_CURVE)
    prompt_column = "prompt"
    math_groups = ("optimizer", "data", "loss")
    headline = "rewards/accuracies"

    step_metrics = METRICS
    eval_metrics = METRICS

    def __init__(self, cfg: ORPOConfig, *, model, updater, tokenizer, layout, train_pairs, valid_pairs=None,
                 reports=(), shapes: Optional[Sequence[Shape]] = None):
        """``shapes``: the micro-batches' (prompt, completion) widths allowed (``trainer.offline.shape_grid``)."""
        super().__init__(cfg, model=model, updater=updater, tokenizer=tokenizer, layout=layout,
                         columns=train_pairs.columns(), source=train_pairs.source, reports=reports,
                         valid=valid_pairs.columns() if valid_pairs is not None else None)
        self.shapes = shapes

    def micro_batches(self, batch, split):
        return orpo_micro_batches(batch["prompt"], batch["chosen"], batch["rejected"], self.micro_rows, self.pad_id,
                                  shapes=self.shapes)

    def counts(self, columns, rows):
        """The step's pairs and the tokens of its chosen rows' NLL (both global)."""
        return float(len(rows)), float(nll_token_count([columns["prompt"][i] for i in rows],
                                                       [columns["chosen"][i] for i in rows]))

    def row_tokens(self, columns, i):
        # Each pair is two full rows: the prompt is read twice.
        return 2 * len(columns["prompt"][i]) + len(columns["chosen"][i]) + len(columns["rejected"][i])


def build_trainer(cfg: ORPOConfig, layout=None):
    """Load the policy, the tokenizer and the pairs as the config says; return a ready trainer."""
    from mindrlhf.models.heads import LogProbHead
    from mindrlhf.parallel import comm
    from mindrlhf.trainer.entry import load_policy
    from mindrlhf.trainer.update import build_updater

    require_pair_file(cfg)
    path, tokenizer, config = model_source(cfg.model, "the policy ORPO trains")
    train, valid, reports = read_pair_files(cfg, tokenizer, "truncate", main=comm.is_main())
    policy, masters = load_policy(path, config, layout, cfg.model.dtype, lora=cfg.model, seed=cfg.train.seed)
    # orpo_micro_batches' layout: each row's first token as the prompt, the rest scored
    rests = [len(p) + max(len(c), len(r)) - 1
             for p, c, r in zip(train.prompt_ids, train.chosen_ids, train.rejected_ids)]
    extent = prompt_completion_extent([1], rests, 2 * cfg.micro_rows)
    order = pair_lengths(train.prompt_ids, train.chosen_ids, train.rejected_ids)[2]
    shapes = pair_shape_grid(cfg, [1] * len(rests), rests, order)
    updater = build_updater(cfg, policy, ORPOObjective(cfg.loss.beta), head=LogProbHead(), groups=layout.groups,
                            masters=masters, extent=extent)
    return ORPOTrainer(cfg, model=policy, updater=updater, tokenizer=tokenizer, layout=layout, train_pairs=train,
                       valid_pairs=valid, reports=reports, shapes=shapes)


ORPO = StageSpec("orpo", parse=parse_orpo_args, build=build_trainer,
                 models=lambda cfg: {"--model": cfg.model.model_path})


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``mindrlhf-orpo``)."""
    return run_cli(partial(run_stage, ORPO), argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
