"""Records tests/data/trl_stage_reference.json: TRL 1.16's first logged step of SFT, the reward model, DPO and ORPO.

Runs in TRL's virtualenv (bench/.venv-trl, see bench/README.md). It never imports the ``mindrlhf``
package: the tiny models come from ``mindrlhf/testing.py`` loaded by its file path
(``make_numpy_qwen2``: every weight drawn with numpy's ``default_rng``, so both virtualenvs write
byte-identical safetensors; their checksums are recorded and tests/test_trl_stage_parity.py checks
them before comparing anything). The models are Qwen2 with the real Qwen2.5 vocabulary (151936 rows,
so the repository's Qwen2.5 tokenizer tokenises the rows, as a user's run would) and a narrow body
(hidden 32, 2 layers).

Each trainer runs ONE optimizer step in float32 on CPU over a single micro-batch holding every row
(``per_device_train_batch_size`` = the rows, no gradient accumulation), so TRL's per-micro-batch means
are the step's means. What its step 1 logs (``loss``, ``grad_norm``, ``learning_rate``, every metric)
is written down, with a summary of the update (``update``: float64 sum, sum of absolute values and sum
of squares of ``new - old`` over every weight):

* SFT: prompt/completion rows (completion-only loss) on the policy.
* RM: preference pairs on a ``Qwen2ForSequenceClassification`` folder (one label, pad id 151643 !=
  EOS 151645, so the reward is read at the appended EOS).
* DPO: the same pairs, sigmoid loss, beta 0.1, the policy against a reference of other weights.
* ORPO: the same pairs, beta (lambda) 0.1, the policy alone (``trl.experimental.orpo.ORPOTrainer``).

    bench/.venv-trl/bin/python tests/make_trl_stage_reference.py [--output tests/data/trl_stage_reference.json]
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

#: Settings both sides use (the test turns them into our flags).
SETTINGS: Dict[str, Any] = {
    "lr": 1e-3,  # non-zero, so the update is recorded too; with no warmup, step 1 runs at lr
    "max_grad_norm": 1.0,
    "max_length": 64,  # no row reaches it
    "seed": 42,
    "beta": 0.1,
}
#: name -> (numpy seed, HF class suffix)
MODELS: Dict[str, Any] = {"policy": (1, "CausalLM"), "ref": (2, "CausalLM"), "rm": (3, "SequenceClassification")}
SFT_ROWS: List[Dict[str, str]] = [
    {"prompt": "What is 2+2?", "completion": " 4"},
    {"prompt": "Name a primary colour.", "completion": " Red, blue or yellow."},
    {"prompt": "Translate 'chat' from French.", "completion": " Cat."},
    {"prompt": "Count to five:", "completion": " one two three four five"},
    {"prompt": "Is the sky green?", "completion": " No, it is usually blue."},
    {"prompt": "中文：你好吗？", "completion": " 我很好，谢谢。"},
    {"prompt": "Laugh:", "completion": " ha ha ha ha ha"},
]
PAIR_ROWS: List[Dict[str, str]] = [
    {"prompt": "What is 2+2?", "chosen": " 4", "rejected": " 5"},
    {"prompt": "Name a primary colour.", "chosen": " Blue.", "rejected": " Green, I think."},
    {"prompt": "Capital of France?", "chosen": " Paris.", "rejected": " Rome, of course."},
    {"prompt": "Is ice cold?", "chosen": " Yes.", "rejected": " No, ice is hot."},
    {"prompt": "Spell 'cat':", "chosen": " c-a-t", "rejected": " k-a-t"},
    {"prompt": "2*3=", "chosen": " 6", "rejected": " 5"},
    {"prompt": "Agree?", "chosen": " ok ok ok ok", "rejected": " no"},
]
#: stage -> (rows, the trained model, the reference model or None)
STAGES: Dict[str, Any] = {"sft": ("sft", "policy", None), "rm": ("pairs", "rm", None),
                          "dpo": ("pairs", "policy", "ref"), "orpo": ("pairs", "policy", None)}
ROWS = {"sft": SFT_ROWS, "pairs": PAIR_ROWS}


def jsonl_text(rows: List[Dict[str, Any]]) -> str:
    """The rows' file as both sides write it."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def rows_sha256(rows: List[Dict[str, Any]]) -> str:
    return hashlib.sha256(jsonl_text(rows).encode("utf-8")).hexdigest()


def load_testing_module():
    """``mindrlhf/testing.py`` by its path (the package, which needs MindSpore, is not imported)."""
    spec = importlib.util.spec_from_file_location("mindrlhf_testing_standalone", REPO / "mindrlhf" / "testing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_models(root: Path) -> Dict[str, Path]:
    """The tiny models of ``MODELS`` under ``root``."""
    testing = load_testing_module()
    return {name: testing.make_numpy_qwen2(root / name, seed=seed, kind=kind) for name, (seed, kind) in MODELS.items()}


def update_summary(old: Dict[str, Any], new: Dict[str, Any]) -> Dict[str, float]:
    """float64 sum, sum of |.| and sum of squares of ``new - old`` over every weight (matched by name)."""
    import numpy as np

    assert sorted(old) == sorted(new), (sorted(old), sorted(new))
    s = a = q = 0.0
    for name in old:
        d = np.asarray(new[name], np.float64) - np.asarray(old[name], np.float64)
        s, a, q = s + float(d.sum()), a + float(np.abs(d).sum()), q + float((d * d).sum())
    return {"sum": s, "abs_sum": a, "sum_sq": q}


def run_stage(stage: str, models: Dict[str, Path], tokenizer, workdir: Path) -> Dict[str, Any]:
    """TRL's step-1 log of ``stage`` and the update it made."""
    import torch
    from datasets import load_dataset
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer

    kind, trained, reference = STAGES[stage]
    rows = ROWS[kind]
    source = workdir / f"{kind}.jsonl"
    source.write_text(jsonl_text(rows), encoding="utf-8")
    dataset = load_dataset("json", data_files=str(source), split="train", cache_dir=str(workdir / "cache"))
    common = dict(output_dir=str(workdir / stage), report_to="none", use_cpu=True, bf16=False, fp16=False,
                  gradient_checkpointing=False, save_strategy="no", logging_steps=1, max_steps=1,
                  per_device_train_batch_size=len(rows), gradient_accumulation_steps=1,
                  learning_rate=SETTINGS["lr"], warmup_steps=0, max_grad_norm=SETTINGS["max_grad_norm"],
                  seed=SETTINGS["seed"], max_length=SETTINGS["max_length"])
    path = str(models[trained])
    config = json.loads((models[trained] / "config.json").read_text(encoding="utf-8"))
    assert config["pad_token_id"] == tokenizer.pad_token_id != tokenizer.eos_token_id == config["eos_token_id"]
    if stage == "sft":  # prompt/completion rows: completion_only_loss defaults to True
        trainer = SFTTrainer(model=path, args=SFTConfig(**common), train_dataset=dataset, processing_class=tokenizer)
        assert trainer.completion_only_loss
    elif stage == "rm":
        trainer = RewardTrainer(model=path, args=RewardConfig(**common), train_dataset=dataset,
                                processing_class=tokenizer)
        assert trainer.model.config.pad_token_id == tokenizer.pad_token_id != tokenizer.eos_token_id
    elif stage == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        trainer = ORPOTrainer(model=policy, args=ORPOConfig(**common, beta=SETTINGS["beta"]), train_dataset=dataset,
                              processing_class=tokenizer)
    else:
        policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ref = AutoModelForCausalLM.from_pretrained(str(models[reference]), dtype=torch.float32)
        args = DPOConfig(**common, beta=SETTINGS["beta"], loss_type=["sigmoid"])
        trainer = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=dataset, processing_class=tokenizer)
    old = load_file(str(Path(path) / "model.safetensors"))
    assert next(trainer.model.parameters()).dtype == torch.float32
    trainer.train()
    logged = [h for h in trainer.state.log_history if h.get("step") == 1 and "loss" in h]
    assert len(logged) == 1, trainer.state.log_history
    new = {k: v.detach().cpu().numpy() for k, v in trainer.model.state_dict().items() if k in old}
    return {"rows": kind, "model": trained, "ref_model": reference, "logged": logged[0],
            "update": update_summary(old, new)}


def main() -> None:
    parser = argparse.ArgumentParser(description="Record TRL's step-1 metrics for tests/test_trl_stage_parity.py.")
    parser.add_argument("--tokenizer_dir", default=str(HERE / "data" / "qwen2.5-tokenizer"),
                        help="Hugging Face tokenizer folder (default: the repository's Qwen2.5 tokenizer)")
    parser.add_argument("--output", default=str(HERE / "data" / "trl_stage_reference.json"),
                        help="JSON file to write (default: tests/data/trl_stage_reference.json)")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of " + ",".join(STAGES))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer

    torch.set_num_threads(2)
    testing = load_testing_module()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    out: Dict[str, Any] = {"trl": trl.__version__, "transformers": transformers.__version__,
                           "torch": torch.__version__, "tokenizer": Path(args.tokenizer_dir).name,
                           "made_by": "tests/make_trl_stage_reference.py", "settings": SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = make_models(root / "models")
        out["models"] = {name: {"seed": MODELS[name][0], "kind": MODELS[name][1],
                                **testing.weights_checksum(p)} for name, p in models.items()}
        out["rows"] = {kind: {"sha256": rows_sha256(rows), "rows": rows} for kind, rows in ROWS.items()}
        out["stages"] = {}
        for stage in args.stages.split(","):
            work = root / stage
            work.mkdir()
            out["stages"][stage] = run_stage(stage, models, tokenizer, work)
            print(stage, json.dumps(out["stages"][stage]["logged"]))
    Path(args.output).write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{args.output}: TRL {trl.__version__}")


if __name__ == "__main__":
    main()
