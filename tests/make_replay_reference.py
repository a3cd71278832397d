"""Records tests/data/replay_reference/: a 3-step tiny GRPO run's rollouts (--save_data_file) and the
metrics of an off-policy run replaying them (2 steps, num_iterations 2, mini_batch_size 4, beta 0.04).
test_grpo_e2e.test_replay_matches_the_recorded_reference replays the same rollouts with the current
code and compares. Recorded with commit 3893603 (before the training core):

    PYTHONPATH=tests python tests/make_replay_reference.py OUT_DIR
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from grpo_runs import REPO, grpo_args, make_grpo_assets, run_inprocess

#: The run's settings; the test replays with exactly these.
COMMON = dict(reward_funcs=["e2e_rewards:length_reward"], beta=0.04, max_completion_length=8)
REPLAY = dict(max_steps=2, num_iterations=2, mini_batch_size=4)


def main(out: Path) -> None:
    import mindspore as ms

    ms.set_device("CPU")
    shutil.rmtree(out, ignore_errors=True)
    data = REPO / "tests" / "data"
    assets = make_grpo_assets(out / "assets", data / "qwen2.5-tokenizer", data)
    dump = out / "dump" / "exp.npz"
    assert run_inprocess(grpo_args(assets, out / "full", max_steps=3, save_data_file=dump, **COMMON)) == 0
    assert run_inprocess(grpo_args(assets, out / "replay", replay_data_file=dump, **REPLAY, **COMMON)) == 0
    target = REPO / "tests" / "data" / "replay_reference"
    target.mkdir(parents=True, exist_ok=True)
    for f in sorted((out / "dump").glob("*.npz")):
        shutil.copy(f, target / f.name)
    shutil.copy(out / "replay" / "metrics.jsonl", target / "metrics.jsonl")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
