"""What GRPO and PPO share around their updates: the rollout (sample → score), the experience's rows
across replicas, log-prob passes, the train → infer weight sync and the reward/length metrics.

``RolloutTrainer`` is a ``trainer.base.Trainer`` whose steps start from completions it samples itself.
A step's first phase is ``collect(step, timer) -> ScoredRollout``: replayed rows, or every generator replica
samples its share of each global batch of prompts (``_rollout``), pads and decodes them (``_arrays``) and
scores them (``_reward``: the stage's ``RewardManager``), and the stage gathers the global rows
(``_global_rows``), computes what its loss needs on them (``generate``) and keeps its replica's share
(``_train_share``). Each later phase runs under ``with timer("time/<phase>")`` (``PhaseTimer``), and updates cut
mini-batches with ``mini_batch``. Losses are normalised by global counts and gradients summed over ranks, so an
update does not depend on the number of data-parallel workers. A stage subclasses it
(``grpo.GRPOTrainer``, ``ppo.PPOTrainer``) and writes ``train_one_step`` as a list of named phases.
"""
from __future__ import annotations

import json
import logging
import math
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from mindrlhf.data import PromptDataset
from mindrlhf.errors import MindRLHFError
from mindrlhf.generation import Sampler, SamplingParams
from mindrlhf.generation.tool_loop import environment_rewards, tool_loop_of
from mindrlhf.models import CausalLM
from mindrlhf.models.lora import merged_shard_weights
from mindrlhf.models.weights import get_weights
from mindrlhf.parallel import comm
from mindrlhf.parallel.pipeline import PipelineRunner
from mindrlhf.parallel.resharding import reshard_arrays
from mindrlhf.rewards import RewardManager
from mindrlhf.rollout_tools import trajectory_messages
from mindrlhf.trainer.base import Trainer
from mindrlhf.trainer.disaggregated import RolloutLink
from mindrlhf.trainer.experience import (
    Experience,
    bucket,
    left_pad,
    load_experience,
    right_pad,
    save_experience,
    step_file,
)
from mindrlhf.trainer.policy_eval import PolicyEvaluation
from mindrlhf.trainer.sampling import Rollout, prompt_style_of, sample_batches, sampling_params
from mindrlhf.utils import faults

log = logging.getLogger(__name__)
PROMPT_BUCKET = 32  # prompt columns are padded to a multiple of this (fewer compiled shapes)
# Completion columns: the longest completion of the step (over all ranks), rounded up to a multiple
# of this, at most max_completion_length. A policy that learns to stop trains on fewer columns.
COMPLETION_BUCKET = 32


@dataclass
class ScoredRollout:
    """One step's (or one round's) sampled and scored rows: the arrays, and what the arrays do not hold. Every
    list has one entry per row of ``exp``, in its order; ``texts`` is None for a replayed step (its dump holds
    no texts: no completions dump then)."""

    exp: Experience
    texts: Optional[List[str]] = None                           # the decoded completions
    prompts: List[List[int]] = field(default_factory=list)      # each row's prompt token ids
    solutions: List[object] = field(default_factory=list)       # each row's reference answer
    #: (N,) int64: the trainer steps the policy each row was sampled with had taken (the sampler is synced after
    #: every step, so step s samples with version s - 1); None for a replayed step. A one-step-off disaggregated
    #: rollout (``max_staleness`` 1) hands rows one version older to the update from step 2 on.
    policy_version: Optional[np.ndarray] = None
    reward_time: float = 0.0                                    # seconds spent in the reward functions
    #: DAPO's dynamic sampling: ``sampling/rounds``, ``sampling/kept_groups`` and the unfiltered
    #: ``frac_reward_zero_std`` (logged as they are; empty otherwise).
    sampling: Dict[str, float] = field(default_factory=dict)


class PhaseTimer:
    """A step's wall-clock phases: ``with timer("time/ref"): ...`` adds the block's seconds to
    ``times["time/ref"]`` (the order of first use is the order logged); ``start`` is when the step began."""

    def __init__(self):
        self.start = time.perf_counter()
        self.times: Dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0


@dataclass
class MiniBatch:
    """One mini-batch of a step's rows on this rank (``RolloutTrainer.mini_batch``): its micro-batches' local
    row indices and model inputs, and the global counts its loss normalises by."""

    pieces: List[np.ndarray]            # each micro-batch's local row indices
    inputs: List[Dict[str, np.ndarray]]  # each micro-batch's input_ids/attention_mask/completion_ids/completion_mask
    num_tokens: float                   # loss tokens of the mini-batch, summed over train replicas
    num_seqs: float                     # sequences with at least one loss token, summed over train replicas

    def micro(self, **per_row: np.ndarray) -> List[Dict[str, np.ndarray]]:
        """The micro-batches' inputs plus each of ``per_row`` (arrays over this rank's rows) cut to their rows."""
        return [dict(b, **{name: a[r] for name, a in per_row.items()}) for b, r in zip(self.inputs, self.pieces)]


class RolloutTrainer(PolicyEvaluation, Trainer):
    """The rollout half of an RL stage on the shared loop (see the module docstring)."""

    def __init__(self, cfg, *, policy: CausalLM, updater, tokenizer, dataset: PromptDataset, sampler: Optional[Sampler],
                 rewards: Optional[RewardManager], layout, total_steps: int, num_generations: int,
                 rollouts_per_step: int = 1, mask_truncated: bool = False):
        """``sampler``: the rollout backend (``generation.build_sampler``); the policy's weights reach it
        through ``sync_generator`` only. ``num_generations`` completions per prompt; each step samples
        ``rollouts_per_step`` dataset batches; ``mask_truncated``: completions cut at the token limit get a
        zero loss mask (they still count in the reward metrics). ``rewards``: the rule rewards (None: the stage
        scores completions itself)."""
        super().__init__(cfg, model=policy, updater=updater, tokenizer=tokenizer, layout=layout,
                         total_steps=total_steps)
        self.policy, self.dataset, self.sampler, self.rewards = policy, dataset, sampler, rewards
        self.num_generations, self.rollouts_per_step = int(num_generations), int(rollouts_per_step)
        self.mask_truncated = bool(mask_truncated)
        self.pad_id = tokenizer.pad_token_id
        g = cfg.generation
        self.stop_ids = list(g.stop_token_ids) or list(tokenizer.stop_token_ids)
        #: The multi-turn rollout's tools (``generation.tool_loop``); None: one-turn rollouts.
        self.tool_loop = tool_loop_of(cfg, tokenizer)
        #: This replica's tool counts since the step began (calls, failures, turns, completions; every round of a
        #: dynamic-sampling step; a disaggregated trainer's: every generator's), counted in ``_arrays``, logged and
        #: reset by ``_finish_metrics``.
        self._tool_counts = np.zeros(4, np.float64)
        self.batches_drawn = 0  # dataset batches consumed so far (all epochs): where the next step reads
        #: A disaggregated job's trainer (``gen_workers`` > 0): its link to the generator ranks, which sample
        #: every row (``sampler`` is then None); None colocated.
        self.link = None
        #: The trainer's side of the link's timing of the step (``_received_rollout``, logged by ``_finish_metrics``).
        self.link_times: Dict[str, float] = {}
        #: One step off: the version and (rank 0) the weights the generators sample the next step's rows with,
        #: checkpointed so that a resume samples that batch again identically (``train``, ``extra_tensors``).
        self.in_flight: Optional[tuple] = None
        #: Seconds the one-step-off push of the weights took in this step's receive (``collect`` logs it).
        self.push_seconds = 0.0
        #: A disaggregated trainer's evaluation sampler over its policy (``eval_sampler``), built when first needed.
        self._eval_sampler: Optional[Sampler] = None
        #: A merged LoRA sampler (``lora_sampler merged``) has had the whole base once; later syncs load only what
        #: an update changes.
        self._sampler_loaded = False
        if layout is not None and layout.disaggregated:
            self.link = RolloutLink.of_job(cfg, layout, dataset.batch_size, self.rollouts_per_step,
                                           self.num_generations)
        #: The prompt style the training prompts were built with (eval_steps asks its questions the same way; a
        #: custom system prompt: the default style's; trainer.policy_eval).
        self.prompt_style = prompt_style_of(tokenizer, dataset)
        if self.tool_loop is not None and dataset.num_rows:
            shown = tokenizer.decode(dataset.prompt_ids[0, :int(dataset.prompt_length[0])], skip_special_tokens=False)
            unseen = [name for name in self.tool_loop.names if name not in shown]
            if unseen:  # a warning: a custom prompt may describe its tools in its own words
                log.warning("tools %s are not named in the first training prompt: a policy calls only the tools its "
                            "prompts show; convert a prompt mindrecord with mindrlhf-data --tools (prompt rows and "
                            "the default data show the run's tools)",
                            ", ".join(unseen))
        if dataset.report is not None:  # a prompt JSONL file: its skipped rows are listed in output_dir
            self.data_reports = [dataset.report]

    @property
    def one_step_off(self) -> bool:
        """A disaggregated job at max_staleness >= 1: the weights of update s - 1 go to the generators once step
        s's rows are here, not at the end of step s - 1 (``disaggregated.GenerationWorker.train``)."""
        return self.link is not None and self.cfg.parallel.max_staleness > 0 and not self.replaying

    @property
    def replaying(self) -> bool:
        """``--replay_data_file``: every step's rows are read from a recorded run, nothing is sampled (a
        disaggregated job's generators stop at the start: ``train``)."""
        return bool(self.cfg.train.replay_data_file)

    # -- rollout ----------------------------------------------------------------------------------
    def _sampling_params(self, step: int, rollout: int) -> SamplingParams:
        return sampling_params(self.cfg, step, rollout, self.layout.infer_dp_rank, self.num_generations,
                               self.stop_ids)

    def _prompt_batches(self):
        """The next ``rollouts_per_step`` dataset batches (this rank's share), in order; advances the cursor."""
        for r in range(self.rollouts_per_step):
            yield r, self.dataset.nth_batch(self.batches_drawn)
            self.batches_drawn += 1

    def _rollout(self, step: int, round_index: int) -> Rollout:
        """Sample G completions for each prompt of this replica's share of the step's next batches (a trainer of
        a disaggregated job: receive every generator's, ``_received_rollout``)."""
        if self.link is not None:
            return self._received_rollout()
        faults.point("generate", comm.rank())
        return sample_batches(self.sampler, self.dataset, self._prompt_batches(),
                              lambda r: self._sampling_params(step, round_index * self.rollouts_per_step + r),
                              self.tool_loop)

    def _received_rollout(self) -> Rollout:
        """Disaggregated rollout: the step's completions from every generator replica (``RolloutLink.receive``),
        beside the prompts, answers and columns they were sampled for, read from this rank's whole batches and
        cut as the generators' shards are (``ShardedDataset.batch``), in generator-replica order: the rows
        (and their order) a colocated job's ``_global_rows`` gathers."""
        batches = [batch for _, batch in self._prompt_batches()]
        t0 = self.link.now()
        completions, versions, busy = self.link.receive()
        # The trainers' idle time: waiting for the generators' rows. Summed over a step's rounds (dynamic
        # sampling); the intervals span them.
        now, was = self.link.now(), self.link_times
        self.link_times = {"time/trainer_idle": was.get("time/trainer_idle", 0.0) + now - t0,
                           "time/trainer_busy_start": was.get("time/trainer_busy_start", now),
                           "time/generator_busy": was.get("time/generator_busy", 0.0)
                           + float((busy[:, 1] - busy[:, 0]).max()),
                           "time/generator_idle": was.get("time/generator_idle", 0.0) + float(busy[:, 2].max()),
                           "time/generator_busy_start": was.get("time/generator_busy_start", float(busy[:, 0].min())),
                           "time/generator_busy_end": float(busy[:, 1].max())}
        if not getattr(self.cfg.algorithm, "dynamic_sampling", False):  # else after the step's last round
            self.rows_complete()
        bound = self.cfg.parallel.max_staleness
        if (self.step - versions > bound).any():  # the schedule's promise: no row older than max_staleness trains
            raise MindRLHFError(f"step {self.step + 1} received rows sampled by policy version {int(versions.min())}, "
                                f"more than max_staleness {bound} updates old; this is a bug: report it")
        out = Rollout(completions=completions, versions=[int(v) for v in versions])
        K = self.layout.infer.dp
        for j in range(K):
            for batch in batches:
                rows = PromptDataset.shard_rows(len(batch["index"]), j, K)
                out.prompts += [list(map(int, batch["prompt_ids"][i][:batch["prompt_length"][i]])) for i in rows]
                out.solutions += [batch["solution"][i] for i in rows]
                for name, key in self.dataset.reward_columns.items():
                    out.columns.setdefault(name, []).extend(batch[key][i] for i in rows)
                out.index += [int(batch["index"][i]) for i in rows]
        return out

    def rows_complete(self) -> None:
        """A disaggregated job's trainers hold all of the next step's rows (its last round's are here): one step
        off, update ``self.step`` goes to the generators now, and they sample the step after with it while this one
        trains (``GenerationWorker.train`` pulls it after the step's last round too)."""
        if self.one_step_off and self.step > 0:
            t1 = self.link.now()
            self.in_flight = (self.step, self.link.push_weights(self.policy, self.step, keep=True))
            # Logged as the step's time/sync (``collect``), where a synchronous job's push is timed.
            self.push_seconds = self.link.now() - t1

    def _round(self, step: int, round_index: int) -> ScoredRollout:
        """One generation round on this generator replica: sample (``_rollout``), pad and decode (``_arrays``),
        score (``_reward``). Rows are this replica's, widths global; no advantages yet."""
        rollout = self._rollout(step, round_index)
        scored = self._arrays(rollout)
        self._reward(scored, rollout)
        return scored

    def _arrays(self, rollout: Rollout) -> ScoredRollout:
        """The rollout's arrays (padded to the global widths) and texts; rewards not yet scored (NaN)."""
        g = self.cfg.generation
        completions, prompts = rollout.completions, rollout.prompts
        G = self.num_generations
        rep = lambda xs: [x for x in xs for _ in range(G)]  # noqa: E731
        N = len(completions)
        P = bucket(max(len(p) for p in prompts), PROMPT_BUCKET, None)
        # Every rank uses the global width, so rows gathered across ranks line up and the numbers
        # do not depend on how rows are spread over ranks.
        longest = int(comm.all_gather(np.array([max(len(c.token_ids) for c in completions)], np.int64)).max())
        C = bucket(longest, COMPLETION_BUCKET, g.max_completion_length)
        prompt_ids, prompt_mask = left_pad(rep(prompts), P, self.pad_id)
        present = right_pad([[1] * len(c.token_ids) for c in completions], C, 0, np.int32)
        truncated = np.array([c.finish_reason == "length" for c in completions])
        mask = present.astype(np.float32)
        extras = {"completion_present": present}
        if self.tool_loop is not None:
            # The tool results' tokens are context, not the policy's: out of the loss, the KL, the entropy and
            # the length metrics (the attention still sees them: completion_present).
            policy = right_pad([c.tool_mask or [1] * len(c.token_ids) for c in completions], C, 0, np.int32)
            mask *= policy
            extras["tool_mask"] = policy
            self._tool_counts += [sum(c.tool_calls for c in completions), sum(c.tool_failures for c in completions),
                                  sum(c.turns for c in completions), N]
        if self.mask_truncated:
            mask[truncated] = 0.0
        exp = Experience(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask,
            completion_ids=right_pad([c.token_ids for c in completions], C, self.pad_id, np.int32),
            completion_mask=mask, sampler_logp=right_pad([c.logprobs for c in completions], C, 0.0, np.float32),
            truncated=truncated, rewards=np.full(N, np.nan, np.float32),
            reward_per_fn=np.zeros((N, len(self.reward_names)), np.float32), advantages=np.zeros(N, np.float32),
            prompt_index=np.array(rep(rollout.index), np.int64),
            extras=extras)
        if all(len(c.entropies) == len(c.token_ids) for c in completions):  # a sampler that reports them
            exp.extras["sampler_entropy"] = right_pad([c.entropies for c in completions], C, 0.0, np.float32)
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        version = (np.full(N, self.step, np.int64) if rollout.versions is None
                   else np.asarray(rollout.versions, np.int64))
        return ScoredRollout(exp, texts=texts, prompts=rep(prompts), solutions=rep(rollout.solutions),
                             policy_version=version)

    def _reward(self, scored: ScoredRollout, rollout: Rollout) -> None:
        """The reward step: every completion's rewards (total and per function) into ``scored.exp``, and the time
        it took into ``scored.reward_time``. Without a ``RewardManager`` (PPO scored by a model alone) the rewards
        stay NaN."""
        t0 = time.perf_counter()
        if self.rewards is not None:
            G = self.num_generations
            rep = lambda xs: [x for x in xs for _ in range(G)]  # noqa: E731
            # TRL's reward arguments: the prompt text as the model saw it (chat template included) and the ids.
            prompt_texts = rep(self.tokenizer.batch_decode(rollout.prompts, skip_special_tokens=False))
            total, per_fn = self.rewards(scored.texts, scored.solutions, prompts=prompt_texts,
                                         completion_ids=[list(c.token_ids) for c in rollout.completions],
                                         **{name: rep(values) for name, values in rollout.columns.items()},
                                         **environment_rewards(rollout.completions))
            scored.exp.rewards = total.astype(np.float32)
            if per_fn:
                scored.exp.reward_per_fn = np.stack([per_fn[k] for k in self.reward_names], axis=1).astype(np.float32)
        scored.reward_time = time.perf_counter() - t0

    def generate(self, step: int) -> ScoredRollout:
        """Sample and score the step's completions; this train replica's rows (a stage adds what it computes on
        the global rows first, e.g. GRPO's advantages)."""
        scored = self._round(step, 0)
        scored.exp = self._train_share(self._global_rows(scored.exp))
        self._share_lists(scored)
        return scored

    def collect(self, step: int, timer: PhaseTimer) -> ScoredRollout:
        """Step ``step``'s rollout on this train replica: replayed (``--replay_data_file``) or generated and scored
        (``generate``), then recorded (``--save_data_file``); times ``time/generate`` and ``time/reward``."""
        t0 = time.perf_counter()
        if self.cfg.train.replay_data_file:
            scored = ScoredRollout(self.replay(step))
        else:
            scored = self.generate(step)
        # One step off, the weights go out inside the receive (``_received_rollout``): time/sync, not time/generate.
        push, self.push_seconds = self.push_seconds, 0.0
        spent = time.perf_counter() - t0 - scored.reward_time - push
        timer.times["time/generate"] = 0.0 if scored.texts is None else spent
        timer.times["time/reward"] = scored.reward_time
        if push:
            timer.times["time/sync"] = push
        self.record(step, scored.exp)
        return scored

    # -- rows across replicas ---------------------------------------------------------------------
    def _global_rows(self, exp: Experience) -> Experience:
        """Every generator replica's rows of ``exp``, on every rank, in infer-replica order (a disaggregated job's
        trainers received them all: ``exp`` as it is)."""
        if self.link is not None:
            return exp
        P = int(comm.all_gather(np.array([exp.prompt_ids.shape[1]], np.int64)).max())
        if exp.prompt_ids.shape[1] < P:  # one prompt width for the gather
            extra = P - exp.prompt_ids.shape[1]
            exp.prompt_ids = np.pad(exp.prompt_ids, ((0, 0), (extra, 0)), constant_values=self.pad_id)
            exp.prompt_mask = np.pad(exp.prompt_mask, ((0, 0), (extra, 0)))
        keep = self.layout.infer_representative
        return exp.map(lambda a: comm.all_gather(a if keep else a[:0]))

    def _train_share(self, everything: Experience) -> Experience:
        """This train replica's rows of a global batch (contiguous: replica d holds the d-th block)."""
        return everything.rows(self._share_rows(len(everything)))

    def _share_rows(self, n: int) -> np.ndarray:
        """This train replica's row numbers of a global batch of ``n`` rows."""
        dp, d = self.layout.train.dp, self.layout.train_dp_rank
        return np.arange(d * n // dp, (d + 1) * n // dp)

    def _share_lists(self, scored: ScoredRollout) -> None:
        """Disaggregated rollout: a trainer scored every row, so cut the per-row lists of ``scored`` (texts,
        prompts, answers, versions) to the rows of its ``exp`` (``_train_share``). Colocated they are already the
        rows its generator replica sampled."""
        if self.link is None or scored.texts is None:
            return
        rows = self._share_rows(len(scored.texts))
        scored.texts = [scored.texts[i] for i in rows]
        scored.prompts = [scored.prompts[i] for i in rows]
        scored.solutions = [scored.solutions[i] for i in rows]
        scored.policy_version = scored.policy_version[rows]

    def _gather_rows(self, x: np.ndarray) -> np.ndarray:
        """Every train replica's rows of ``x`` once, in replica order."""
        return comm.all_gather(x if self.layout.train_representative else x[:0])

    def _sum_replicas(self, x: np.ndarray) -> np.ndarray:
        """Sum of per-replica values over train replicas (each replica counted once)."""
        x = np.asarray(x, np.float32)
        return comm.all_sum(x if self.layout.train_representative else np.zeros_like(x))

    def record(self, step: int, exp: Experience) -> None:
        """``save_data_file``: every train replica's rows of ``exp`` (in replica order) as step ``step``'s dump;
        rank 0 writes it. A collective when recording: every rank calls it."""
        path = self.cfg.train.save_data_file
        if path:
            gathered = exp.map(self._gather_rows)
            if comm.is_main():
                save_experience(gathered, step_file(path, step))

    def replay(self, step: int) -> Experience:
        """This rank's slice of a step recorded with --save_data_file."""
        exp = load_experience(step_file(self.cfg.train.replay_data_file, step))
        dp = self.layout.train.dp
        if len(exp) % dp or len(exp) != self.cfg.completions_per_step:
            raise MindRLHFError(f"replay file for step {step} has {len(exp)} completions but this run makes "
                                f"{self.cfg.completions_per_step} per step over {dp} data-parallel replicas; use the "
                                f"same chunk_size/num_rollouts/num_generations as the recording run")
        return self._train_share(exp)

    # -- log-probs ------------------------------------------------------------------------------
    def completion_forward(self, runner: PipelineRunner, exp: Experience) -> np.ndarray:
        """``runner``'s per-completion-token output (log-probs, or a critic's values) for every row of ``exp``,
        micro-batch by micro-batch."""
        inputs = exp.train_inputs()
        size = self._micro_size()
        micro = [{"input_ids": inputs["input_ids"][s:s + size], "attention_mask": inputs["attention_mask"][s:s + size],
                  "completion_ids": exp.completion_ids[s:s + size]} for s in range(0, len(exp), size)]
        return np.concatenate(runner.forward(micro))

    def _micro_size(self) -> int:
        """Completions per forward/backward call on this rank: a gradient-accumulation micro-batch, cut
        into train_micro_batches pipeline micro-batches (the config checks that it divides)."""
        return self.cfg.micro_batch_completions // self.cfg.parallel.train_micro_batches

    def mini_batch(self, exp: Experience, k: int, n: int) -> MiniBatch:
        """Mini-batch ``k`` of ``n`` of this rank's rows: local rows j ≡ k (mod n), the same global rows for any
        number of ranks because each rank's share is a multiple of n; cut into micro-batches of ``_micro_size``.
        Its denominators are global (as ``algorithms.loss_denominators`` defines them: sequences with no loss
        tokens do not count), summed over ranks."""
        inputs = exp.train_inputs()
        rows = np.arange(k, len(exp), n)
        sub = exp.completion_mask[rows]
        num_tokens, num_seqs = self._sum_replicas(np.array([sub.sum(), (sub.sum(1) > 0).sum()]))
        size = self._micro_size()
        pieces = [rows[s:s + size] for s in range(0, len(rows), size)]
        base = [{"input_ids": inputs["input_ids"][r], "attention_mask": inputs["attention_mask"][r],
                 "completion_ids": exp.completion_ids[r], "completion_mask": exp.completion_mask[r]} for r in pieces]
        return MiniBatch(pieces, base, float(num_tokens), float(num_seqs))

    # -- sync -----------------------------------------------------------------------------------
    def sync_generator(self) -> None:
        """Push the policy's new weights to the sampler: this rank's arrays in its layout (nothing to do
        when it generates with the policy itself)."""
        if self.link is not None:  # the generator ranks' copy, by broadcast (``disaggregated.RolloutLink``)
            # Called at the end of step self.step + 1, after its update: the weights of that many steps. One step
            # off, they go out when the next step's rows are here instead (``_received_rollout``); on replay the
            # generators have stopped.
            if not (self.one_step_off or self.replaying):
                self.link.push_weights(self.policy, self.step + 1)
            return
        if self.sampler.holds(self.policy):
            return
        if self.cfg.merged_sampler:  # a plain copy of the policy's shard: only the merged projections change
            self.sampler.load_weights(merged_shard_weights(self.policy, changed_only=self._sampler_loaded),
                                      strict=not self._sampler_loaded)
            self._sampler_loaded = True
            return
        if self.layout.pure_dp:
            self.sampler.load_weights(get_weights(self.policy))
        else:  # in memory, every step: assemble each tensor from the train shards, cut the infer shard
            self.sampler.load_weights(reshard_arrays(self.policy, self.layout.train, self.layout.infer, self.rank,
                                                     self.policy.config))


    # -- checkpoint hooks (trainer.base) ----------------------------------------------------------
    @property
    def reward_names(self) -> List[str]:
        """The reward functions' names (none without a ``RewardManager``)."""
        return list(self.rewards.names) if self.rewards is not None else []

    def stage_state(self) -> Dict[str, object]:
        failures = dict(self.rewards.failures) if self.rewards is not None else {}
        state = {"batches_drawn": self.batches_drawn, "reward_failures": failures}
        if self.one_step_off and self.in_flight is not None:
            state["in_flight_version"] = int(self.in_flight[0])
        return state

    def full_extra_tensors(self) -> Dict[str, Dict[str, object]]:
        """One step off: the weights the generators were sampling the next step's rows with (``in_flight``: full
        tensors on rank 0, as ``RolloutLink.push_weights`` sent them, whatever the train layout)."""
        if not (self.one_step_off and self.in_flight is not None and comm.is_main()):
            return {}
        import mindspore as ms

        return {"in_flight": {name: ms.Tensor(value) for name, value in self.in_flight[1].items()}}

    def load_extra_tensors(self, path: Path, state) -> None:
        """A one-step-off checkpoint's weights in flight, for ``train`` to send again (rank 0's; a checkpoint
        without them, e.g. of a synchronous run, resumes with the next step sampled by the current weights)."""
        if not self.one_step_off:
            if "in_flight_version" in state and not self.replaying:  # replayed rows are the recording's anyway
                self._warn_in_flight_dropped(path, state)
            return
        if "in_flight_version" not in state:
            log.warning("--resume %s: the checkpoint holds no weights in flight (a max_staleness 0 run's, or the "
                        "generators started from sft_path_infer); step %d is sampled with the checkpoint's own "
                        "weights (staleness 0), then one step off", path, int(state["step"]) + 1)
            return
        import mindspore as ms

        arrays = ({n: p.asnumpy() for n, p in ms.load_checkpoint(str(path / "in_flight.ckpt")).items()}
                  if comm.is_main() else {})
        self.in_flight = (int(state["in_flight_version"]), arrays)

    def _warn_in_flight_dropped(self, path: Path, state) -> None:
        """A one-step-off checkpoint resumed synchronously or colocated: its next step's rows were being sampled by
        the weights in flight, which this run does not use. One warning line naming the change, as the other
        direction has (``load_extra_tensors``); the math changes, so it must not pass silently."""
        import yaml

        saved_path = path / "config.yaml"
        saved = yaml.safe_load(saved_path.read_text(encoding="utf-8")) if saved_path.is_file() else None
        saved = type(self.cfg).regroup(saved or {}).get("parallel", {})
        p, done = self.cfg.parallel, int(state["step"])
        changes = [f"{name} {saved[name]} -> {getattr(p, name)}" for name in ("gen_workers", "max_staleness")
                   if name in saved and saved[name] != getattr(p, name)] or [f"max_staleness 1 -> {p.max_staleness}"]
        how = " ".join(f"--{name} {saved[name]}" for name in ("gen_workers", "max_staleness") if name in saved)
        log.warning("--resume %s: %s: the checkpoint's in-flight rollout (step %d's rows, sampled by the weights of "
                    "step %d) is dropped; step %d samples afresh, so the resumed steps differ from the uninterrupted "
                    "run (resume with %s to continue it exactly)", path, ", ".join(changes), done + 1,
                    int(state["in_flight_version"]), done + 1, how or "the run's gen_workers and max_staleness")

    def load_stage_state(self, state) -> None:
        # Checkpoints from before dynamic sampling: every step read rollouts_per_step batches.
        self.batches_drawn = int(state.get("batches_drawn", self.step * self.rollouts_per_step))
        if self.rewards is not None:
            self.rewards.failures.update(state.get("reward_failures", {}))

    def after_load(self) -> None:
        if self.link is None:  # a disaggregated job's generators get the weights when training starts (``train``)
            self.sync_generator()

    def train(self) -> List[Dict[str, float]]:
        """The shared loop (``trainer.base``); a disaggregated job's trainers first tell the generator ranks where
        the run starts and send them the policy's weights (``disaggregated.GenerationWorker.train``), or, replaying,
        that there is nothing to sample."""
        if self.link is not None and self.replaying:
            # Every row is read from the recording: the generator ranks are told there is nothing to sample (a run
            # length of 0) and stop, so the trainers train as the recorded run's did, on their own.
            self.link.start(self.step, self.batches_drawn, 0, weights=False)
        elif self.link is not None:
            # A fresh start whose generators load sft_path_infer samples step 1 with it, as colocated.
            weights = self.step > 0 or not self.cfg.generator_checkpoint()
            self.link.start(self.step, self.batches_drawn, self.total_steps, weights)
            if weights and self.one_step_off and self.in_flight is not None:
                # A resumed one-step-off run: the next step's rows were being sampled with the weights of the
                # update before the checkpoint's; sample them again with those (the same rows, the same seeds).
                version, arrays = self.in_flight
                self.in_flight = (version, self.link.push_weights(self.policy, version, arrays))
            elif weights:
                sent = self.link.push_weights(self.policy, self.step, keep=self.one_step_off)
                self.in_flight = (self.step, sent) if self.one_step_off else None
        return super().train()

    # -- metrics and dumps ----------------------------------------------------------------------
    def _reward_metrics(self, exp: Experience) -> Dict[str, float]:
        G = self.num_generations
        # Statistics in float64 on the host, as the advantages: float32 rewards of 1e30 are valid, but their
        # squares overflow float32 (reward_std was logged inf while the advantages were fine).
        rewards = self._gather_rows(exp.rewards).astype(np.float64)
        per_fn = self._gather_rows(exp.reward_per_fn).astype(np.float64)
        groups = rewards.reshape(-1, G)
        with warnings.catch_warnings():  # groups without a score give NaN, logged as "nan": no console noise
            warnings.simplefilter("ignore", RuntimeWarning)
            group_std = np.nanstd(groups, axis=1, ddof=1) if G > 1 else np.zeros(len(groups))
            m = {"reward": float(np.nanmean(rewards)), "reward_std": float(np.nanmean(group_std)),
                 "frac_reward_zero_std": float(np.mean(np.nan_to_num(group_std) < 1e-8))}
        for i, name in enumerate(self.reward_names):
            m[f"rewards/{name}/mean"] = float(np.nanmean(per_fn[:, i])) if np.isfinite(per_fn[:, i]).any() else math.nan
            m[f"rewards/{name}/std"] = float(np.nanstd(per_fn[:, i])) if np.isfinite(per_fn[:, i]).any() else math.nan
        policy_tokens = exp.extras["completion_present"] * exp.extras.get("tool_mask", 1)  # tool tokens not counted
        lengths = self._gather_rows(policy_tokens.sum(1).astype(np.float32))
        truncated = self._gather_rows(exp.truncated.astype(np.float32))
        m.update({"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                  "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float(truncated.mean())})
        if "sampler_entropy" in exp.extras:  # a generated step (replayed dumps do not carry it)
            mask = exp.completion_mask
            sums = self._gather_rows(np.stack([(exp.extras["sampler_entropy"] * mask).sum(1), mask.sum(1)], 1))
            m["entropy"] = float(sums[:, 0].sum() / max(sums[:, 1].sum(), 1.0))
        return m

    def _finish_metrics(self, step: int, metrics: Dict[str, float], timer: PhaseTimer,
                        scored: ScoredRollout) -> Dict[str, float]:
        """What every rollout stage ends a step's metrics with: the reward functions' failure counts, the phase
        times, ``step_time`` (since ``timer.start``), completion ``tokens_per_second``; and the step's completions
        dump every ``log_completions_steps`` steps and at the last (generated steps only: no texts on replay)."""
        exp = scored.exp
        if self.rewards is not None:
            metrics["reward_fn_failures"] = float(sum(self.rewards.failures.values()))
            if self.cfg.reward.reward_errors == "skip":
                metrics.update({f"rewards/{name}/failures": float(n) for name, n in self.rewards.failures.items()})
        metrics.update(timer.times)
        if self.tool_loop is not None:
            metrics.update(self._tool_metrics())
        if self.link is not None and scored.policy_version is not None:
            # Updates between the policy that sampled a row and the one it trained (step - 1 before the update).
            lag = (step - 1 - scored.policy_version).astype(np.float64)
            metrics.update({"staleness/mean": float(lag.mean()), "staleness/max": float(lag.max())})
        if self.link is not None and self.link_times:
            # Busy: the step's wall time but the wait for the rows; the intervals are seconds since the job's start.
            end = self.link.now()
            metrics.update(self.link_times)
            metrics["time/trainer_busy_end"] = end
            metrics["time/trainer_busy"] = (time.perf_counter() - timer.start) - self.link_times["time/trainer_idle"]
            self.link_times = {}
        metrics["step_time"] = time.perf_counter() - timer.start
        tokens = float(self._sum_replicas(np.array([exp.extras["completion_present"].sum()]))[0])
        metrics["tokens_per_second"] = tokens / max(metrics["step_time"], 1e-9)
        every = self.cfg.train.log_completions_steps
        # The last step too: a run shorter than log_completions_steps still shows what it generated.
        if scored.texts is not None and every and (step % every == 0 or step == self.total_steps) and comm.is_main():
            self._dump_completions(step, scored)
        return metrics

    def _tool_metrics(self) -> Dict[str, float]:
        """TRL's ``tools/call_frequency`` (calls per completion) and ``tools/failure_frequency`` (failed calls per
        call), and ``tools/turns/mean`` (assistant turns per completion), over every generator replica's completions
        of the step (all its sampling rounds); none on a replayed step."""
        if self.link is not None:
            # A disaggregated job's trainers each received (``_received_rollout``) and counted every generator's
            # completions: each holds the totals, and summing them over the trainers would count them N times.
            calls, failures, turns, rows = self._tool_counts
        else:  # each generator replica counted its own completions: its tp rank 0 speaks for them
            keep = self.layout.infer_representative
            calls, failures, turns, rows = comm.all_sum(self._tool_counts if keep else np.zeros(4, np.float64))
        self._tool_counts = np.zeros(4, np.float64)
        if not rows:  # a replayed step sampled nothing: no turns to report (0 would read as "no turn at all")
            return {}
        return {"tools/call_frequency": float(calls / max(rows, 1.0)),
                "tools/failure_frequency": float(failures / calls) if calls else 0.0,
                "tools/turns/mean": float(turns / max(rows, 1.0))}

    @property
    def evaluates_policy(self) -> bool:
        return bool(self.cfg.train.eval_steps)

    def evaluate_step(self) -> Dict[str, float]:
        """Every ``eval_steps`` steps and after the last: the policy's GSM8K evaluation (``trainer.policy_eval``)."""
        every = self.cfg.train.eval_steps
        if every and (self.step % every == 0 or self.step == self.total_steps):
            return self.evaluate_policy()
        return {}

    # -- evaluation while training (trainer.policy_eval) -------------------------------------------
    def eval_sampler(self) -> Sampler:
        """The rollout sampler itself (after the step's weight sync, so it holds the policy's weights). A
        disaggregated job's trainer has none: it evaluates on a sampler over its policy, built at the first
        evaluation (what a colocated one-process run samples with), so the eval at step s uses the weights of update
        s at any ``max_staleness``, as colocated; the generators, one update behind one step off and without the
        reward functions, sample on meanwhile."""
        if self.sampler is None:
            if self._eval_sampler is None:
                from mindrlhf.generation.factory import build_sampler, native_sampler

                # With vLLM, the native sampler: a second engine would hold its own KV cache and cores (and a
                # served one serves the generators).
                self._eval_sampler = (native_sampler(self.policy, jit=self.cfg.parallel.jit,
                                                     share_prompts=self.cfg.parallel.share_prompts)
                                      if self.cfg.generation.use_vllm else build_sampler(self.cfg, self.policy))
            return self._eval_sampler
        return self.sampler

    def eval_replicas(self) -> Tuple[int, int, bool]:
        """The generator replicas (infer dp) share the evaluation's questions; a disaggregated job's trainers
        (train dp) share them instead (``eval_sampler``)."""
        if self.link is not None:
            return self.layout.train_dp_rank, self.layout.train.dp, self.layout.train_representative
        return self.layout.infer_dp_rank, self.layout.infer.dp, self.layout.infer_representative

    def eval_generation_settings(self) -> Dict[str, object]:
        """The rollout's completion length, temperature / top_p (maj@k) and stop tokens."""
        g = self.cfg.generation
        return {"max_new_tokens": g.max_completion_length, "temperature": g.temperature, "top_p": g.top_p,
                "stop_token_ids": self.stop_ids}

    def eval_rewards(self) -> Optional[RewardManager]:
        """The run's reward functions (scoring held-out questions: failures give NaN, not counted in training's)."""
        return self.rewards.for_evaluation() if self.rewards is not None else None

    def _dump_completions(self, step: int, scored: ScoredRollout) -> None:
        path = self.output_dir / f"completions_step_{step}.jsonl"
        exp = scored.exp
        prompts = self.tokenizer.batch_decode(scored.prompts, skip_special_tokens=False)
        tool_mask = exp.extras.get("tool_mask")
        with open(path, "w", encoding="utf-8") as f:
            for i, text in enumerate(scored.texts):
                row = {"step": step, "prompt": prompts[i], "completion": text, "solution": scored.solutions[i],
                       "reward": float(exp.rewards[i]), **self._dump_fields(exp, i),
                       "rewards": {n: float(exp.reward_per_fn[i, j]) for j, n in enumerate(self.reward_names)}}
                if tool_mask is not None:  # the trajectory as messages: its turns, calls and the tools' results
                    n = int(exp.extras["completion_present"][i].sum())
                    row["messages"] = trajectory_messages(self.tokenizer, exp.completion_ids[i, :n],
                                                          tool_mask[i, :n])
                f.write(json.dumps(row, ensure_ascii=False) + "\n")

    def _dump_fields(self, exp: Experience, i: int) -> Dict[str, object]:
        """What a completions dump adds for row ``i`` beyond its text and rewards (the stage's view of it)."""
        adv, mask = exp.advantages[i], exp.completion_mask[i] > 0
        if adv.ndim:  # per-token advantages (REINFORCE++): their mean over the completion's loss tokens
            return {"advantage": float(adv[mask].mean()) if mask.any() else 0.0}
        return {"advantage": float(adv)}


def rollout_precheck(cfg) -> None:
    """What must fail before any model of a stage that samples (GRPO, PPO) loads: a typo in a reward function's or a
    tool's dotted path (or a tool without a schema), an unavailable generation backend."""
    from mindrlhf.generation.factory import check_sampler_config
    from mindrlhf.rewards import get_reward_fn

    for name in cfg.reward.reward_funcs:
        get_reward_fn(name)
    if cfg.generation.tools:  # a tool's dotted path, docstring or types, named before any model loads
        from mindrlhf.rollout_tools import ToolBox

        ToolBox(cfg.generation.tools)
    if cfg.generation.environment:  # the class, its reset and its tools' schemas, likewise
        from mindrlhf.rollout_tools.environment import Environment

        env = Environment(cfg.generation.environment)
        if "environment" in cfg.reward.reward_funcs and not env.has_reward:
            raise MindRLHFError(f"reward_funcs has 'environment' but environment {env.name} has no get_reward(); "
                                "add one, or drop that reward")
    check_sampler_config(cfg)
