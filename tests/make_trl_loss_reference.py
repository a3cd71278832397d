"""Records tests/data/trl_loss_reference.json: TRL 1.16's GRPO policy losses and their gradients.

Runs in TRL's virtualenv (bench/.venv-trl, see bench/README.md; it never imports mindrlhf). For fixed
log-probs, old log-probs, advantages and masks it runs TRL's own ``GRPOTrainer._compute_loss`` (the unbound
method, on an object that holds only the attributes that method reads, with a real ``accelerate.Accelerator``)
for ``loss_type`` cispo, sapo, luspo and vespo, and writes the loss and d loss / d log-probs. The policy's
log-probs are the leaf tensor that ``_get_per_token_logps_and_entropies`` returns, so the gradient is TRL's
through its whole loss. tests/test_algorithms.py feeds the same inputs to ``mindrlhf.algorithms.policy_loss``.

The ``rollout_cases`` run one step further back: TRL's own ``_generate_and_score_completions`` (generation,
the old-policy forward and the reward functions replaced by fixed completions, sampler log-probs, trainer
log-probs and per-function rewards) forms the vLLM importance-sampling ratio of each of its four modes and the
advantages (``scale_rewards``, ``multi_objective_aggregation``), and ``_compute_loss`` takes its output: VESPO
with the token-level correction, GRPO with each mode, off-policy masking on the sampler's log-probs, batch-std
scaling and GDPO. tests/test_algorithms.py compares the trainer's objective and advantage functions.

    bench/.venv-trl/bin/python tests/make_trl_loss_reference.py [--output tests/data/trl_loss_reference.json]
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict

import numpy as np
import torch
import trl
from accelerate import Accelerator
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.grpo_trainer import nanstd  # noqa: F401  (imported by the method run below; fails early if moved)

HERE = Path(__file__).resolve().parent
# Four completions of lengths 5, 3, 4, 1 (no empty one: TRL's luspo averages over every row, ours over the
# non-empty ones); log-ratios spread over [-0.6, 0.6] so the clip edges and both advantage signs are crossed.
MASK = [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]]
ADVANTAGES = [1.25, -0.75, 0.5, -1.5]

#: (case name, loss_type, GRPOConfig fields). epsilon_high is TRL's CISPO cap ε_max.
CASES = [
    ("cispo", "cispo", dict(epsilon=0.2, epsilon_high=1.2)),
    ("cispo_cap_5", "cispo", dict(epsilon=0.2, epsilon_high=5.0)),
    ("sapo", "sapo", dict(sapo_temperature_pos=1.0, sapo_temperature_neg=1.05)),
    ("sapo_sharp", "sapo", dict(sapo_temperature_pos=4.0, sapo_temperature_neg=8.0)),
    ("luspo", "luspo", dict(epsilon=0.05, epsilon_high=0.01, importance_sampling_level="sequence")),
    ("vespo", "vespo", dict()),
    ("vespo_params", "vespo", dict(vespo_k_pos=1.5, vespo_lambda_pos=2.0, vespo_k_neg=2.5, vespo_lambda_neg=1.0)),
    ("grpo", "grpo", dict(epsilon=0.2)),
    ("grpo_delta", "grpo", dict(epsilon=0.2, delta=1.25)),
    ("dapo_delta", "dapo", dict(epsilon=0.2, epsilon_high=0.28, delta=1.3)),
    # Off-policy sequence masking without vLLM: TRL measures the KL from old_per_token_logps.
    ("grpo_off_policy_mask", "grpo", dict(epsilon=0.2, off_policy_mask_threshold=0.02)),
]


def inputs() -> Dict[str, Any]:
    """The fixed inputs, rounded to float32 so both sides see the same numbers."""
    rng = np.random.default_rng(11)
    old = rng.uniform(-2.5, -0.2, (4, 5)).astype(np.float32)
    logp = (old + rng.uniform(-0.6, 0.6, (4, 5))).astype(np.float32)
    return {"old_logp": old.tolist(), "logp": logp.tolist(), "advantages": ADVANTAGES, "mask": MASK}


class _LossOnly:
    """What ``GRPOTrainer._compute_loss`` reads from ``self``; its own code computes everything."""

    _compute_loss = GRPOTrainer._compute_loss
    get_gamma_weights = staticmethod(GRPOTrainer.get_gamma_weights)
    get_off_policy_mask = staticmethod(GRPOTrainer.get_off_policy_mask)

    def __init__(self, args: GRPOConfig, logp: torch.Tensor, accelerator: Accelerator):
        self.args, self._logp, self.accelerator = args, logp, accelerator
        self.loss_type, self.beta = args.loss_type, args.beta
        # As GRPOTrainer.__init__ reads them: epsilon_high falls back to epsilon.
        self.epsilon_low = args.epsilon
        self.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        self.importance_sampling_level = args.importance_sampling_level
        self.top_entropy_quantile, self.off_policy_mask_threshold = 1.0, args.off_policy_mask_threshold
        self.use_vllm, self.aux_loss_enabled, self._entropy_bonus_enabled = False, False, False
        self.current_gradient_accumulation_steps, self.max_completion_length = 1, args.max_completion_length
        self.model = SimpleNamespace(training=True)
        self._metrics = {"train": defaultdict(list)}

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        return self._logp, torch.zeros_like(self._logp), None


def run_case(loss_type: str, fields: Dict[str, Any], data: Dict[str, Any], work: Path) -> Dict[str, Any]:
    args = GRPOConfig(output_dir=str(work), loss_type=loss_type, beta=0.0, max_completion_length=5,
                      per_device_train_batch_size=4, num_generations=2, report_to="none", bf16=False,
                      use_cpu=True, **fields)
    accelerator = Accelerator(cpu=True)  # after the config, whose TrainingArguments reset the accelerator state
    logp = torch.tensor(data["logp"], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(data["mask"], dtype=torch.float64)
    batch = {"prompt_ids": torch.zeros((4, 1), dtype=torch.long), "prompt_mask": torch.ones((4, 1)),
             "completion_ids": torch.zeros((4, 5), dtype=torch.long), "completion_mask": mask,
             "advantages": torch.tensor(data["advantages"], dtype=torch.float64),
             "old_per_token_logps": torch.tensor(data["old_logp"], dtype=torch.float64),
             "num_items_in_batch": mask.sum()}
    trainer = _LossOnly(args, logp, accelerator)
    loss = trainer._compute_loss(None, batch)
    loss.backward()
    metrics = {k: float(v[-1]) for k, v in trainer._metrics["train"].items() if k != "entropy"}
    return {"loss_type": loss_type, "fields": fields, "loss": float(loss.detach()), "grad": logp.grad.tolist(),
            "metrics": metrics}


#: Two prompts x G = 3 completions of lengths 5, 3, 4, 1, 2, 5 (T = 5), for the rollout cases.
ROLLOUT_MASK = [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0],
                [1, 1, 1, 1, 1]]
#: Two reward functions of different scales; a None (NaN) from one function, and a completion no function scored.
ROLLOUT_REWARDS = [[1.0, 40.0], [0.0, 10.0], [1.0, None], [0.0, 25.0], [1.0, 70.0], [None, None]]
ROLLOUT_WEIGHTS = [1.0, 0.5]

#: (case name, GRPOConfig fields). Every case samples with "vLLM" (the fixed sampler log-probs), its IS cap low
#: enough that some tokens or completions are truncated or masked.
ROLLOUT_CASES = [
    ("vespo_is_token_truncate", dict(loss_type="vespo", vllm_importance_sampling_correction=True,
                                     vllm_importance_sampling_mode="token_truncate",
                                     vllm_importance_sampling_clip_max=1.2)),
    ("vespo_is_token_mask", dict(loss_type="vespo", vllm_importance_sampling_correction=True,
                                 vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=1.2,
                                 vespo_k_pos=1.5, vespo_lambda_pos=2.0, vespo_k_neg=2.5, vespo_lambda_neg=1.0)),
    ("grpo_is_token_truncate", dict(loss_type="grpo", vllm_importance_sampling_correction=True,
                                    vllm_importance_sampling_mode="token_truncate",
                                    vllm_importance_sampling_clip_max=1.2)),
    ("grpo_is_token_mask", dict(loss_type="grpo", vllm_importance_sampling_correction=True,
                                vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=1.2)),
    ("grpo_is_sequence_truncate", dict(loss_type="grpo", vllm_importance_sampling_correction=True,
                                       vllm_importance_sampling_mode="sequence_truncate",
                                       vllm_importance_sampling_clip_max=1.3)),
    ("dapo_is_sequence_mask", dict(loss_type="dapo", vllm_importance_sampling_correction=True,
                                   vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_max=1.3,
                                   epsilon_high=0.28)),
    ("grpo_is_off_policy_mask", dict(loss_type="grpo", vllm_importance_sampling_correction=True,
                                     vllm_importance_sampling_mode="token_truncate",
                                     vllm_importance_sampling_clip_max=1.25, off_policy_mask_threshold=0.05)),
    ("grpo_scale_batch", dict(loss_type="grpo", vllm_importance_sampling_correction=True,
                              vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=1.25,
                              scale_rewards="batch")),
    ("gdpo_normalize_then_sum", dict(loss_type="grpo", vllm_importance_sampling_correction=True,
                                     vllm_importance_sampling_mode="token_truncate",
                                     vllm_importance_sampling_clip_max=1.25,
                                     multi_objective_aggregation="normalize_then_sum")),
]


def rollout_inputs() -> Dict[str, Any]:
    """The rollout cases' fixed log-probs (float32 values): the trainer's old policy, the sampler's (off by up
    to 0.35 per token, so every mode truncates or masks some) and the policy being trained (up to 0.3 from old)."""
    rng = np.random.default_rng(23)
    shape = (len(ROLLOUT_MASK), len(ROLLOUT_MASK[0]))
    old = rng.uniform(-2.5, -0.2, shape).astype(np.float32)
    sampler = (old + rng.uniform(-0.35, 0.35, shape)).astype(np.float32)
    logp = (old + rng.uniform(-0.3, 0.3, shape)).astype(np.float32)
    return {"old_logp": old.tolist(), "sampler_logp": sampler.tolist(), "logp": logp.tolist(), "mask": ROLLOUT_MASK,
            "rewards_per_func": ROLLOUT_REWARDS, "reward_weights": ROLLOUT_WEIGHTS, "num_generations": 3}


class _Rollout(_LossOnly):
    """What ``_generate_and_score_completions`` reads besides: its generation, the old-policy forward and the reward
    functions give the fixed inputs; its own code forms the importance-sampling ratio and the advantages."""

    _generate_and_score_completions = GRPOTrainer._generate_and_score_completions

    def __init__(self, args: GRPOConfig, data: Dict[str, Any], logp: torch.Tensor, accelerator: Accelerator):
        super().__init__(args, logp, accelerator)
        self._data = data
        self.use_vllm = True
        self.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction
        self.vllm_importance_sampling_mode = args.vllm_importance_sampling_mode
        self.vllm_importance_sampling_clip_max = args.vllm_importance_sampling_clip_max
        self.vllm_importance_sampling_clip_min = args.vllm_importance_sampling_clip_min
        self.multi_objective_aggregation, self.scale_rewards = args.multi_objective_aggregation, args.scale_rewards
        self.num_generations = self.num_generations_eval = data["num_generations"]
        self.num_iterations = args.num_iterations
        self.reward_weights = torch.tensor(data["reward_weights"], dtype=torch.float32)
        self.reward_func_names = ["first", "second"]
        self.reward_funcs = self.reward_func_names  # only counted here
        self.environment_factories, self.environments, self.tools = None, None, None
        self.pad_to_multiple_of, self.mask_truncated_completions, self.log_multimodal = None, False, False
        self._tokenizer = SimpleNamespace(pad_token_id=0)
        self.model = SimpleNamespace(training=True, is_gradient_checkpointing=False)
        self.ref_model = None
        self._logs = {"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [],
                      "extra": defaultdict(list)}
        self._pending_extra_logs, self._pending_metrics = {}, {}

    def _generate(self, prompts):
        lengths = [sum(row) for row in self._data["mask"]]
        completion_ids = [[7] * n for n in lengths]  # no EOS: nothing is masked as truncated either
        sampler = [row[:n] for row, n in zip(self._data["sampler_logp"], lengths)]
        return [[5, 6]] * len(prompts), completion_ids, None, ["x" * n for n in lengths], sampler, {}, None, None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args,
                                           compute_entropy=False, **kwargs):
        if compute_entropy:  # _compute_loss: the policy being trained, the gradient's leaf
            return self._logp, torch.zeros_like(self._logp), None
        return torch.tensor(self._data["old_logp"], dtype=torch.float64), None, None  # the old policy

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rows = [[math.nan if r is None else r for r in row] for row in self._data["rewards_per_func"]]
        return torch.tensor(rows, dtype=torch.float32)


def run_rollout_case(fields: Dict[str, Any], data: Dict[str, Any], work: Path) -> Dict[str, Any]:
    # Two iterations per generation: the policy trained is not the old one (the recorded log-probs differ).
    args = GRPOConfig(output_dir=str(work), beta=0.0, max_completion_length=5, per_device_train_batch_size=6,
                      num_generations=data["num_generations"], num_iterations=2, report_to="none", bf16=False,
                      use_cpu=True,
                      **{"epsilon": 0.2, **fields})
    accelerator = Accelerator(cpu=True)
    logp = torch.tensor(data["logp"], dtype=torch.float64, requires_grad=True)
    trainer = _Rollout(args, data, logp, accelerator)
    batch = trainer._generate_and_score_completions([{"prompt": "p"} for _ in data["mask"]])
    assert batch["completion_mask"].tolist() == data["mask"]
    loss = trainer._compute_loss(None, batch)
    loss.backward()
    metrics = {k: float(v[-1]) for k, v in trainer._metrics["train"].items()
               if k != "entropy" and not k.startswith("completions/")}
    out = {"fields": fields, "advantages": batch["advantages"].tolist(), "loss": float(loss.detach()),
           "grad": logp.grad.tolist(), "metrics": metrics}
    if "importance_sampling_ratio" in batch:
        out["importance_sampling_ratio"] = batch["importance_sampling_ratio"].tolist()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(HERE / "data" / "trl_loss_reference.json"),
                        help="where to write the JSON reference")
    out = Path(parser.parse_args().output)
    data = inputs()
    with tempfile.TemporaryDirectory() as work:
        cases = {name: run_case(loss_type, fields, data, Path(work))
                 for name, loss_type, fields in CASES}
        rollout_data = rollout_inputs()
        rollout_cases = {name: run_rollout_case(fields, rollout_data, Path(work)) for name, fields in ROLLOUT_CASES}
    out.write_text(json.dumps({"trl": trl.__version__, "torch": torch.__version__, "inputs": data, "cases": cases,
                               "rollout_inputs": rollout_data, "rollout_cases": rollout_cases},
                              indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} loss cases and {len(rollout_cases)} rollout cases to {out}")


if __name__ == "__main__":
    main()
