"""Helpers for tests that run the GRPO job on the tiny Qwen2 (``grpo_assets`` in conftest.py)."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMING = ("step_time", "tokens_per_second")


def is_timing(key: str) -> bool:
    """A wall-clock metric (differs between otherwise identical runs)."""
    return key in TIMING or key.startswith("time/")


#: The rollout stages' ``eval/*`` rates and the ``mindrlhf-eval`` summary keys they are.
EVAL_KEYS = {"eval/accuracy": "accuracy", "eval/format_rate": "format_rate",
             "eval/mean_length": "mean_completion_tokens", "eval/truncated_rate": "truncated_rate"}
DEFAULT_REWARDS = ("accuracy", "gsm8k_format")  # the stages' default reward_funcs, and mindrlhf-eval's


def mindrlhf_eval(checkpoint: Path, limit: int, max_new_tokens: int, reward_funcs=DEFAULT_REWARDS) -> dict:
    """``mindrlhf-eval``'s summary of a checkpoint folder on the first ``limit`` packaged questions."""
    from mindrlhf.evaluation.gsm8k_eval import evaluate
    from mindrlhf.rewards import RewardManager

    return evaluate(str(checkpoint), limit=limit, max_new_tokens=max_new_tokens, progress=False,
                    rewards=RewardManager(list(reward_funcs)))


def eval_row(summary: dict) -> dict:
    """A ``mindrlhf-eval`` summary as the ``eval/*`` metrics a run logs for it (the four rates, eval/reward/<fn>)."""
    row = {key: float(summary[name]) for key, name in EVAL_KEYS.items()}
    row.update({f"eval/reward/{name}": value for name, value in summary["rewards"].items()})
    return row


def same_as_mindrlhf_eval(out: Path, rows: list, max_new_tokens: int, reward_funcs=DEFAULT_REWARDS,
                          limit: int = 4) -> None:
    """Every eval row of a run in ``out`` equals mindrlhf-eval's summary of its step's checkpoint: the four rates,
    and eval/reward/<fn> its ``rewards`` for the run's reward functions."""
    for row in rows:
        want = eval_row(mindrlhf_eval(out / "checkpoints" / f"step_{row['step']:08d}", limit, max_new_tokens,
                                      reward_funcs))
        assert {key: value for key, value in row.items() if key.startswith("eval/")} == want, row["step"]
        assert len([k for k in want if k.startswith("eval/reward/")]) == len(reward_funcs), row["step"]


def make_grpo_assets(root: Path, tokenizer_dir: Path, data_dir: Path) -> dict:
    """A tiny Qwen2 HF dir (with the real tokenizer files) and a 16-prompt GSM8K mindrecord."""
    from mindrlhf.data.rlhf_data import convert_to_mindrecord
    from mindrlhf.testing import add_tokenizer, make_tiny_qwen2
    from mindrlhf.tokenizer import Tokenizer

    model_dir = make_tiny_qwen2(root / "model", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=1024)
    add_tokenizer(model_dir, tokenizer_dir)
    rows = (data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()[:16]
    jsonl = root / "gsm8k16.jsonl"
    jsonl.write_text("\n".join(rows) + "\n")
    data = root / "gsm8k16.mindrecord"
    report = convert_to_mindrecord(str(jsonl), str(data), Tokenizer.from_dir(model_dir), max_prompt_length=256,
                                   show_progress=False)
    assert report.rows_written == 16
    return {"model": model_dir, "data": data}


#: The suite's short trainings run the layer graphs: under the default (``recompute auto``) each of its hundreds of
#: tiny trainers would compile its own whole-model graph (5-30 s, CI ~17% longer). test_recompute covers auto and
#: test_layer_graphs / test_offline_stages show none and full equal; a test that needs another mode passes it.
#: The layer graphs are dynamic-shape: the default on CPU (static, one compile per input shape) made tiny-model
#: stage runs slower (tests/test_offline_stages.py's evaluation tests: 40.3 s against 27.0, quiet; bench/README.md);
#: test_layer_graphs shows static and dynamic equal bit for bit.
SUITE_RECOMPUTE = {"recompute": "full", "layer_graph_shapes": "dynamic"}


def grpo_args(assets, out: Path, **overrides) -> list:
    """Command-line flags of a small GRPO run on ``assets``; keyword arguments override fields."""
    cfg = {"sft_path_train": assets["model"], "mind_dataset_dir": assets["data"], "output_dir": out,
           "num_generations": 4, "chunk_size": 2, "max_completion_length": 12, "max_prompt_length": 256,
           "max_steps": 3, "save_steps": 1, "lr": 1e-3, "temperature": 1.0, "tensorboard": "true",
           "progress_bar": "false", "log_completions_steps": 1, **SUITE_RECOMPUTE}
    cfg.update(overrides)
    args = []
    for k, v in cfg.items():
        args += [f"--{k}"] + (list(map(str, v)) if isinstance(v, (list, tuple)) else [str(v)])
    return args


def assert_same_updated_weights(w1: dict, w2: dict, lr: float) -> None:
    """Two runs that should compute the same update (in another float summation order) agree on
    their updated weights (name -> MindSpore tensor or numpy array).

    Adam divides each element by sqrt(v) + eps, so an element whose gradient is near zero can move
    by a fraction of lr on float noise alone. So: almost every element agrees to 1e-6, and none is
    off by half an Adam step or more; a wrong shard, mask or scale would break both.
    """
    import numpy as np

    assert set(w1) == set(w2)
    off = total = 0
    for name in w1:
        a, b = (np.asarray(w[name].asnumpy() if hasattr(w[name], "asnumpy") else w[name]) for w in (w1, w2))
        assert a.shape == b.shape, name
        off += int((~np.isclose(b, a, rtol=1e-5, atol=1e-6)).sum())
        total += a.size
        assert np.abs(b - a).max() < 0.5 * lr, name
    assert off / total < 1e-4, (off, total)


#: Checks beyond CI's time budget (more msrun launches than its 50 minutes hold), run by hand with MINDRLHF_BYHAND=1
#: (``pytest -m byhand``); what they showed is written where the feature is documented.
BYHAND = os.environ.get("MINDRLHF_BYHAND") == "1"


def byhand_only(why: str):
    """Marks a test run only by hand (``MINDRLHF_BYHAND=1``); ``why`` names what CI runs instead."""
    import pytest

    def mark(test):
        return pytest.mark.byhand(pytest.mark.skipif(not BYHAND, reason=f"beyond CI's time; {why}: "
                                                     "MINDRLHF_BYHAND=1")(test))
    return mark


def byhand(value, why: str):
    """A parameter of a test run only by hand (``MINDRLHF_BYHAND=1``): ``why`` names the case CI runs instead."""
    import pytest

    return pytest.param(value, id=str(value), marks=[pytest.mark.byhand, pytest.mark.skipif(
        not BYHAND, reason=f"beyond CI's time; {why}: MINDRLHF_BYHAND=1")])


def assert_same_disaggregated_run(colocated: Path, disaggregated: Path, stems=("policy",), step: int = 2) -> None:
    """A synchronous disaggregated run (``max_staleness`` 0) equals the colocated run of the same layout: every
    metric but the wall-clock ones (rel 1e-6; ``staleness/*`` 0 is its only extra) and the weights of each
    checkpoint file ``stems`` at ``step``."""
    import math

    import mindspore as ms
    import numpy as np

    m1, m2 = read_rows(colocated), read_rows(disaggregated)
    assert [r["step"] for r in m2] == [r["step"] for r in m1] and m1
    for a, b in zip(m1, m2):
        assert {k for k in set(b) - set(a) if not is_timing(k)} == {"staleness/mean", "staleness/max"}
        assert b["staleness/mean"] == b["staleness/max"] == 0.0
        for key, value in a.items():
            if not is_timing(key) and not (isinstance(value, float) and math.isnan(value)):
                assert b[key] == approx(value), (a["step"], key, b[key], value)
    for stem in stems:
        w1, w2 = (ms.load_checkpoint(str(run / "checkpoints" / f"step_{step:08d}" / f"{stem}.ckpt"))
                  for run in (colocated, disaggregated))
        assert set(w1) == set(w2)
        for name in w1:
            np.testing.assert_allclose(w2[name].asnumpy(), w1[name].asnumpy(), rtol=1e-6, atol=1e-9,
                                       err_msg=f"{stem}/{name}")


def approx(value: float):
    """``pytest.approx`` at the disaggregated equality tests' tolerance (float32 sums in the same order)."""
    import pytest

    return pytest.approx(value, rel=1e-6, abs=1e-9)


def read_rows(out: Path) -> list:
    """The rows of ``out/metrics.jsonl``."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run_inprocess(argv) -> int:
    """``mindrlhf-grpo`` in this process; returns its exit code."""
    from mindrlhf.grpo import main

    return main(argv)


def run_cli(argv, env_extra=None, **kw) -> subprocess.CompletedProcess:
    """``python -m mindrlhf.grpo`` in a child process (output captured)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "mindrlhf.grpo", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, **kw)


def launch_env(env_extra=None) -> dict:
    """The environment of an msrun launch: this venv's python first on PATH (msrun starts the first
    one it finds), and tests/ importable, since workers import test reward functions by dotted path
    (tests/e2e_rewards.py)."""
    env = dict(os.environ, **(env_extra or {}))
    # MindSpore's cluster retries (a worker's registration, each collective's setup) wait a random 3-5 s by default;
    # 1 s takes ~5 s off every launch on this box (bench/README.md, "CI time") and changes no result.
    env.setdefault("MS_RETRY_INTERVAL_LOWER", "1")
    env.setdefault("MS_RETRY_INTERVAL_UPPER", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "tests"), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def node_timeout_after(collective_timeout: int) -> dict:
    """The launch environment of a two-node test that kills a worker. msrun's scheduler exits only once the dead node's
    heartbeats have been missing for MS_NODE_TIMEOUT, and the launches wait for it (a killed 2-worker launch took 46 s
    by default, 15 s at 5; bench/README.md, "CI time"); this keeps the dead node just until the survivor has stopped
    by its own ``collective_timeout`` (with a shorter one the cluster aborts the survivor first, without the one-line
    error). Not for every launch: under load a worker's start can miss a short timeout (a 4-worker launch beside
    another test failed its cluster setup at 10 s)."""
    return {"MS_NODE_TIMEOUT": str(collective_timeout + 5)}


def msrun(n: int, argv, log_dir: Path, port: int,
          script: str = "examples/grpo/qwen_grpo_tutorial/grpo_one_stage.py") -> subprocess.CompletedProcess:
    """``msrun`` of ``n`` local workers running ``script`` (the tutorial's grpo_one_stage.py by default) with
    ``argv``; raises with the workers' log tails when it fails."""
    env = launch_env()
    cmd = [str(Path(sys.executable).parent / "msrun"), f"--worker_num={n}", f"--local_worker_num={n}",
           f"--master_port={port}", "--join=True", f"--log_dir={log_dir}",
           str(REPO / script), *map(str, argv)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        logs = "\n".join(p.read_text()[-3000:] for p in sorted(log_dir.glob("*.log")))
        raise AssertionError(f"msrun failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}\n{logs}")
    return proc


def two_nodes(argv, log_dir: Path, port: int, env_extra=None, check: bool = True, workers_per_node: int = 2) -> list:
    """scripts/launch_node.sh started twice, as node 0 here and node 1 in a network namespace of its own
    (a second host reached over a virtual link), forming one job of 2 x ``workers_per_node`` workers. Returns each
    launch's (exit code, output)."""
    env = launch_env(env_extra)
    with second_host() as (netns, master, _):
        procs = []
        for rank in (0, 1):
            cmd = ["bash", str(REPO / "scripts/launch_node.sh"), "--nodes", "2", "--node_rank", str(rank),
                   "--master_addr", master, "--master_port", str(port), "--workers_per_node", str(workers_per_node),
                   "--log_dir", str(log_dir / f"node{rank}"), "--", *map(str, argv)]
            procs.append(subprocess.Popen((["ip", "netns", "exec", netns] if rank else []) + cmd, cwd=REPO, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate(timeout=900)[0] for p in procs]
    if check and any(p.returncode for p in procs):
        logs = "\n".join(f.read_text()[-2000:] for f in sorted(log_dir.rglob("*.log")))
        raise AssertionError(f"launch_node.sh failed {[p.returncode for p in procs]}:\n{outs[0][-2000:]}\n"
                             f"{outs[1][-2000:]}\n{logs}")
    assert (log_dir / "node0" / "scheduler.log").exists() and not (log_dir / "node1" / "scheduler.log").exists()
    return [(p.returncode, out) for p, out in zip(procs, outs)]


def logged_at(log: Path, pattern: str) -> float:
    """The time (s since the epoch) of the first line of a worker log whose message matches ``pattern``."""
    import datetime
    import re

    for line in log.read_text(errors="replace").splitlines():
        if re.search(pattern, line):
            stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            return stamp.timestamp()
    raise AssertionError(f"no line matching {pattern!r} in {log}:\n{log.read_text(errors='replace')[-3000:]}")


def assert_survivor_stopped(results: list, logs: Path, victim: int, killed_at: str, timeout: int,
                            checkpoint: int) -> float:
    """The dead-worker rule on a two-node launch of one worker per node (``two_nodes``' ``results``, rank r on node
    r): rank ``victim`` logged its fault injection (``killed_at``: the log line's pattern after "kills itself at"),
    both launches exit non-zero, and the other rank stops with the one-line error (exit code 3) naming the
    ``collective_timeout`` of ``timeout`` s and the newest complete checkpoint (step ``checkpoint``). Returns the
    seconds from the death to that stop, each test's bound being its own."""
    survivor = 1 - victim
    assert all(code != 0 for code, _ in results), [code for code, _ in results]
    died = logged_at(logs / f"node{victim}" / f"worker_{victim}.log",
                     rf"fault injection: rank {victim} kills itself at {killed_at}")
    assert "Error code: 3" in results[survivor][1], results[survivor][1][-3000:]
    log = logs / f"node{survivor}" / f"worker_{survivor}.log"
    text = log.read_text(errors="replace")
    assert (f"error: worker rank {survivor} of 2:" in text and "died or hangs" in text
            and f"within {timeout} s (MS_CPU_COMM_OP_TIMEOUT)" in text
            and f"newest complete checkpoint here is step {checkpoint}" in text), text[-3000:]
    return logged_at(log, rf"ERROR mindrlhf: rank {survivor}: \w+ failed") - died


@contextlib.contextmanager
def second_host():
    """A second "machine" for multi-node rehearsals: a network namespace joined to this one by a veth
    pair, so processes run under ``ip netns exec NAME`` have their own address and loopback and reach
    this side only over the link. Yields (namespace name, this side's address, its address).

    Two msrun launches in one namespace cannot rehearse two nodes: msrun starts a scheduler wherever
    the master address is a local one, so the second launch would start a second scheduler.
    """
    import shutil

    import pytest

    if os.geteuid() != 0 or shutil.which("ip") is None:  # CI runs as root with iproute2
        pytest.skip("a network namespace needs root and iproute2's ip")
    tag = f"mr{os.getpid() % 100000}"
    net = f"10.231.{os.getpid() % 250}"
    here, there = f"{net}.1", f"{net}.2"
    steps = [["ip", "netns", "add", tag],
             ["ip", "link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b"],
             ["ip", "link", "set", f"{tag}b", "netns", tag],
             ["ip", "addr", "add", f"{here}/30", "dev", f"{tag}a"],
             ["ip", "link", "set", f"{tag}a", "up"],
             ["ip", "netns", "exec", tag, "ip", "addr", "add", f"{there}/30", "dev", f"{tag}b"],
             ["ip", "netns", "exec", tag, "ip", "link", "set", f"{tag}b", "up"],
             ["ip", "netns", "exec", tag, "ip", "link", "set", "lo", "up"]]
    try:
        for cmd in steps:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        yield tag, here, there
    finally:
        subprocess.run(["ip", "link", "del", f"{tag}a"], capture_output=True)
        subprocess.run(["ip", "netns", "del", tag], capture_output=True)


@contextlib.contextmanager
def small_filesystem(path: Path, size_bytes: int):
    """A tmpfs of ``size_bytes`` mounted at ``path`` (a full disk on demand). Yields a function that
    resizes it, for freeing space. Needs root (CI runs as root)."""
    import shutil

    import pytest

    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount")
    path.mkdir(parents=True, exist_ok=True)
    pages = lambda n: f"{max(1, -(-int(n) // 4096)) * 4}k"  # noqa: E731
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={pages(size_bytes)}", "tmpfs", str(path)], check=True)
    try:
        yield lambda n: subprocess.run(["mount", "-o", f"remount,size={pages(n)}", str(path)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def read_only_dir(path: Path):
    """An existing empty folder at ``path`` that this process cannot write into: its mode 0555, or, as root (who
    writes through any mode), a read-only tmpfs mounted there."""
    import shutil

    import pytest

    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    if shutil.which("mount") is None:
        pytest.skip("a read-only folder as root needs mount")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def check_score_export(ckpt_file: Path, model, hf_dir: Path, seed: int = 2) -> None:
    """convert_weight --reverse exports a sequence-classification checkpoint file (a reward model's policy.ckpt, a
    PPO critic's critic.ckpt) to an HF Qwen2ForSequenceClassification directory that transformers loads with the
    scores ``model`` gives (<=1e-4) on a padded batch drawn with ``seed``."""
    import numpy as np
    import torch
    from mindspore import Tensor
    from transformers import AutoModelForSequenceClassification

    from mindrlhf.testing import padded_batch
    from mindrlhf.tools import convert_weight

    assert convert_weight.main(["--reverse", "--input_path", str(ckpt_file), "--output_path", str(hf_dir),
                                "--no_progress"]) == 0
    hf = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen2ForSequenceClassification" and hf.config.num_labels == 1
    ids, mask = padded_batch(1000, seed=seed)
    ids = np.where(mask > 0, ids + 10, hf.config.pad_token_id)  # real ids are never the pad id
    pos = np.clip(mask.cumsum(1) - 1, 0, None)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                  position_ids=torch.tensor(pos)).logits.numpy()
    got = model.scores(Tensor(ids.astype(np.int32)), Tensor(mask.astype(np.int32))).asnumpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
