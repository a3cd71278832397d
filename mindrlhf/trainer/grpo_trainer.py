"""The one-stage GRPO loop: rollout → reward → advantage → (ref/old log-probs) → update → sync.

The rollout, the rows across replicas, log-prob passes and the weight sync are ``trainer.rollout``'s
(shared with PPO); this file is GRPO's own part: group advantages, DAPO's dynamic sampling, the update
passes and the reference re-sync.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, Optional, Sequence

import mindspore as ms
import numpy as np

from mindrlhf.algorithms import get_advantage_estimator, informative_groups
from mindrlhf.data import PromptDataset
from mindrlhf.errors import MindRLHFError
from mindrlhf.generation import Sampler
from mindrlhf.models import CausalLM
from mindrlhf.models.heads import LogProbHead
from mindrlhf.parallel import comm
from mindrlhf.parallel.groups import RunLayout
from mindrlhf.rewards import RewardManager, overlong_reward
from mindrlhf.trainer.experience import Experience, concat_experiences
from mindrlhf.trainer.grpo_loss import GRPOObjective, LossSettings
from mindrlhf.trainer.memory import rollout_extent
from mindrlhf.trainer.metrics import GRPO_CURVES
from mindrlhf.trainer.rollout import PhaseTimer, RolloutTrainer, ScoredRollout
from mindrlhf.trainer.schedule import run_steps
from mindrlhf.trainer.update import build_frozen_runner, build_updater

log = logging.getLogger(__name__)


class GRPOTrainer(RolloutTrainer):
    """One-stage GRPO: the policy, the generator, the reference, the data and the rewards of one run,
    on the shared loop, update and checkpoints (``trainer.base``)."""

    stage = "grpo"
    math_groups = ("algorithm", "generation", "optimizer", "data")
    headline = "reward"
    curves = GRPO_CURVES

    def __init__(self, cfg, *, policy: CausalLM, tokenizer, dataset: PromptDataset, sampler: Sampler,
                 ref_model: Optional[CausalLM] = None, layout: Optional[RunLayout] = None,
                 policy_masters: Optional[Sequence[ms.Parameter]] = None):
        """``sampler``: the rollout backend (``generation.build_sampler``); the policy's weights reach it
        through ``sync_generator`` only. ``policy_masters``: float32 master weights of the policy's
        trainable parameters (same order), when the policy computes in bf16/fp16; by default they are
        copied from the policy itself."""
        a, g = cfg.algorithm, cfg.generation
        if cfg.uses_reference and ref_model is None:
            raise MindRLHFError("beta > 0 needs a reference model; the trainer was built without one")
        self.loss_settings = LossSettings.from_config(cfg)
        groups = layout.groups if layout is not None else None
        updater = build_updater(cfg, policy, GRPOObjective(self.loss_settings),
                                head=LogProbHead(self.loss_settings.temperature), groups=groups,
                                masters=policy_masters, share_prompts=cfg.parallel.share_prompts,
                                extent=rollout_extent(cfg))
        # max_steps / grpo_epochs: the run and the LR decay. Recorded as max_steps, so the saved
        # config.yaml reruns (and a resume compares) the same length.
        total = run_steps(cfg, len(dataset))
        cfg.train.max_steps = total
        funcs, weights = list(a.reward_funcs), a.reward_weights
        if a.overlong_buffer_length:  # DAPO's overlong punishment: one more reward term, weight 1
            funcs.append(overlong_reward(g.max_completion_length, a.overlong_buffer_length, a.overlong_penalty))
            weights = None if weights is None else list(weights) + [1.0]
        super().__init__(cfg, policy=policy, updater=updater, tokenizer=tokenizer, dataset=dataset, sampler=sampler,
                         rewards=RewardManager(funcs, weights, a.reward_errors), layout=layout, total_steps=total,
                         num_generations=a.num_generations, rollouts_per_step=a.num_rollouts,
                         mask_truncated=a.mask_truncated_completions)
        self.ref_model = ref_model
        self.off_policy = cfg.needs_old_logprobs
        self.ref_runner = None if ref_model is None else build_frozen_runner(
            cfg, ref_model, self.updater.groups, LogProbHead(self.loss_settings.temperature),
            share_prompts=cfg.parallel.share_prompts)
        self.ref_synced = False

    # -- generation ----------------------------------------------------------------------------------
    def generate(self, step: int) -> ScoredRollout:
        """Generate G completions per prompt of the step's batches, score them and build its arrays
        (this train replica's rows, advantages included): rollout → scoring → advantages."""
        if self.cfg.algorithm.dynamic_sampling:
            return self._generate_dynamic(step)
        scored = self._round(step, 0)
        scored.exp = self._train_share(self._with_advantages(self._global_rows(scored.exp)))
        return scored

    def _generate_dynamic(self, step: int) -> ScoredRollout:
        """DAPO's dynamic sampling: rounds of generation until the step has prompts_per_step groups whose
        rewards are not all equal (or max_sampling_rounds ran); extra groups are dropped, and a shortfall
        is filled with flat groups whose completions are masked out of the loss, so the batch keeps its
        geometry and the loss its normalisation (masked rows count in no denominator). Decided on the
        global batch, so every rank agrees."""
        a = self.cfg.algorithm
        G, need = a.num_generations, self.cfg.prompts_per_step
        pool, reward_time, rounds = None, 0.0, 0
        while rounds < a.max_sampling_rounds:
            scored = self._round(step, rounds)
            reward_time += scored.reward_time
            pool = self._global_rows(scored.exp) if pool is None else concat_experiences(
                [pool, self._global_rows(scored.exp)], self.pad_id)
            rounds += 1
            if int(informative_groups(pool.rewards, G).sum()) >= need:
                break
        informative = informative_groups(pool.rewards, G)
        order = np.concatenate([np.flatnonzero(informative), np.flatnonzero(~informative)])[:need]
        chosen = pool.rows((order[:, None] * G + np.arange(G)).reshape(-1))
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
                             policy_version=np.full(len(exp), self.step, np.int64))

    def _with_advantages(self, everything: Experience) -> Experience:
        everything.advantages = self._estimate(everything.rewards)
        return everything

    def _estimate(self, rewards: np.ndarray) -> np.ndarray:
        """Advantages of a global batch of rewards (groups of G consecutive rows), float32."""
        estimator = get_advantage_estimator(self.cfg.advantage_estimator)
        return np.asarray(estimator(rewards, self.cfg.algorithm.num_generations), np.float32)

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
        return {"ref": dict(self.ref_model.parameters_and_names())} if self.ref_synced else {}

    def load_extra_tensors(self, path: Path, state) -> None:
        if state.get("ref_synced"):
            self.load_tensors(dict(self.ref_model.parameters_and_names()), path / "ref.ckpt")

    # -- metrics --------------------------------------------------------------------------------
    def _warn_if_nothing_to_learn(self, step: int, exp: Experience) -> None:
        """One warning line for a step whose every advantage is 0 (no group's rewards differ, or none was
        scored): its policy-gradient term trained nothing, which would otherwise pass without a word."""
        signal = (exp.advantages != 0) & (exp.completion_mask.sum(1) > 0)
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
