"""``mindrlhf-sft`` / ``python -m mindrlhf.sft``: supervised fine-tuning on prompt/completion rows.

The recipe, top to bottom: rows (``data.text_rows``: ReaL's and TRL's jsonl formats, tokenised as
TRL does, EOS trained) → padded micro-batches → the completion log-probs with per-token entropy and
argmax hit (``models.heads.LogProbHead(stats=True)``) → the token-mean NLL over the whole step
(``algorithms.supervised.sft_loss``) → the shared update, loop, checkpoints and CLI
(``trainer.update``, ``trainer.base``, ``trainer.entry``). Metrics carry TRL's ``SFTTrainer`` names.

Run on one process with ``python`` or on several with ``msrun … -m mindrlhf.sft`` (``--use_parallel``
and a layout); with no arguments it fine-tunes the embedded SmolLM2 on the packaged GSM8K sample.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from mindrlhf.algorithms.supervised import sft_loss
from mindrlhf.configs.offline import SFTConfig, parse_sft_args
from mindrlhf.errors import MindRLHFError
from mindrlhf.parallel import comm
from mindrlhf.trainer.base import log_data_report
from mindrlhf.trainer.entry import StageSpec, model_source, run_stage
from mindrlhf.trainer.experience import bucket as round_up
from mindrlhf.trainer.metrics import EVAL_CURVE
from mindrlhf.trainer.offline import (
    PolicyOfflineTrainer,
    grid_width,
    pack_rows,
    prompt_completion_extent,
    prompt_completion_micro_batches,
    static_shape_grid,
    width_grid,
)
from mindrlhf.utils.cli import run_cli

log = logging.getLogger("mindrlhf")


class SFTObjective:
    """The SFT loss of one micro-batch and the sums its metrics are made of (``trainer.update.Objective``)."""

    inputs = ("completion_mask",)
    aux = (("tokens", "sum"), ("correct", "sum"), ("entropy", "sum"))

    def loss(self, head_out, completion_mask, num_tokens):
        logp, entropy, correct = head_out
        mask = completion_mask.astype(logp.dtype)
        return sft_loss(logp, mask, num_tokens), (mask.sum(), (correct * mask).sum(), (entropy * mask).sum())

    def metrics(self, reduced: Dict[str, float]) -> Dict[str, float]:
        tokens = max(reduced["tokens"], 1.0)
        return {"mean_token_accuracy": reduced["correct"] / tokens, "entropy": reduced["entropy"] / tokens}


class SFTTrainer(PolicyOfflineTrainer):
    """SFT on the shared loop: one optimizer step per ``batch_size`` rows."""

    stage = "sft"
    curves = (("loss", "loss.png", "SFT: training loss", "loss"), EVAL_CURVE)

    step_metrics = ("mean_token_accuracy", "entropy")
    eval_metrics = ("mean_token_accuracy",)

    def __init__(self, cfg: SFTConfig, *, model, updater, tokenizer, layout, train, source, valid=None, reports=(),
                 widths=None):
        """``train`` / ``valid``: the training sequences (``sequences``) of the rows read from ``source``;
        ``widths``: the micro-batch widths allowed (``trainer.offline.width_grid``; None: any multiple of 32)."""
        super().__init__(cfg, model=model, updater=updater, tokenizer=tokenizer, layout=layout, columns=train,
                         source=source, reports=reports, valid=valid)
        self.widths = widths

    def micro_batches(self, batch, split):
        """Padded micro-batches of sequences (``sft_micro_batches``)."""
        return sft_micro_batches(batch["input_ids"], batch["trained"], self.micro_rows, self.pad_id,
                                 segments=batch.get("segments"), widths=self.widths)

    def counts(self, columns, rows):
        # The trained tokens: the loss is their mean over the step (a row's first token is never trained).
        return (sum(float(columns["trained"][i].sum()) for i in rows),)

    def row_tokens(self, columns, i):
        return len(columns["input_ids"][i])


def sft_micro_batches(input_ids: Sequence[np.ndarray], trained: Sequence[np.ndarray], size: int, pad_id: int,
                      segments: Optional[Sequence[np.ndarray]] = None, bucket: int = 32, cut: str = "auto",
                      widths: Optional[Sequence[int]] = None):
    """Sequences cut into micro-batches in the log-prob head's layout: each split into an untrained start (the
    "prompt", left-padded) and the rest (the "completion", right-padded;
    ``trainer.offline.prompt_completion_micro_batches``) so the vocabulary head runs only from the split on;
    untrained tokens after it stay masked. ``cut`` says where: ``row`` at each sequence's first trained token
    (least head work, but the micro-batch pays its longest start plus its longest rest); ``shared`` every sequence
    of a micro-batch at one column, the earliest first trained token rounded down to ``bucket`` (one padding: the
    micro-batch is as wide as its longest sequence rounded up), the head running over the few untrained columns
    before; ``auto`` whichever of the two computes fewer positions (a tie: ``row``). Packed sequences attend per
    row (their segments as the mask). ``widths``: the micro-batch widths allowed (``trainer.offline.width_grid``)."""
    firsts = [split_point(m) for m in trained]
    cuts = []
    for s in range(0, len(input_ids), size):
        own = firsts[s:s + size]
        lengths = [len(ids) for ids in input_ids[s:s + size]]
        shared = min(own) // bucket * bucket or min(own)  # a whole bucket of start: no left padding
        row_width = grid_width(round_up(max(own), bucket) + round_up(max(n - k for n, k in zip(lengths, own)),
                                                                     bucket), widths)
        shared_width = grid_width(round_up(shared, bucket) + round_up(max(lengths) - shared, bucket), widths)
        share = cut == "shared" or (cut == "auto" and shared_width < row_width)
        cuts += [shared] * len(own) if share else own
    return prompt_completion_micro_batches([ids[:k] for ids, k in zip(input_ids, cuts)],
                                           [ids[k:] for ids, k in zip(input_ids, cuts)], size, pad_id,
                                           trained=[m[k:] for m, k in zip(trained, cuts)], segments=segments,
                                           bucket=bucket, widths=widths)


def micro_batch_widths(input_ids: Sequence[np.ndarray], cuts: Sequence[int], count: int,
                       bucket: int = 32) -> Optional[List[int]]:
    """At most ``count`` widths every micro-batch ``sft_micro_batches`` forms from these sequences (first trained
    tokens ``cuts``) can be padded to (``trainer.offline.width_grid``; None: the bucket alone keeps to ``count``).
    No micro-batch is wider than the longest start plus the longest rest, nor than the longest sequence and one
    bucket (a shared cut)."""
    lengths = [round_up(len(ids), bucket) for ids in input_ids]
    split = round_up(max(cuts), bucket) + round_up(max(len(ids) - k for ids, k in zip(input_ids, cuts)), bucket)
    return width_grid(lengths, min(split, max(lengths) + bucket), count)


def split_point(trained: np.ndarray) -> int:
    """Where ``sft_micro_batches`` splits a sequence: its first trained token (a row's first token is never
    trained, so at least 1; the last token when nothing is trained)."""
    return max(int(np.argmax(trained > 0)), 1) if trained.any() else len(trained) - 1


def sequences(rows, max_length: int = 0) -> Dict[str, list]:
    """The training sequences of tokenised rows: each row alone, or with ``max_length`` packed
    (``trainer.offline.pack_rows``) with ``segments`` numbering each sequence's rows from 1."""
    if not max_length:
        return {"input_ids": list(rows.input_ids), "trained": list(rows.completion_mask)}
    out: Dict[str, list] = {"input_ids": [], "trained": [], "segments": []}
    for members in pack_rows([len(r) for r in rows.input_ids], max_length):
        out["input_ids"].append(np.concatenate([rows.input_ids[i] for i in members]))
        out["trained"].append(np.concatenate([rows.completion_mask[i] for i in members]))
        out["segments"].append(np.concatenate([np.full(len(rows.input_ids[i]), n + 1, np.int32)
                                               for n, i in enumerate(members)]))
    return out


def default_train_file(cfg: SFTConfig) -> str:
    """The packaged GSM8K sample as conversational SFT rows, written once into output_dir/data."""
    from mindrlhf.data.rlhf_data import write_sft_rows
    from mindrlhf.resources import GSM8K_TRAIN_SAMPLE

    out = Path(cfg.train.output_dir) / "data" / "gsm8k_sft_sample.jsonl"
    if comm.is_main() and not out.is_file():
        write_sft_rows(GSM8K_TRAIN_SAMPLE, out)
    comm.barrier()
    return str(out)


def read_rows(cfg: SFTConfig, path: str, tokenizer, what: str):
    """``(rows, report)``: the tokenised rows of ``path`` (a file with no usable row is an error) and the reader's
    report, logged once with its skipped rows named (``trainer.base.log_data_report``)."""
    from mindrlhf.data.text_rows import read_sft_rows

    rows, report = read_sft_rows(path, tokenizer, max_length=cfg.data.max_length,
                                 completion_only_loss=cfg.data.completion_only_loss, strict=cfg.data.strict,
                                 show_progress=comm.is_main())
    return rows, log_data_report(cfg, report, what)


def build_trainer(cfg: SFTConfig, layout=None):
    """Load the model, tokenizer and rows as the config says; return a ready SFT trainer."""
    from mindrlhf.models.heads import LogProbHead
    from mindrlhf.trainer.entry import load_policy
    from mindrlhf.trainer.update import build_updater

    path, tokenizer, config = model_source(cfg.model, "the model SFT trains")
    train, train_report = read_rows(cfg, cfg.data.train_file or default_train_file(cfg), tokenizer, "train_file")
    valid, valid_report = read_rows(cfg, cfg.data.valid_file, tokenizer, "valid_file") if cfg.data.valid_file \
        else (None, None)
    longest = max(len(r) for r in train.input_ids)
    if longest > config.max_position_embeddings:
        raise MindRLHFError(f"max_length {cfg.data.max_length} lets rows of {longest} tokens through but the model "
                            f"has max_position_embeddings={config.max_position_embeddings}; lower max_length")
    capacity = cfg.data.max_length if cfg.data.packing else 0  # 0: one row per sequence
    seqs = sequences(train, capacity)
    if capacity and comm.is_main():
        log.info("packing: %d rows in %d sequences of up to %d tokens", len(train), len(seqs["input_ids"]), capacity)
    cuts = [split_point(m) for m in seqs["trained"]]
    extent = prompt_completion_extent(cuts, [len(ids) - k for ids, k in zip(seqs["input_ids"], cuts)],
                                      cfg.micro_rows)
    # A shared cut (sft_micro_batches) may run the head over a whole sequence: bound its logits by the longest.
    widest = cfg.micro_rows * round_up(max(len(ids) for ids in seqs["input_ids"]), 32)
    extent = replace(extent, logit_rows=max(extent.logit_rows, widest))
    widths = static_shape_grid(cfg, lambda count: micro_batch_widths(seqs["input_ids"], cuts, count))
    model, masters = load_policy(path, config, layout, cfg.model.dtype, lora=cfg.model, seed=cfg.train.seed)
    updater = build_updater(cfg, model, SFTObjective(), head=LogProbHead(stats=True), groups=layout.groups,
                            masters=masters, extent=extent)
    return SFTTrainer(cfg, model=model, updater=updater, tokenizer=tokenizer, layout=layout, train=seqs,
                      source=train.source, valid=sequences(valid, capacity) if valid is not None else None,
                      reports=[r for r in (train_report, valid_report) if r], widths=widths)


SFT = StageSpec("sft", parse=parse_sft_args, build=build_trainer, models=lambda cfg: {"--model": cfg.model.model_path})


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``mindrlhf-sft``)."""
    return run_cli(partial(run_stage, SFT), argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())


