"""``mindrlhf-ppo`` / ``python -m mindrlhf.ppo``: PPO with a critic and a reward model (InstructGPT's RL stage).

The recipe, top to bottom: prompts → the actor samples completions (``trainer.rollout``: the sampler and the
train → infer weight sync GRPO uses) → each completion's score (the reward model's value at its last token,
scaled and biased, plus the rule rewards) → the reference's and critic's passes over the rollout (the actor's
old log-probs are the sampler's; the critic's values come from its first update when a step has one
mini-batch: ``CriticObjective``) → per-token rewards ``−kl_coef·KL_t`` with the score at the last token, GAE,
returns, whitened advantages (``algorithms.ppo``, on the global batch, so every layout computes the same
numbers) → ``ppo_epochs × num_mini_batches`` updates of the actor (the clipped surrogate,
``algorithms.policy_loss``) and of the critic (the clipped value loss, its own float32 masters and AdamW) →
weight sync. Metrics carry the names of TRL's last ``PPOTrainer`` (``objective/*``, ``policy/*``, ``loss/*``,
``val/*``).

With ``tools`` or an ``environment`` the rollout is multi-turn (``generation.tool_loop``): the completion mask the
rollout builds is 0 on the tool results' tokens, so they are out of the KL-shaped rewards (the score goes on the
last policy token), GAE (which carries credit across them to the earlier turns), the whitening and both losses;
such a mask is no prefix, so the step takes the separate values pass (``values_pass``).

Run on one process with ``python`` or on several with ``msrun … -m mindrlhf.ppo --use_parallel true``.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from mindspore import Tensor, ops

from mindrlhf.algorithms import ppo as ppo_math
from mindrlhf.algorithms.losses import aggregate_loss, policy_loss
from mindrlhf.checkpoint.run_dir import CRITIC_ADAPTER_DIR
from mindrlhf.configs.ppo import PPOConfig, PPOModelConfig, parse_ppo_args
from mindrlhf.errors import MindRLHFError
from mindrlhf.parallel import comm
from mindrlhf.trainer.base import recorded_path
from mindrlhf.trainer.disaggregated import build_generator
from mindrlhf.trainer.entry import StageSpec, load_policy, load_reference, load_tokenizer, resolve_weights, run_stage
from mindrlhf.trainer.experience import Experience
from mindrlhf.trainer.metrics import EVAL_CURVE
from mindrlhf.trainer.rollout import MiniBatch, PhaseTimer, RolloutTrainer, rollout_precheck
from mindrlhf.trainer.sampling import load_prompt_dataset
from mindrlhf.trainer.schedule import lr_at
from mindrlhf.utils.cli import run_cli

log = logging.getLogger("mindrlhf")


#: Plots written beside metrics.jsonl with each checkpoint.
PPO_CURVES = (("objective/scores", "reward.png", "PPO: mean score", "score"),
              ("objective/kl", "kl.png", "PPO: KL to the reference (per completion)", "KL"),
              ("loss/value_avg", "loss.png", "PPO: value loss", "value loss"), EVAL_CURVE)


class ActorObjective:
    """The actor's loss of one micro-batch: PPO's clipped surrogate with per-token advantages, averaged over the
    mini-batch's completion tokens (``num_tokens``, global), and the sums of its metrics."""

    inputs = ("completion_mask", "advantages", "old_logp")
    aux = (("tokens", "sum"), ("clipped", "sum"), ("approxkl", "sum"))

    def __init__(self, cliprange: float):
        self.cliprange = float(cliprange)

    def loss(self, logp: Tensor, completion_mask: Tensor, advantages: Tensor, old_logp: Tensor, num_tokens: Tensor):
        loss, m = policy_loss(logp, old_logp, advantages, completion_mask, loss_type="grpo",
                              epsilon_low=self.cliprange, epsilon_high=self.cliprange, loss_agg_mode="token-mean",
                              global_num_tokens=num_tokens)
        mask = (completion_mask > 0).astype(logp.dtype)
        tokens = mask.sum()
        d = ops.stop_gradient(logp - old_logp) * mask
        # TRL's policy/approxkl: 0.5·(logp − logp_old)²; its clipfrac: where the clipped term is the larger,
        # i.e. the ratio left the clip range on the side the advantage pushes (clip_ratio/region_mean).
        return loss, (tokens, m["clip_ratio/region_mean"] * tokens, 0.5 * (d * d).sum())

    def metrics(self, reduced: Dict[str, float]) -> Dict[str, float]:
        tokens = max(reduced["tokens"], 1.0)
        return {"policy/clipfrac": reduced["clipped"] / tokens, "policy/approxkl": reduced["approxkl"] / tokens}


class CriticObjective:
    """The critic's loss of one micro-batch: ``vf_coef`` × the clipped value loss averaged over the mini-batch's
    completion tokens (``algorithms.ppo.clipped_value_loss``).

    The step's last scalar, ``own_targets``, is 1 for the critic's first update of a step when nothing else
    needs the old values first (``PPOTrainer.values_in_update``): the critic's weights are still the old ones,
    so the values this pass computes ARE the old values, and the returns are GAE's of them
    (``algorithms.ppo.gae_returns`` over the micro-batch's ``rewards``), which spares a separate values pass over
    the rollout. The values (without gradient) are the loss's per-row output either way."""

    inputs = ("completion_mask", "returns", "old_values", "rewards")
    aux = (("tokens", "sum"), ("clipped", "sum"))

    def __init__(self, cliprange_value: float, vf_coef: float, gamma: float = 1.0, lam: float = 0.95):
        self.cliprange_value, self.vf_coef = float(cliprange_value), float(vf_coef)
        self.gamma, self.lam = float(gamma), float(lam)

    def loss(self, values: Tensor, completion_mask: Tensor, returns: Tensor, old_values: Tensor, rewards: Tensor,
             num_tokens: Tensor, own_targets: Tensor):
        own = ops.stop_gradient(values)
        fresh = own_targets > 0
        old_values = ops.where(fresh, own, old_values)
        returns = ops.where(fresh, ppo_math.gae_returns(own, rewards, completion_mask, self.gamma, self.lam), returns)
        per_token, clipped = ppo_math.clipped_value_loss(values, old_values, returns, self.cliprange_value)
        mask = (completion_mask > 0).astype(values.dtype)
        value_loss = aggregate_loss(per_token, mask, "token-mean", global_num_tokens=num_tokens)
        return self.vf_coef * value_loss, (mask.sum(), (clipped * mask).sum(), own)

    def metrics(self, reduced: Dict[str, float]) -> Dict[str, float]:
        return {"val/clipfrac": reduced["clipped"] / max(reduced["tokens"], 1.0)}


def reward_model_scores(runner, exp: Experience, micro_size: int) -> np.ndarray:
    """A one-label reward model's score (B,) of each row ``[prompt | completion]``: its ``score`` head at the
    row's last real token, as ``sequence_scores`` reads it on padded rows, but from ``runner``'s ``ValueHead``
    so the rows that share a prompt are packed (the critic's pass; 40% of the padded rows' time on
    SmolLM2 with 8 completions per prompt). The head's column j is the state before completion token j, so
    one pad column is appended to the completions (it is never an input) and column L (the completion's
    length) is the state at its last token — the last prompt token when the completion is empty."""
    present = exp.completion_ids_mask()
    wide = np.concatenate([exp.completion_ids, np.zeros((len(exp), 1), exp.completion_ids.dtype)], axis=1)
    ids = np.concatenate([exp.prompt_ids, exp.completion_ids], axis=1).astype(np.int32)
    mask = np.concatenate([exp.prompt_mask, present], axis=1).astype(np.int32)
    micro = [{"input_ids": ids[s:s + micro_size], "attention_mask": mask[s:s + micro_size],
              "completion_ids": wide[s:s + micro_size]} for s in range(0, len(exp), micro_size)]
    values = np.concatenate(runner.forward(micro))
    return values[np.arange(len(exp)), present.sum(1)].astype(np.float64)


@dataclass
class PPOTargets:
    """PPO's per-token training arrays of this train replica's rows, beside its ``Experience`` (whose
    ``advantages`` PPO fills per token, (B, C), and ``old_logp`` with the actor's old log-probs). All (B, C)
    float32, zero past each completion's end."""

    rewards: np.ndarray                        # −kl_coef·KL_t, plus the score at each completion's last token
    returns: Optional[np.ndarray] = None       # GAE's returns (normalised with value_norm); None until GAE ran
    old_values: Optional[np.ndarray] = None    # the critic's values before this step's updates; None until known


@dataclass
class PPOBatch:
    """The step's numbers on the GLOBAL batch (every train replica's rows, the same on every rank; R rows),
    from which GAE, whitening and the ``objective/*`` metrics are computed."""

    mask: np.ndarray        # (R, C) float32 completion (loss) mask
    old_logp: np.ndarray    # (R, C) float64 the actor's old log-probs
    score: np.ndarray       # (R,) float64 each completion's score (PPOTrainer.scores)
    kl: np.ndarray          # (R, C) per-token KL estimate to the reference (kl_estimator)
    rewards: np.ndarray     # (R, C) the KL-shaped per-token rewards
    values: Optional[np.ndarray] = None  # (R, C) float64 the critic's old values (denormalised), once known


class PPOTrainer(RolloutTrainer):
    """PPO on the shared loop: the actor is the trained model of ``trainer.base`` (its masters and optimizer
    are the checkpoint's policy.ckpt / optimizer.ckpt); the critic is a second ``Updater`` saved beside it."""

    stage = "ppo"
    math_groups = ("algorithm", "reward", "generation", "optimizer", "data")
    headline = "objective/scores"
    curves = PPO_CURVES

    def __init__(self, cfg: PPOConfig, *, actor, critic, tokenizer, dataset, sampler, layout, ref_model=None,
                 reward_model=None, actor_masters=None, critic_masters=None, reload=None):
        from mindrlhf.models.heads import LogProbHead, ValueHead
        from mindrlhf.rewards import RewardManager
        from mindrlhf.trainer.memory import rollout_extent
        from mindrlhf.trainer.update import AdaptersOff, build_frozen_model, build_frozen_runner, build_updater

        a, g, p = cfg.algorithm, cfg.generation, cfg.parallel
        lora = getattr(actor, "lora_spec", None) is not None
        if cfg.uses_reference and ref_model is None and not lora:
            raise MindRLHFError("kl_coef > 0 needs a reference model; the trainer was built without one")
        groups = layout.groups
        temperature = g.temperature
        updater = build_updater(cfg, actor, ActorObjective(a.cliprange), head=LogProbHead(temperature), groups=groups,
                                masters=actor_masters, share_prompts=p.share_prompts, extent=rollout_extent(cfg),
                                what="actor")
        r = cfg.reward
        rewards = RewardManager(list(r.reward_funcs), r.reward_weights, r.reward_errors) if r.reward_funcs else None
        super().__init__(cfg, policy=actor, updater=updater, tokenizer=tokenizer, dataset=dataset, sampler=sampler,
                         rewards=rewards, layout=layout, total_steps=cfg.train.max_steps,
                         num_generations=a.num_generations)
        self.critic = critic
        self.critic_updater = build_updater(cfg, critic, CriticObjective(a.cliprange_value, a.vf_coef, a.gamma, a.lam),
                                            head=ValueHead(), groups=groups, masters=critic_masters,
                                            share_prompts=p.share_prompts, extent=rollout_extent(cfg),
                                            what="critic", reserved=updater.activation_bytes)
        reload = reload or {}
        self.ref_runner = None if ref_model is None else build_frozen_model(
            cfg, ref_model, groups, LogProbHead(temperature), share_prompts=p.share_prompts, reload=reload.get("ref"))
        if cfg.uses_reference and ref_model is None:  # LoRA: the actor's own base, its adapters switched off
            self.ref_runner = AdaptersOff(build_frozen_runner(cfg, actor, groups, LogProbHead(temperature),
                                                              share_prompts=p.share_prompts), actor)
        # The reward model runs as the critic does (per-token values, shared-prompt packed): see reward_model_scores.
        self.rm_runner = None if reward_model is None else build_frozen_model(
            cfg, reward_model, groups, ValueHead(), share_prompts=p.share_prompts, reload=reload.get("rm"))
        self.value_norm = ppo_math.RunningValueNorm(a.value_norm_beta) if a.value_norm else None
        # One mini-batch: the critic's first update of a step runs at the old weights over the whole rollout, so
        # it can compute the old values itself instead of a separate pass (CriticObjective). Not with value_norm
        # (its targets need every return first) nor pipeline stages (the values live on the last one).
        self.values_in_update = a.num_mini_batches == 1 and not a.value_norm and p.train_pp == 1

    # -- scoring ------------------------------------------------------------------------------------
    def model_scores(self, exp: Experience) -> np.ndarray:
        """The reward model's score of every row of ``exp`` (B,): its value at each completion's last token."""
        return reward_model_scores(self.rm_runner, exp, self._micro_size())

    def scores(self, exp: Experience, rm_scores: Optional[np.ndarray]) -> np.ndarray:
        """Each completion's score (B,): the reward model's (scaled, biased) plus the rule rewards' weighted sum
        (a completion no rule scored adds 0), clipped; a truncated completion's replaced by truncated_penalty."""
        r = self.cfg.reward
        total = np.zeros(len(exp)) if rm_scores is None else rm_scores * r.reward_output_scaling + r.reward_output_bias
        total = total + np.nan_to_num(exp.rewards.astype(np.float64), nan=0.0)
        return ppo_math.shape_scores(total, clip=r.max_reward_clip, truncated=exp.truncated,
                                     truncated_penalty=r.truncated_penalty)

    # -- the step -----------------------------------------------------------------------------------
    def train_one_step(self) -> Dict[str, float]:
        """Run PPO step ``self.step + 1``; returns its metrics."""
        a = self.cfg.algorithm
        step, timer = self.step + 1, PhaseTimer()
        scored = self.collect(step, timer)
        exp = scored.exp
        with timer("time/reward_model"):
            rm_scores = self.reward_model_pass(exp)
        with timer("time/old_logp"):
            # The sampler's log-probs are log_softmax(logits / T) of the drawn tokens under the policy it was synced
            # to after the last update (generation.params.Completion): the old policy, without another pass.
            exp.old_logp = (self.completion_forward(self.updater.runner, exp) if a.recompute_old_logp
                            else exp.sampler_logp)
        with timer("time/ref"):
            ref_logp = self.reference_pass(exp)
        batch = self.shaped_rewards(exp, ref_logp, self.scores(exp, rm_scores))
        with timer("time/values"):
            values = self.values_pass(exp, batch)
        self.set_learning_rates()
        targets = PPOTargets(rewards=batch.rewards[self._share_rows(len(batch.mask))].astype(np.float32))
        first_critic = None
        if values is None:  # the critic's first update computes the old values on its way (CriticObjective)
            with timer("time/train"):
                values, first_critic = self._critic_first_update(exp, targets)
        self.advantages_and_returns(exp, targets, values, batch)
        with timer("time/train"):
            train_metrics = self.train_on(exp, targets, first_critic)
        with timer("time/sync"):
            self.sync_generator()
        self.step = step
        exp.rewards = batch.score.astype(np.float32)  # the reward metrics describe the score the step trained on
        metrics = {**self._objective_metrics(exp, batch, rm_scores), **train_metrics, **self.update_metrics()}
        return self._finish_metrics(step, metrics, timer, scored)

    # -- the step's phases --------------------------------------------------------------------------
    def reward_model_pass(self, exp: Experience) -> Optional[np.ndarray]:
        """The reward model's score of this share's rows (B,), None without one; its runner released after."""
        if self.rm_runner is None:
            return None
        rm_scores = self.model_scores(exp)
        self.rm_runner.release()
        return rm_scores

    def reference_pass(self, exp: Experience) -> np.ndarray:
        """The reference's log-probs of this share's rows (B, C); the old log-probs without a reference (kl 0)."""
        if self.ref_runner is None:
            return exp.old_logp
        ref_logp = self.completion_forward(self.ref_runner, exp)
        self.ref_runner.release()
        return ref_logp

    def shaped_rewards(self, exp: Experience, ref_logp: np.ndarray, score: np.ndarray) -> PPOBatch:
        """The KL-shaped per-token rewards on the global batch (every rank the same numbers)."""
        a, gather = self.cfg.algorithm, self._gather_rows
        mask, old_logp, g_score = gather(exp.completion_mask), gather(exp.old_logp).astype(np.float64), gather(score)
        rewards, kl = ppo_math.kl_shaped_rewards(old_logp, gather(ref_logp), mask, g_score, a.kl_coef, a.kl_estimator)
        return PPOBatch(mask=mask, old_logp=old_logp, score=g_score, kl=kl, rewards=rewards)

    def values_pass(self, exp: Experience, batch: PPOBatch) -> Optional[np.ndarray]:
        """The critic's old values of this share's rows (B, C), or None when its first update computes them."""
        # The in-loss targets read each completion's mask as a prefix (its tokens, then padding); anything else (a
        # row with tool tokens between its turns) takes the separate pass (decided on the global batch: every rank
        # the same way).
        in_update = self.values_in_update and bool(np.all(np.diff(batch.mask, axis=1) <= 0))
        return None if in_update else self.completion_forward(self.critic_updater.runner, exp)

    def advantages_and_returns(self, exp: Experience, targets: PPOTargets, values: np.ndarray,
                               batch: PPOBatch) -> None:
        """GAE (and whitening, and the value normaliser) on the global batch; this share's per-token advantages
        into ``exp.advantages``, its returns and old values into ``targets``."""
        a = self.cfg.algorithm
        g_values = self._gather_rows(values).astype(np.float64)
        batch.values = self.value_norm.denormalize(g_values) if self.value_norm is not None else g_values
        advantages, returns = ppo_math.gae(batch.rewards, batch.values, batch.mask, a.gamma, a.lam)
        if self.value_norm is not None:
            self.value_norm.update(returns, batch.mask)
            returns = np.where(batch.mask > 0, self.value_norm.normalize(returns), 0.0)
        if a.adv_norm:
            advantages = ppo_math.masked_whiten(advantages, batch.mask)
        share = self._share_rows(len(batch.mask))
        exp.advantages = advantages[share].astype(np.float32)
        targets.returns = returns[share].astype(np.float32)
        targets.old_values = values.astype(np.float32)

    def _objective_metrics(self, exp: Experience, batch: PPOBatch, rm_scores: Optional[np.ndarray]) -> Dict[str, float]:
        """The rollout's reward metrics and TRL's ``objective/*`` and ``val/*`` of the global batch."""
        a = self.cfg.algorithm
        metrics = self._reward_metrics(exp)
        for k in ("reward_std", "frac_reward_zero_std"):  # group statistics: GRPO's, not PPO's
            metrics.pop(k, None)
        if rm_scores is not None:
            metrics["rewards/reward_model/mean"] = float(np.mean(self._gather_rows(rm_scores)))
        m = batch.mask > 0
        non_score = (-a.kl_coef * batch.kl).sum(1)
        metrics.update({
            "objective/kl": float(batch.kl.sum(1).mean()),
            "objective/entropy": float((-np.where(m, batch.old_logp, 0.0)).sum(1).mean()),
            "objective/non_score_reward": float(non_score.mean()),
            "objective/rlhf_reward": float((batch.score + non_score).mean()),
            "objective/scores": float(batch.score.mean()),
            "val/mean": float(batch.values[m].mean()) if m.any() else 0.0,
            "val/var": float(batch.values[m].var()) if m.any() else 0.0,
        })
        return metrics

    def _share_rows(self, n: int) -> np.ndarray:
        """This train replica's rows of a global batch of ``n`` (``_train_share``'s block)."""
        per = n // self.layout.train.dp
        return np.arange(self.layout.train_dp_rank * per, (self.layout.train_dp_rank + 1) * per)

    def set_learning_rates(self) -> None:
        """This step's learning rates of the actor and the critic (each on its own schedule's peak)."""
        o = self.cfg.optimizer
        self.updater.set_lr(self.learning_rate())
        self.critic_updater.set_lr(lr_at(self.step, lr=self.cfg.critic_lr, min_lr=o.min_lr,
                                         warmup_steps=o.warmup_steps, total_steps=self.total_steps,
                                         schedule=o.lr_schedule))

    def _critic_update(self, batch: MiniBatch, targets: PPOTargets, own_targets: bool = False,
                       outputs: Optional[list] = None) -> Dict[str, float]:
        """One critic update on the mini-batch ``batch`` (``RolloutTrainer.mini_batch``)."""
        if own_targets:  # returns and old values are computed in the loss (CriticObjective)
            zeros = np.zeros_like(targets.rewards)
            returns, old_values = zeros, zeros
        else:
            returns, old_values = targets.returns, targets.old_values
        micro = batch.micro(rewards=targets.rewards, returns=returns, old_values=old_values)
        res = self.critic_updater.step(micro, (batch.num_tokens, float(own_targets)), outputs=outputs)
        self.count_nonfinite(res)
        return res

    def _critic_first_update(self, exp: Experience, targets: PPOTargets):
        """The critic's first update of the step (one mini-batch: every row), which computes the old values of
        this share's rows itself; returns them (B, C) and the update's result."""
        values: list = []
        res = self._critic_update(self.mini_batch(exp, 0, self.cfg.algorithm.num_mini_batches), targets,
                                  own_targets=True, outputs=values)
        return np.concatenate(values).astype(np.float32), res

    def train_on(self, exp: Experience, targets: PPOTargets,
                 first_critic: Optional[Dict[str, float]] = None) -> Dict[str, float]:
        """ppo_epochs × num_mini_batches updates of the actor, then the critic, on this step's rollout.
        ``first_critic``: the result of the critic's first update when ``_critic_first_update`` already made it."""
        a = self.cfg.algorithm
        actor_results, critic_results = [], []
        for epoch in range(a.ppo_epochs):
            for k in range(a.num_mini_batches):
                batch = self.mini_batch(exp, k, a.num_mini_batches)
                res = self.updater.step(batch.micro(advantages=exp.advantages, old_logp=exp.old_logp),
                                        (batch.num_tokens,))
                self.count_nonfinite(res)
                actor_results.append(res)
                done = first_critic is not None and epoch == 0 and k == 0
                critic_results.append(first_critic if done else self._critic_update(batch, targets))
        mean = lambda rs, k: float(np.mean([r[k] for r in rs]))  # noqa: E731
        return {"loss/policy_avg": mean(actor_results, "loss"),
                "policy/approxkl_avg": mean(actor_results, "policy/approxkl"),
                "policy/clipfrac_avg": mean(actor_results, "policy/clipfrac"),
                "loss/value_avg": mean(critic_results, "loss") / self.cfg.algorithm.vf_coef,
                "val/clipfrac_avg": mean(critic_results, "val/clipfrac"),
                "grad_norm": mean(actor_results, "grad_norm"), "val/grad_norm": mean(critic_results, "grad_norm"),
                "learning_rate": self.updater.lr, "critic_learning_rate": self.critic_updater.lr}

    def _dump_fields(self, exp: Experience, i: int) -> Dict[str, object]:
        return {"mean_advantage": float(exp.advantages[i][exp.completion_mask[i] > 0].mean())
                if exp.completion_mask[i].any() else 0.0}

    # -- checkpoint hooks (trainer.base) ------------------------------------------------------------
    def trained(self):
        return [*super().trained(), ("critic", "critic_optimizer", self.critic_updater)]

    def critic_base(self) -> Optional[str]:
        """The critic's input path as recorded (``--critic_model``, else ``--reward_model``, else ``--model``: where
        ``build_trainer`` read it), its adapter's ``base_model_name_or_path``."""
        for flag in ("--critic_model", "--reward_model"):  # '' there: not given
            found = self.input_models.get(flag) or {}
            if found.get("path"):
                return str(found["path"])
        return recorded_path(self.input_models.get("--model"))  # '' there: the packaged default

    def adapter_outputs(self) -> List[Tuple[str, str]]:
        """The actor's adapter folder and the critic's (``save_adapter``)."""
        outputs = super().adapter_outputs()
        if self.lora:
            outputs.append((CRITIC_ADAPTER_DIR, f"the critic's PEFT adapter on {self.critic_base()}"))
        return outputs

    def save_adapter(self) -> Optional[Path]:
        """LoRA: the actor's adapter folder ``output_dir/adapter`` and the critic's ``output_dir/critic_adapter``
        (PEFT's SEQ_CLS task: its adapters and its score head, on the critic's base). Every rank calls it (a
        sharded critic's adapters are gathered, a collective); rank 0 writes."""
        from mindrlhf.models.lora import save_adapter

        out = super().save_adapter()
        adapters = self._full_adapters(self.critic)
        if comm.is_main():
            critic = save_adapter(self.critic, self.output_dir / CRITIC_ADAPTER_DIR, self.critic_base(), adapters)
            log.info("the critic's LoRA adapter (PEFT format, with its score head) written to %s", critic)
        return out

    def _model_files(self, adapters: Optional[Dict[str, object]] = None) -> Dict[str, object]:
        """The actor's config.json and tokenizer files, and ``critic.config.json``: the critic's own config (a
        one-label sequence classifier holding float32 masters), which ``convert_weight --reverse`` reads for
        critic.ckpt (``<stem>.config.json`` first), so the critic exports to an HF *ForSequenceClassification
        directory as a reward model does. A critic made from a causal LM may have no ``pad_token_id``; it gets the
        tokenizer's (the run's padding), without which transformers' classifier cannot score a padded batch."""
        from mindrlhf.checkpoint.hf_io import config_with_dtype

        files = super()._model_files(adapters)
        if self.lora:  # critic.ckpt holds the critic's adapters and score head, not a model to export
            return files
        config = config_with_dtype(self.critic.config.to_hf_dict(), "float32")
        if config.get("pad_token_id") is None and self.tokenizer.pad_token_id is not None:
            config["pad_token_id"] = int(self.tokenizer.pad_token_id)
        files["critic.config.json"] = json.dumps(config, indent=2).encode("utf-8")
        return files

    def load_stage_state(self, state) -> None:
        super().load_stage_state(state)
        if self.value_norm is not None and "value_norm" in state:
            self.value_norm.load_state(state["value_norm"])
        self.critic_updater.load_loss_scale_state(state.get("critic_loss_scale", {}))

    def stage_state(self) -> Dict[str, object]:
        state = super().stage_state()
        if self.value_norm is not None:
            state["value_norm"] = self.value_norm.state()
        if self.critic_updater.scaler is not None:
            state["critic_loss_scale"] = self.critic_updater.loss_scale_state()
        return state


# -- building the run ---------------------------------------------------------------------------------
def build_trainer(cfg: PPOConfig, layout) -> PPOTrainer:
    """Load the actor (and its generator), the critic, the reference, the reward model, the tokenizer and the
    prompts as the config says; return a ready ``PPOTrainer``."""
    from mindrlhf.generation.factory import build_sampler
    from mindrlhf.models import CausalLM, require_causal_lm
    from mindrlhf.parallel.resharding import checkpoint_config, load_shard

    m, a = cfg.model, cfg.algorithm
    actor_path = resolve_weights(m.model_path)
    tokenizer = load_tokenizer(m, actor_path)
    config = checkpoint_config(actor_path)
    require_causal_lm(config, actor_path, "--model", "the actor", "pass the SFT policy as --model and the "
                      "reward model as --reward_model")
    if cfg.uses_reference and m.ref_model_path:  # checked before any weights are read
        require_causal_lm(checkpoint_config(m.ref_model_path), m.ref_model_path, "--ref_model", "PPO's reference",
                          "pass the actor's causal LM (e.g. the SFT checkpoint; the reward model goes to "
                          "--reward_model), or omit --ref_model to use the initial actor")
    if layout.generator:  # a generator rank of a disaggregated job: the sampler and its prompts only
        return build_generator(cfg, layout, tokenizer, config, num_generations=a.num_generations,
                               rollouts_per_step=1, batch_size=a.batch_size)
    shard = layout.groups.shard()
    actor, actor_masters = load_policy(actor_path, config, layout, m.dtype, lora=m, seed=cfg.train.seed)
    # Disaggregated: the generator ranks sample; the actor's weights reach them when training starts.
    sampler_model = None if (layout.shared_generator and not cfg.merged_sampler) or layout.disaggregated \
        or cfg.generation.use_vllm else \
        CausalLM(config, m.dtype, layout.infer_shard())
    ref_model = None
    # No ref_model_path: the initial actor (with LoRA its own base, the adapters switched off: PPOTrainer).
    if cfg.uses_reference and (m.ref_model_path or not m.lora):
        ref_model = load_reference(m.ref_model_path, actor, layout, m.dtype, "initial actor")
    reward_model = None
    if m.reward_model_path:
        rm_config = checkpoint_config(m.reward_model_path)
        check_scorer(rm_config, config, m.reward_model_path, "--reward_model")
        reward_model = load_shard(m.reward_model_path, layout.train, layout.rank, dtype=m.dtype,
                                  tp_group=shard.tp_group)
    critic_path = m.critic_model_path or m.reward_model_path or actor_path
    critic_config = checkpoint_config(critic_path)
    if critic_config.num_labels:
        check_scorer(critic_config, config, critic_path, "--critic_model")
    critic, critic_masters = load_policy(critic_path, critic_config, layout, m.dtype, num_labels=1,
                                         seed=cfg.train.seed, lora=critic_lora(m))
    dataset = load_prompt_dataset(cfg, layout, tokenizer, config, a.batch_size)
    sampler = None if layout.disaggregated else build_sampler(cfg, sampler_model if sampler_model is not None
                                                              else actor)
    reload = {}
    if m.offload_models:  # how each frozen model is read again after a release (trainer.update.ReleasableModel)
        reload["ref"] = partial(load_shard, m.ref_model_path or actor_path, layout.train, layout.rank, dtype=m.dtype,
                                tp_group=shard.tp_group)
        reload["rm"] = partial(load_shard, m.reward_model_path, layout.train, layout.rank, dtype=m.dtype,
                               tp_group=shard.tp_group)
    trainer = PPOTrainer(cfg, actor=actor, critic=critic, tokenizer=tokenizer, dataset=dataset, sampler=sampler,
                         layout=layout, ref_model=ref_model, reward_model=reward_model, actor_masters=actor_masters,
                         critic_masters=critic_masters, reload=reload)
    if sampler_model is not None:
        trainer.sync_generator()  # the generator starts from the actor's weights
    return trainer


def critic_lora(model_cfg: PPOModelConfig) -> Optional[PPOModelConfig]:
    """The critic's LoRA settings: the actor's rank, alpha and targets (``lora_init_from``'s when it sets them),
    with new adapters (PEFT's init): the actor's trained adapter is not the critic's. None without LoRA."""
    if not model_cfg.lora:
        return None
    if not model_cfg.lora_init_from:
        return model_cfg
    from mindrlhf.checkpoint.hf_io import read_json
    from mindrlhf.models.lora import ADAPTER_CONFIG, spec_from_peft

    source = Path(model_cfg.lora_init_from) / ADAPTER_CONFIG
    spec = spec_from_peft(read_json(source), str(source))
    targets = [spec.target_modules] if isinstance(spec.target_modules, str) else list(spec.target_modules)
    return replace(model_cfg, lora_init_from="", lora_rank=spec.r, lora_alpha=spec.alpha,
                   lora_dropout=spec.dropout, lora_target_modules=targets)


def check_scorer(scorer, actor, path: str, flag: str) -> None:
    """A reward model or critic must score the actor's tokens: one label, the same vocabulary."""
    if scorer.num_labels != 1:
        raise MindRLHFError(f"{flag} {path} has {scorer.num_labels} labels; a reward model or critic has one")
    if scorer.vocab_size != actor.vocab_size:
        raise MindRLHFError(f"{flag} {path} has a vocabulary of {scorer.vocab_size} tokens but the actor's has "
                            f"{actor.vocab_size}: it must use the actor's tokenizer")


PPO = StageSpec("ppo", parse=parse_ppo_args, build=build_trainer, precheck=rollout_precheck, models=lambda cfg: {
    "--model": cfg.model.model_path, "--ref_model": cfg.model.ref_model_path,
    "--reward_model": cfg.model.reward_model_path, "--critic_model": cfg.model.critic_model_path})


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``mindrlhf-ppo``)."""
    return run_cli(partial(run_stage, PPO), argv)


if __name__ == "__main__":
    raise SystemExit(main())
