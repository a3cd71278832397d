"""Records tests/data/trl_loss_reference.json: TRL 1.16's GRPO policy losses and their gradients.

Runs in TRL's virtualenv (bench/.venv-trl, see bench/README.md; it never imports mindrlhf). For fixed
log-probs, old log-probs, advantages and masks it runs TRL's own ``GRPOTrainer._compute_loss`` (the unbound
method, on an object that holds only the attributes that method reads, with a real ``accelerate.Accelerator``)
for ``loss_type`` cispo, sapo, luspo and vespo, and writes the loss and d loss / d log-probs. The policy's
log-probs are the leaf tensor that ``_get_per_token_logps_and_entropies`` returns, so the gradient is TRL's
through its whole loss. tests/test_algorithms.py feeds the same inputs to ``mindrlhf.algorithms.policy_loss``.

    bench/.venv-trl/bin/python tests/make_trl_loss_reference.py [--output tests/data/trl_loss_reference.json]
"""
from __future__ import annotations

import argparse
import json
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

    def __init__(self, args: GRPOConfig, logp: torch.Tensor, accelerator: Accelerator):
        self.args, self._logp, self.accelerator = args, logp, accelerator
        self.loss_type, self.beta = args.loss_type, args.beta
        self.epsilon_low, self.epsilon_high = args.epsilon, args.epsilon_high
        self.importance_sampling_level = args.importance_sampling_level
        self.top_entropy_quantile, self.off_policy_mask_threshold = 1.0, None
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(HERE / "data" / "trl_loss_reference.json"),
                        help="where to write the JSON reference")
    out = Path(parser.parse_args().output)
    data = inputs()
    with tempfile.TemporaryDirectory() as work:
        cases = {name: run_case(loss_type, fields, data, Path(work))
                 for name, loss_type, fields in CASES}
    out.write_text(json.dumps({"trl": trl.__version__, "torch": torch.__version__, "inputs": data, "cases": cases},
                              indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main()
