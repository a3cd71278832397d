"""Evaluation while a policy trains: ``mindrlhf-eval``'s GSM8K evaluation run on the trainer's own sampler.

``PolicyEvaluation`` is the one place every policy stage evaluates: the rollout stages (``trainer.rollout``:
GRPO, PPO) on the sampler they roll out with, SFT and DPO (``trainer.offline.PolicyOfflineTrainer``) on a
sampler built on the trained policy at the first evaluation. Both call ``evaluation.gsm8k_eval.evaluate`` with
the run's ``eval_file`` / ``eval_limit`` / ``eval_num_generations`` (``configs.common.PolicyEvalTrainConfig``),
the training prompt style, the run's tools and the stage's generation settings, so the ``eval/*`` rows are the numbers
``mindrlhf-eval`` gives for that step's checkpoint. The sampler's compiled graphs are released afterwards: the
evaluation must not keep a second set of decode caches alive through training.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Optional, Tuple

import numpy as np

from mindrlhf.errors import MindRLHFError
from mindrlhf.generation import Sampler
from mindrlhf.generation.tool_loop import ToolLoop
from mindrlhf.parallel import comm
from mindrlhf.rewards import RewardManager

#: How many questions ``evaluate`` hands the sampler at once (its ``batch_size``), each with eval_num_generations rows.
EVAL_BATCH = 16

#: ``evaluate``'s summary keys logged as ``eval/*`` metrics.
EVAL_METRICS = {"eval/accuracy": "accuracy", "eval/format_rate": "format_rate",
                "eval/mean_length": "mean_completion_tokens", "eval/truncated_rate": "truncated_rate"}
#: With tools, also these (under ``eval/``, the training metrics' names).
EVAL_TOOL_METRICS = {"tools/call_frequency": "tool_call_frequency", "tools/failure_frequency": "tool_failure_frequency",
                     "tools/turns/mean": "turns_mean"}


class PolicyEvaluation:
    """A trainer mixin: ``evaluate_policy`` (see the module docstring). The stage provides the sampler
    (``eval_sampler``), its generation settings (``eval_generation_settings``), the prompt style its data was built
    with (``prompt_style``) and the reward functions to average (``eval_rewards``)."""

    #: The prompt style of the training data (None: the default style's).
    prompt_style: Optional[str] = None
    #: The run's tools (a rollout stage with ``tools``): the evaluation shows and answers them as its rollouts do.
    tool_loop: Optional[ToolLoop] = None

    def eval_sampler(self) -> Sampler:
        """The sampler that holds the policy's current weights."""
        raise NotImplementedError

    def eval_generation_settings(self) -> Dict[str, Any]:
        """``evaluate``'s ``max_new_tokens``, ``temperature``, ``top_p`` (maj@k) and ``stop_token_ids``."""
        raise NotImplementedError

    def eval_rewards(self) -> Optional[RewardManager]:
        """The reward functions whose means are logged as ``eval/reward/<name>`` (None: the built-in accuracy
        and the prompt style's format reward)."""
        return None

    @property
    def evaluates_policy(self) -> bool:
        """Whether this run evaluates its policy by generation (the stage's switch)."""
        return False

    def check_inputs(self) -> None:
        """Before anything of the run is written: the evaluation's questions are read and checked (a bad eval_file
        fails now, not after the first steps) and its sampling batch must fit in memory."""
        super().check_inputs()
        if not self.evaluates_policy:
            return
        from mindrlhf.evaluation.gsm8k_eval import DEFAULT_DATA, load_questions
        from mindrlhf.trainer.memory import decode_bytes, memory_budget

        t = self.cfg.train
        data = t.eval_file or DEFAULT_DATA
        questions, skipped = load_questions(data, limit=t.eval_limit)
        if not questions:
            raise MindRLHFError(f"eval_file {data}: no question to evaluate ({skipped} rows without a '#### N' final "
                                f"answer); give GSM8K-style question/answer rows, or '' for the packaged sample")
        k, batch = t.eval_num_generations, min(EVAL_BATCH, len(questions))
        length = int(self.eval_generation_settings()["max_new_tokens"])
        dtype_bytes = 4 if self.cfg.model.dtype == "float32" else 2
        need = decode_bytes(self.model.config, batch * k, length, dtype_bytes)
        budget, where = memory_budget(self.cfg.parallel.device_target, 1)
        if need > budget:
            most = max(1, k * budget // need)
            raise MindRLHFError(f"eval_num_generations = {k}: the evaluation samples {batch} questions x {k} "
                                f"completions at once, whose KV cache alone needs at least {need / 2 ** 30:.1f} GiB, "
                                f"more than this worker's {budget / 2 ** 30:.1f} GiB ({where}); use at most {most}")

    def eval_replicas(self) -> Tuple[int, int, bool]:
        """``(replica, replicas, representative)``: this rank's data-parallel replica of the sampler, how many there
        are, and whether this rank speaks for its replica's counts (tp rank 0). One process: ``(0, 1, True)``."""
        return 0, 1, True

    def evaluate_policy(self) -> Dict[str, float]:
        """``eval/*`` of the policy as it is now: ``eval/accuracy``, ``eval/format_rate``, ``eval/mean_length``,
        ``eval/truncated_rate``, ``eval/reward/<fn>`` and ``time/eval``. The data-parallel replicas share the
        questions (``evaluate``'s ``shard``: a replica's tp ranks decode its batches together) and sum their counts,
        so every rank logs the numbers a ``mindrlhf-eval`` of the checkpoint gives, in 1/dp of its time."""
        from mindrlhf.data.gsm8k import DEFAULT_PROMPT_STYLE
        from mindrlhf.evaluation.gsm8k_eval import evaluate

        t0 = time.perf_counter()
        t = self.cfg.train
        k = t.eval_num_generations
        sampler = self.eval_sampler()
        replica, replicas, representative = self.eval_replicas()
        reduce = None
        if replicas > 1:  # one count per replica: its tp ranks hold the same ones
            reduce = lambda v: comm.all_sum(v if representative else np.zeros_like(v))  # noqa: E731
        loop = self.tool_loop
        tools = {} if loop is None else {"tools": loop.toolbox, "environment": loop.environment,
                                         "max_tool_calling_iterations": loop.max_iterations}
        try:
            summary = evaluate(sampler, self.tokenizer, data_path=t.eval_file or None, limit=t.eval_limit,
                               batch_size=EVAL_BATCH,
                               mode="greedy" if k == 1 else "maj", k=k, seed=t.seed,
                               prompt_style=self.prompt_style or DEFAULT_PROMPT_STYLE, rewards=self.eval_rewards(),
                               progress=False, shard=(replica, replicas), reduce=reduce,
                               **tools, **self.eval_generation_settings())
        finally:
            sampler.release()
        out = {key: float(summary[name]) for key, name in EVAL_METRICS.items()}
        out.update({f"eval/reward/{name}": float(value) for name, value in summary["rewards"].items()})
        out.update({f"eval/{key}": float(summary[name]) for key, name in EVAL_TOOL_METRICS.items() if name in summary})
        out["time/eval"] = time.perf_counter() - t0
        return out
