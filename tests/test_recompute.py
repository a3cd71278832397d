"""recompute auto | full | selective | none (trainer.memory): the estimates by hand, the decision, the settings.

That ``none``, ``full`` and ``selective`` give the same losses and gradients is tested on the runner in
test_layer_graphs.py (log-prob and statistics heads) and on a reward model's training in
test_offline_stages.py."""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from mindrlhf.configs.common import RECOMPUTE_MODES
from mindrlhf.trainer.memory import (
    CALIBRATION,
    HEAD_BYTES,
    MicroBatchExtent,
    activation_bytes,
    decoder_gflop,
    kept_bytes,
    memory_budget,
    resolve_recompute,
    rollout_extent,
)

REPO = Path(__file__).resolve().parents[1]

# A small decoder config, numbers chosen so every term is visible.
SMALL = SimpleNamespace(hidden_size=8, head_dim=4, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=16, vocab_size=32)
TINY = SimpleNamespace(hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=151936)
SMOLLM2 = SimpleNamespace(hidden_size=576, head_dim=64, num_attention_heads=9, num_key_value_heads=3,
                          intermediate_size=1536, vocab_size=49152)


def test_extents_by_hand():
    padded = MicroBatchExtent.padded(2, 3)
    assert (padded.tokens, padded.score_pairs, padded.logit_rows) == (6, 18, 6)
    assert MicroBatchExtent.padded(2, 3, logit_rows=0).logit_rows == 0
    # 8 completions of 2 tokens, 4 per 3-token prompt, packed: 2 rows of 3 + 4 * 2 positions; each row's prompt
    # sees itself (3 * 3 pairs), each completion its prompt and itself (2 * (3 + 2)).
    packed = MicroBatchExtent.shared_prompts(8, 4, 3, 2, packed=True)
    assert (packed.tokens, packed.score_pairs, packed.logit_rows) == (22, 2 * (9 + 4 * 2 * 5), 16)
    assert MicroBatchExtent.shared_prompts(8, 4, 3, 2, packed=False) == MicroBatchExtent(40, 200, 16)
    # A micro-batch smaller than a group: one packed row of its completions.
    assert MicroBatchExtent.shared_prompts(2, 4, 3, 2, packed=True) == MicroBatchExtent(7, 9 + 2 * 2 * 5, 4)


def test_activation_estimate_by_hand():
    extent = MicroBatchExtent.padded(2, 3)  # 6 tokens, 18 score pairs, 6 logit rows
    # per token: 2 x (norms 10 x 8 in float32 + q 9 x 8 + k, v 8 x 4 + MLP 4 x 16 + residuals 4 x 8) elements
    per_token = 2 * (80 + 72 + 32 + 64 + 32) * 4
    per_pair = 6 * 4 * 2  # 6 float32 score tensors per head, 2 heads
    head = 6 * HEAD_BYTES * 32  # per logit row and vocabulary entry
    want = CALIBRATION * (2 * (6 * per_token + 18 * per_pair) + head)
    assert activation_bytes(SMALL, extent, layers=2) == int(want)
    # float16: the norms stay float32 (half as many 2-byte elements would hold them), the rest halves.
    per_token16 = 2 * (80 * 2 + 72 + 32 + 64 + 32) * 2
    assert activation_bytes(SMALL, extent, layers=2, dtype_bytes=2) == int(CALIBRATION * (
        2 * (6 * per_token16 + 18 * per_pair) + head))
    # tp = 2: this rank's heads, KV width, MLP columns and vocabulary halve; the hidden width does not.
    per_token_tp = 2 * (80 + 36 + 16 + 32 + 32) * 4
    assert activation_bytes(SMALL, extent, layers=2, tp=2) == int(CALIBRATION * (
        2 * (6 * per_token_tp + 18 * 6 * 4 * 1) + 6 * HEAD_BYTES * 16))


def test_the_estimate_reproduces_the_two_measurements():
    """The calibration points (bench/README.md, recompute.py), micro-batches of a 126-token prompt and 4 packed
    completions: SmolLM2 (completions of 160) kept 6.4 GiB more peak RSS without recompute than with it, the
    2-layer tiny Qwen2 (completions of 128) 0.94 GiB."""
    extent = MicroBatchExtent.shared_prompts(4, 4, 126, 160, packed=True)
    assert extent.tokens == 766
    assert activation_bytes(SMOLLM2, extent, layers=30) / 2 ** 30 == pytest.approx(6.4, rel=0.02)
    tiny = MicroBatchExtent.shared_prompts(4, 4, 126, 128, packed=True)
    assert activation_bytes(TINY, tiny, layers=2) / 2 ** 30 == pytest.approx(0.94, rel=0.06)


def test_default_budget_is_a_share_of_available_memory():
    def available():
        with open("/proc/meminfo", encoding="ascii") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))

    one, source = memory_budget("CPU", 1)
    assert one == pytest.approx(0.8 * available(), rel=0.05) and "available host memory" in source
    two, source = memory_budget("CPU", 2)
    assert two == pytest.approx(one / 2, rel=0.05) and "/ 2 workers" in source
    assert memory_budget("CPU", 2, budget_gb=1.5) == (int(1.5 * 2 ** 30), "memory_budget_gb")


def _updater(model, cfg, reserved=0):
    from mindrlhf.models.heads import LogProbHead
    from mindrlhf.sft import SFTObjective
    from mindrlhf.trainer.update import build_updater

    return build_updater(cfg, model, SFTObjective(), head=LogProbHead(stats=True), extent=rollout_extent(cfg),
                         reserved=reserved)


def test_auto_keeps_activations_on_the_tiny_job_and_recomputes_under_a_small_budget(tiny_qwen2_dir, caplog,
                                                                                     monkeypatch):
    """``auto`` on bench/peer_trl.py's tiny job (4 completions of 128 tokens per micro-batch, Qwen's vocabulary)
    picks ``none`` on a machine with 20 GiB available, ``full`` under a memory_budget_gb below the estimate, and
    ``full`` for a second model when the first's planned activations leave too little; it logs each decision
    once with its figures. ``full`` and ``none`` are taken as given."""
    from mindrlhf.configs.grpo_configs import parse_args as parse_grpo_args
    from mindrlhf.models import load_model
    from mindrlhf.trainer import memory

    monkeypatch.setattr(memory, "_mem_available", lambda: 20 * 2 ** 30)  # the host, not MindSpore
    model = load_model(tiny_qwen2_dir)
    caplog.set_level(logging.INFO, logger="mindrlhf.trainer.memory")
    job = ["--micro_batch_size", "4", "--max_completion_length", "128"]  # recompute auto, the default
    cfg = parse_grpo_args(job)
    need = activation_bytes(model.config, rollout_extent(cfg), layers=model.config.num_hidden_layers)
    assert 0.5 * 2 ** 30 < need < 2 * 2 ** 30  # mostly the 512 rows of float32 logits over 151,936 tokens
    first = _updater(model, cfg)
    assert (first.recompute, first.activation_bytes) == ("none", need)
    [line] = [r.getMessage() for r in caplog.records]
    assert line == (f"recompute auto -> none for the policy: without recompute its largest micro-batch "
                    f"({320 + 4 * 128} positions) would hold ~{need / 2 ** 30:.2f} GiB of activations; budget "
                    "16.00 GiB (80% of available host memory)")
    caplog.clear()
    small = parse_grpo_args(job + ["--memory_budget_gb", str(need / 2 / 2 ** 30)])
    assert _updater(model, small).recompute == "full"
    [line] = [r.getMessage() for r in caplog.records]
    assert "-> full" in line and line.endswith("(memory_budget_gb); so each layer is recomputed in the backward "
                                               "instead (memory_budget_gb or recompute none keeps the activations "
                                               "anyway)")
    caplog.clear()
    just = parse_grpo_args(job + ["--memory_budget_gb", str(1.5 * need / 2 ** 30)])
    assert _updater(model, just).recompute == "none"
    assert _updater(model, just, reserved=need).recompute == "full"  # a second model, the first's planned kept
    caplog.clear()
    for mode in ("full", "selective", "none"):
        assert _updater(model, parse_grpo_args(job + ["--recompute", mode, "--memory_budget_gb", "0.000001"])
                        ).recompute == mode
    assert not caplog.records


def test_decoder_work_by_hand():
    extent = MicroBatchExtent.padded(2, 3)  # 6 tokens, 18 score pairs
    # projections: q and o 8 x 8 each, k and v 8 x 4 each, gate/up/down 8 x 16 each; 2 FLOP per weight and token
    weights = 8 * 8 * 2 + 8 * 4 * 2 + 3 * 8 * 16
    # attention: scores and their product with v, 2 FLOP per multiply-add over head_dim 4, 2 heads
    per_layer = 2 * weights * 6 + 2 * 2 * 4 * 2 * 18
    assert decoder_gflop(SMALL, extent, layers=2) == pytest.approx(2 * per_layer / 1e9, rel=1e-12)
    # tp = 2: this rank's heads, KV width and MLP columns halve
    weights_tp = 8 * 4 * 2 + 8 * 2 * 2 + 3 * 8 * 8
    assert decoder_gflop(SMALL, extent, layers=2, tp=2) == pytest.approx(
        2 * (2 * weights_tp * 6 + 2 * 2 * 4 * 1 * 18) / 1e9, rel=1e-12)


def test_selective_kept_bytes_by_hand():
    extent = MicroBatchExtent.padded(2, 3)  # 6 tokens
    # per layer and token: q 8, k 4, v 4, the attention output 8, gate 16, up 16 values
    assert kept_bytes(SMALL, extent, layers=2) == 2 * 6 * (8 + 4 + 4 + 8 + 16 + 16) * 4
    # tp = 2: q, k, v, gate and up halve; the attention output is the full width (after o_proj's reduce)
    assert kept_bytes(SMALL, extent, layers=2, tp=2, dtype_bytes=2) == 2 * 6 * (4 + 2 + 2 + 8 + 8 + 8) * 2


def test_auto_recomputes_through_static_layer_graphs_when_the_decoder_work_pays(tiny_qwen2_dir, caplog,
                                                                                monkeypatch):
    """With static-shape layer graphs (CPU's default) ``auto`` picks ``full`` for SmolLM2's GRPO micro-batch even
    with memory to spare (as fast, a third of the memory: bench/README.md), keeps ``none`` for the tiny peer job
    (dispatch-bound: a compile per shape costs more than it saves), and with dynamic layer graphs decides by
    memory as before; it never picks ``selective``, which is taken as given with its kept bytes. The config
    reaches the decision through ``build_updater``."""
    from mindrlhf.configs.grpo_configs import parse_args as parse_grpo_args
    from mindrlhf.models import load_model
    from mindrlhf.trainer import memory

    monkeypatch.setattr(memory, "_mem_available", lambda: 20 * 2 ** 30)
    smol = MicroBatchExtent.shared_prompts(4, 4, 126, 160, packed=True)  # the peer job's micro-batch
    tiny = MicroBatchExtent.shared_prompts(4, 4, 142, 128, packed=True)
    peer_tiny = SimpleNamespace(hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=1024, vocab_size=151936)
    assert decoder_gflop(SMOLLM2, smol, layers=30) > 5 * memory.STATIC_FULL_GFLOP
    assert decoder_gflop(peer_tiny, tiny, layers=4) < memory.STATIC_FULL_GFLOP / 3
    kw = dict(tp=1, dtype_bytes=4, device_target="CPU", workers=1)
    caplog.set_level(logging.INFO, logger="mindrlhf.trainer.memory")
    assert resolve_recompute("auto", SMOLLM2, smol, layers=30, static_layers=True, **kw) == ("full", 0)
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("recompute auto -> full for the policy: its largest micro-batch (766 positions, ")
    kept = kept_bytes(SMOLLM2, smol, layers=30)
    assert 0.3 * 2 ** 30 < kept < 0.5 * 2 ** 30  # 766 positions x 30 layers x 4,608 float32 values
    tight = dict(kw, budget_gb=0.1 * kept / 2 ** 30)  # selective is what the user asked for: no budget check
    assert resolve_recompute("selective", SMOLLM2, smol, layers=30, static_layers=True, **tight) == ("selective",
                                                                                                      kept)
    assert resolve_recompute("auto", SMOLLM2, smol, layers=30, **kw)[0] == "none"  # dynamic: fits 16 GiB
    assert resolve_recompute("auto", peer_tiny, tiny, layers=4, static_layers=True, **kw)[0] == "none"
    assert resolve_recompute("none", SMOLLM2, smol, layers=30, static_layers=True, **kw)[0] == "none"

    # Through the config: the tiny test model's work made to count (the threshold lowered below it).
    model = load_model(tiny_qwen2_dir)
    job = ["--micro_batch_size", "4", "--max_completion_length", "128"]
    work = decoder_gflop(model.config, rollout_extent(parse_grpo_args(job)), layers=model.config.num_hidden_layers)
    monkeypatch.setattr(memory, "STATIC_FULL_GFLOP", work / 2)
    assert _updater(model, parse_grpo_args(job + ["--layer_graph_shapes", "static"])).recompute == "full"
    assert _updater(model, parse_grpo_args(job + ["--layer_graph_shapes", "dynamic"])).recompute == "none"
    assert _updater(model, parse_grpo_args(job + ["--layer_graph_shapes", "static", "--layer_graphs", "false"])
                    ).recompute == "none"


def test_recompute_settings_are_checked_and_train_jit_says_what_replaced_it(tmp_path):
    from mindrlhf.configs.grpo_configs import parse_args as parse_grpo_args
    from mindrlhf.errors import MindRLHFError

    assert parse_grpo_args([]).parallel.recompute == "auto"
    with pytest.raises(MindRLHFError, match=r"recompute = 'some' is not one of auto\|full\|selective\|none"):
        parse_grpo_args(["--recompute", "some"])
    with pytest.raises(MindRLHFError, match="memory_budget_gb"):
        parse_grpo_args(["--memory_budget_gb", "-1"])
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("parallel:\n  train_jit: true\n")
    with pytest.raises(MindRLHFError, match=r"unknown config key 'parallel.train_jit' \(it was replaced by recompute "
                                            r"\(train_jit true is recompute none, false is recompute full\)\)"):
        parse_grpo_args(["--config", str(yaml_file)])


def test_prompt_completion_extent_is_the_widest_micro_batch_the_rows_can_form():
    """``prompt_completion_extent`` bounds every micro-batch ``prompt_completion_micro_batches`` forms from the rows,
    whatever their order, and equals the one holding the longest prompt and the longest completion (each padded to
    its bucket, the last position dropped, logits at the completion columns)."""
    import numpy as np

    from mindrlhf.trainer.offline import prompt_completion_extent, prompt_completion_micro_batches

    rng = np.random.default_rng(0)
    prompts = [np.ones(n, np.int32) for n in rng.integers(1, 90, 40)]
    completions = [np.ones(n, np.int32) for n in rng.integers(1, 200, 40)]
    extent = prompt_completion_extent([len(p) for p in prompts], [len(c) for c in completions], 4)
    width_p = -(-max(len(p) for p in prompts) // 32) * 32
    width_c = -(-max(len(c) for c in completions) // 32) * 32
    assert extent == MicroBatchExtent(4 * (width_p + width_c - 1), 4 * (width_p + width_c - 1) ** 2, 4 * width_c)
    seen = []
    for _ in range(5):
        order = rng.permutation(40)
        for mb in prompt_completion_micro_batches([prompts[i] for i in order], [completions[i] for i in order], 4, 0):
            rows, length = mb["input_ids"].shape
            assert rows * length <= extent.tokens and mb["completion_ids"].size <= extent.logit_rows
            seen.append(rows * length)
    longest = [int(np.argmax([len(p) for p in prompts])), int(np.argmax([len(c) for c in completions]))]
    rest = [i for i in range(40) if i not in longest][:4 - len(set(longest))]
    (mb,) = prompt_completion_micro_batches([prompts[i] for i in [*set(longest), *rest]],
                                            [completions[i] for i in [*set(longest), *rest]], 4, 0)
    assert mb["input_ids"].size == extent.tokens and mb["completion_ids"].size == extent.logit_rows


def _train_flops():
    spec = importlib.util.spec_from_file_location("train_flops", REPO / "bench" / "train_flops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode", [None, *RECOMPUTE_MODES])
def test_train_flops_children_accept_every_recompute_mode(mode):
    """bench/train_flops.py passed ``--recompute ""`` to every stage's child when no mode was given, which the child's
    parser refused (each stage failed with rc 2); and it did not offer ``selective``. Each child's arguments now parse
    with the child's parser, with the mode given or the CLI's default."""
    train_flops = _train_flops()
    parent = train_flops.parser().parse_args([] if mode is None else ["--recompute", mode])
    child = train_flops.parser().parse_args(train_flops.child_args(parent, "sft", "/tmp/x"))
    assert (child.stage, child.recompute, child.steps) == ("sft", mode, parent.steps)


def test_train_flops_counts_packed_pairs_and_no_logits_for_a_score_head():
    """bench/train_flops.py counted the reward model's and DPO's pairs as padded rows (they are packed behind one
    prompt copy; ``build_stage`` now gives their micro-batches a group of 2: 3,568 positions a step on the peer job
    instead of 5,104) and vocabulary logits for the reward model's score head. The counts by hand: 4 rows
    ``[prompt 7 | completion 4][:-1]`` (width 10), two rows per prompt."""
    train_flops = _train_flops()
    mb = {"input_ids": np.zeros((4, 10), np.int32), "completion_ids": np.zeros((4, 4), np.int32)}
    assert train_flops.micro_extent(mb) == (40, 400, 16)  # padded: 4 x 10 positions, 10 x 10 pairs a row
    # packed: 2 rows of 7 + 2 x 3 positions; the prompt sees itself (7 x 7), each completion the prompt and itself
    assert train_flops.micro_extent(mb, 2) == (26, 2 * (49 + 2 * 3 * 10), 16)
    assert train_flops.micro_extent(mb, 2, logits=False)[2] == 0
