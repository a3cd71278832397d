"""The pipeline tutorial's block (docs/tutorials/pipeline.md: SFT rows, SFT, pairs from the SFT model, RM, DPO, ORPO,
PPO, GRPO, evaluation) runs top to bottom exactly as written. Each command is the page's, in a fresh folder, with only
shortening flags appended (fewer rows and steps, shorter completions) and, for the one command that reads the
base model (SFT), a tiny random Qwen2 instead of the embedded SmolLM2: every later command finds its model
through the previous stage's run folder, as a user's would."""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_runs import SUITE_RECOMPUTE

REPO = Path(__file__).resolve().parents[1]
FIRST = "mindrlhf-data --sft --output sft.jsonl"
_TRAIN = [x for k, v in SUITE_RECOMPUTE.items() for x in (f"--{k}", v)]
#: Flags appended to each command (by its first two words): fewer rows and steps, shorter completions.
SHORTER = {
    "mindrlhf-data --sft": ["--limit", "6"],
    "mindrlhf-sft": ["--max_steps", "1", "--batch_size", "4", "--micro_batch_size", "2", *_TRAIN],
    "mindrlhf-data --pairs": ["--limit", "2", "--k", "2", "--max_new_tokens", "8", "--no_progress"],
    "mindrlhf-rm": ["--max_steps", "1", "--batch_size", "2", "--micro_batch_size", "2", *_TRAIN],
    "mindrlhf-dpo": ["--max_steps", "1", "--batch_size", "2", "--micro_batch_size", "2", *_TRAIN],
    "mindrlhf-orpo": ["--max_steps", "1", "--batch_size", "2", "--micro_batch_size", "2", *_TRAIN],
    "mindrlhf-ppo": ["--max_steps", "1", "--batch_size", "2", "--micro_batch_size", "1", "--max_new_tokens", "8",
                     *_TRAIN],
    "mindrlhf-grpo": ["--max_steps", "1", "--num_generations", "2", "--chunk_size", "2", "--max_completion_length",
                      "8", *_TRAIN],
    "mindrlhf-eval": ["--limit", "2", "--batch_size", "2", "--max_new_tokens", "8", "--no_progress"],
}


#: The English tutorial page and the Chinese guide, which carry the same block.
PIPELINE_PAGE, CHINESE_GUIDE = "docs/tutorials/pipeline.md", "docs/zh/guide.md"


def readme_pipeline(name: str = PIPELINE_PAGE) -> list:
    """The commands of the page's block that holds ``FIRST``, continuation lines joined, comments dropped."""
    text = (REPO / name).read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S) if b.startswith("# ") and FIRST in b)
    joined = re.sub(r"\\\n\s*", "", block)
    return [shlex.split(line) for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.slow
def test_the_readme_pipeline_runs_top_to_bottom_as_written(tmp_path, qwen_tokenizer_dir):
    from mindrlhf.testing import add_tokenizer, make_tiny_qwen2

    commands = readme_pipeline()
    assert [c[0] for c in commands] == ["mindrlhf-data", "mindrlhf-data", "mindrlhf-sft", "mindrlhf-data",
                                        "mindrlhf-data", "mindrlhf-rm", "mindrlhf-dpo", "mindrlhf-orpo", "mindrlhf-ppo",
                                        "mindrlhf-grpo", "mindrlhf-eval", "mindrlhf-eval", "mindrlhf-eval",
                                        "mindrlhf-eval"]
    assert not any("step_0" in arg for c in commands for arg in c), "a hard-coded checkpoint step"
    tiny = add_tokenizer(make_tiny_qwen2(tmp_path / "tiny", seed=5, max_position_embeddings=1024),
                         qwen_tokenizer_dir)
    work = tmp_path / "work"
    work.mkdir()
    (work / "mindrlhf").symlink_to(REPO / "mindrlhf")  # the tutorial runs in the repository: its packaged data
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    for cmd in commands:
        key = " ".join(cmd[:2]) if cmd[0] == "mindrlhf-data" else cmd[0]
        extra = SHORTER[key] + (["--model", str(tiny)] if cmd[0] == "mindrlhf-sft" else [])
        proc = subprocess.run([*cmd, *extra], cwd=work, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, (cmd, proc.stderr[-3000:])
    for stage in ("sft", "rm", "dpo", "orpo", "ppo", "grpo"):
        assert (work / "output" / stage / "checkpoints" / "step_00000001" / "manifest.json").is_file(), stage
    assert all((work / f"eval_{stage}.jsonl").read_text().count("\n") == 2 for stage in ("dpo", "orpo", "ppo", "grpo"))
    # The SFT run folder is the reward model's base (its lm_head replaced by a score head) and DPO's, whose
    # reference is then that same model: DPO's first step has loss ln 2 and zero rewards, as TRL's.
    first = {stage: json.loads((work / "output" / stage / "metrics.jsonl").read_text().splitlines()[0])
             for stage in ("rm", "dpo")}
    assert {"accuracy", "margin", "mean_reward"} <= set(first["rm"])
    assert first["dpo"]["loss"] == pytest.approx(math.log(2.0), rel=1e-6)
    assert first["dpo"]["rewards/margins"] == 0.0 and first["dpo"]["rewards/accuracies"] == 0.0


def test_the_chinese_guide_has_the_same_pipeline():
    assert readme_pipeline(CHINESE_GUIDE) == readme_pipeline()
