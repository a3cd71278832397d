"""SFT with LoRA (``--lora_rank`` / ``--lora_init_from``): only the adapters are trained and hold optimizer state,
the base stays bit for bit, two steps equal a float64 torch reference (transformers' model with the same adapters
and torch's AdamW), the run ends with a PEFT adapter folder, checkpoints hold the adapters and resume exactly, and a
resume against another base is refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from grpo_runs import byhand_only
from mindrlhf.models.lora import ADAPTER_CONFIG, read_adapter

REPO = Path(__file__).resolve().parents[1]
ROWS = [{"prompt": "What is 2+2?", "completion": " 4"},
        {"prompt": "Name a primary colour.", "completion": " Red, blue or yellow."},
        {"prompt": "Count to five:", "completion": " one two three four five"},
        {"prompt": "Laugh:", "completion": " ha ha ha ha ha"}]
#: Preference pairs of the same rows: each prompt's completion chosen, the next row's rejected.
PAIRS = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": ROWS[(i + 1) % len(ROWS)]["completion"]}
         for i, r in enumerate(ROWS)]
R, ALPHA, BETA = 4, 8.0, 0.5


@pytest.fixture(scope="module")
def lora_assets(tmp_path_factory, qwen_tokenizer_dir):
    """A tiny Qwen2 with the Qwen2.5 tokenizer, another one (a different base), four SFT rows and a PEFT adapter
    folder with random A and B (B non-zero, so both factors get gradients at the first step)."""
    from mindrlhf.models import load_model
    from mindrlhf.models.lora import LoRASpec, adapter_weights, apply_lora, save_adapter, set_adapter_weights
    from mindrlhf.testing import add_tokenizer, lora_numpy_init, make_tiny_qwen2

    root = tmp_path_factory.mktemp("lora_sft")
    model_dir = add_tokenizer(make_tiny_qwen2(root / "model", seed=5), qwen_tokenizer_dir)
    other = add_tokenizer(make_tiny_qwen2(root / "other", seed=6), qwen_tokenizer_dir)
    rows = root / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in PAIRS), encoding="utf-8")
    model = load_model(model_dir)
    apply_lora(model, LoRASpec(r=R, alpha=ALPHA, target_modules=("q_proj", "v_proj", "o_proj", "gate_proj",
                                                                  "down_proj")))
    set_adapter_weights(model, {k: lora_numpy_init(k, v.shape, 11) for k, v in adapter_weights(model).items()})
    adapter = save_adapter(model, root / "adapter", base_model_name_or_path=str(model_dir))
    return {"model": model_dir, "other": other, "rows": rows, "pairs": pairs, "adapter": adapter}


def _flags(**kw) -> list:
    return [x for k, v in kw.items() for x in (f"--{k}", str(v))]


#: One optimizer step's settings both sides use: a large Adam epsilon keeps the first steps smooth in the gradient
#: (with 1e-8 an update is ~lr * sign(g), and a gradient at float32 noise level could flip it).
STEP = dict(lr=1e-2, adam_eps=1e-3, weight_decay=0.1, max_grad_norm=0.5, lr_schedule="constant", warmup_steps=0)


class _TorchLoRA:
    """float64 torch: transformers' model with a PEFT adapter folder's factors added by hooks on its projections
    (``on = False`` switches them off: the base, PEFT's ``disable_adapter``), and torch's AdamW over the factors
    (plus ``extra`` tensors, e.g. a score head) with clipping, as our optimizer steps."""

    def __init__(self, model_dir: Path, adapter_dir: Path, auto=None, **kw):
        import torch
        from transformers import AutoModelForCausalLM

        spec, tensors = read_adapter(adapter_dir)
        self.model = (auto or AutoModelForCausalLM).from_pretrained(model_dir, dtype=torch.float64, **kw).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.on = True
        self.factors = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in tensors.items()}
        for key in sorted(self.factors):
            if ".lora_A." not in key:
                continue
            module = key[:-len(".lora_A.weight")]
            a, b = self.factors[key], self.factors[f"{module}.lora_B.weight"]

            def hook(_, inputs, out, a=a, b=b):
                return out + spec.scaling * (inputs[0] @ a.T) @ b.T if self.on else out

            self.model.get_submodule(module).register_forward_hook(hook)

    def logp(self, ids):
        """Per-token log-probs of ``ids[1:]`` given the tokens before each."""
        import torch

        x = torch.tensor(ids, dtype=torch.long)[None]
        return torch.log_softmax(self.model(input_ids=x).logits[0, :-1], -1).gather(-1, x[0, 1:, None])[:, 0]

    def train(self, step_loss, steps: int, extra=None):
        """``steps`` AdamW steps on ``step_loss()``; returns (losses, grad norms, trained tensors by name)."""
        import torch

        named = dict(self.factors, **(extra or {}))
        params = [named[k] for k in sorted(named)]
        opt = torch.optim.AdamW(params, lr=STEP["lr"], betas=(0.9, 0.999), eps=STEP["adam_eps"],
                                weight_decay=STEP["weight_decay"])
        losses, norms = [], []
        for _ in range(steps):
            opt.zero_grad()
            loss = step_loss()
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, STEP["max_grad_norm"])))
            losses.append(float(loss.detach()))
            opt.step()
        return losses, norms, {k: v.detach().numpy() for k, v in named.items()}


def _torch_reference(model_dir: Path, adapter_dir: Path, sequences, masks, steps: int):
    """SFT: the token-mean NLL of the trained tokens over all rows per step. Returns (losses, grad norms, adapters)."""
    import torch

    ref = _TorchLoRA(model_dir, adapter_dir)
    total = sum(float(m.sum()) for m in masks)

    def step_loss():
        return -sum((ref.logp(ids) * torch.tensor(m[1:], dtype=torch.float64)).sum() for ids, m in
                    zip(sequences, masks)) / total

    return ref.train(step_loss, steps)


def _check_steps(got, losses, norms, want, initial, after):
    """Our steps' loss and grad_norm and the trained tensors equal the torch reference's (<= 1e-4 relative), and
    every tensor moved (so the comparison says something)."""
    for step, res in enumerate(got):
        assert res["loss"] == pytest.approx(losses[step], rel=1e-4), step
        assert res["grad_norm"] == pytest.approx(norms[step], rel=1e-4), step
    for name, value in after.items():
        moved = want[name] - initial[name]
        assert np.abs(moved).max() > 1e-3, name  # every tensor moved
        assert np.abs(value - want[name]).max() <= 1e-4 * np.abs(want[name]).max(), name
        assert np.linalg.norm((value - initial[name]) - moved) <= 1e-3 * np.linalg.norm(moved), name


def test_sft_lora_steps_equal_a_float64_torch_reference_and_leave_the_base_alone(lora_assets, tmp_path):
    """Two SFT steps with --lora_init_from (layer graphs, recompute full; two micro-batches a step): the optimizer
    holds masters and moments of the adapters only, the base's weights are bit-identical afterwards, and the loss,
    grad_norm and adapters after each step equal a float64 torch reference (<= 1e-4 relative)."""
    from mindrlhf.configs.offline import parse_sft_args
    from mindrlhf.data.text_rows import read_sft_rows
    from mindrlhf.models.lora import adapter_weights
    from mindrlhf.sft import SFT
    from mindrlhf.tokenizer import resolve_tokenizer
    from mindrlhf.trainer.entry import setup_runtime

    a = lora_assets
    cfg = SFT.parse(_flags(model=a["model"], train_file=a["rows"], output_dir=tmp_path / "out", max_steps=2,
                           batch_size=4, micro_batch_size=2, max_length=64, seed=3, progress_bar="false",
                           recompute="full", lora_init_from=a["adapter"], **STEP))
    assert isinstance(cfg, type(parse_sft_args([])))
    trainer = SFT.build(cfg, setup_runtime(cfg))
    model, updater = trainer.model, trainer.updater
    adapters = set(adapter_weights(model))
    assert set(updater.master_weights()) == adapters
    assert set(updater.optimizer_state()) == {f"adam_{m}.{n}" for m in "mv" for n in adapters} | {"adam_step"}
    base = {n: p.asnumpy().copy() for n, p in model.parameters_and_names() if n not in adapters}
    initial = adapter_weights(model)

    rows, _ = read_sft_rows(a["rows"], resolve_tokenizer(str(a["model"])), max_length=64, show_progress=False)
    losses, norms, want = _torch_reference(a["model"], a["adapter"], rows.input_ids, rows.completion_mask, 2)
    got = [trainer.train_one_step() for _ in range(2)]
    assert norms[0] > STEP["max_grad_norm"]  # clipping acted
    _check_steps(got, losses, norms, want, initial, adapter_weights(model))  # both factors moved (B non-zero)
    for name, value in model.parameters_and_names():
        if name not in adapters:
            np.testing.assert_array_equal(value.asnumpy(), base[name], err_msg=name)


def test_float16_lora_keeps_float32_masters_of_the_adapters_only(lora_assets, tmp_path):
    """--dtype float16 with LoRA: the base is loaded in float16 and stays so (never cast up, no master copy); the
    optimizer's float32 masters are the adapters'; a step leaves the base bit-identical."""
    import mindspore as ms

    from mindrlhf.models.lora import adapter_weights
    from mindrlhf.sft import SFT
    from mindrlhf.trainer.entry import setup_runtime

    a = lora_assets
    cfg = SFT.parse(_flags(model=a["model"], train_file=a["rows"], output_dir=tmp_path / "out", max_steps=1,
                           batch_size=4, max_length=64, progress_bar="false", recompute="full", dtype="float16",
                           lora_rank=R, lora_target_modules="all-linear"))
    trainer = SFT.build(cfg, setup_runtime(cfg))
    model = trainer.model
    adapters = set(adapter_weights(model))
    assert len(adapters) == 2 * 7 * model.config.num_hidden_layers
    masters = trainer.updater.master_weights()
    assert set(masters) == adapters and all(w.dtype == ms.float32 for w in masters.values())
    base = {n: p for n, p in model.parameters_and_names() if n not in adapters}
    assert all(p.dtype == ms.float16 and not p.requires_grad for p in base.values())
    before = {n: p.asnumpy().copy() for n, p in base.items()}
    res = trainer.train_one_step()
    assert np.isfinite(res["loss"]) and res["grad_norm"] > 0
    for name, p in base.items():
        np.testing.assert_array_equal(p.asnumpy(), before[name], err_msg=name)


#: The stages that train LoRA adapters.
LORA_STAGES = ("sft", "rm", "dpo", "orpo", "grpo", "ppo")


def test_stages_without_lora_refuse_it_in_one_line(tmp_path, capsys):
    """Every stage not wired for LoRA refuses lora_rank > 0 (nothing trains the full model instead); PPO, like GRPO,
    a generator other than the policy."""
    import importlib

    from mindrlhf.registry import STAGES

    for name, stage in STAGES.items():
        if name in LORA_STAGES:
            continue  # it trains LoRA; SFT's refusals are below
        main = importlib.import_module(stage.module).main
        code = main(["--lora_rank", "4", "--output_dir", str(tmp_path / name)])
        err = capsys.readouterr().err
        assert code == 2 and "this stage does not train LoRA adapters yet" in err, name
        assert len(err.strip().splitlines()) == 1, err
    from mindrlhf import ppo

    for flags in (["--infer_dp", "2", "--train_dp", "1"], ["--gen_workers", "1", "--use_parallel", "true"]):
        assert ppo.main(["--lora_rank", "4", "--output_dir", str(tmp_path / "p"), *flags]) == 2
        err = capsys.readouterr().err
        assert "generator must be the policy" in err and len(err.strip().splitlines()) == 1, err


def _pair_trainer(stage, a, out: Path, **extra):
    """An RM, DPO or ORPO trainer on the four pairs: a step is all four (two micro-batches of two), layer graphs."""
    import importlib

    from mindrlhf.registry import STAGES
    from mindrlhf.trainer.entry import setup_runtime

    spec = getattr(importlib.import_module(STAGES[stage].module), stage.upper())
    flags = dict(model=a["model"], train_file=a["pairs"], output_dir=out, max_steps=2, batch_size=4,
                 micro_batch_size=2, max_length=64, seed=3, progress_bar="false", recompute="full", **STEP)
    flags.update({} if stage == "rm" else {"beta": BETA}, **extra)
    cfg = spec.parse(_flags(**flags))
    return spec.build(cfg, setup_runtime(cfg))


def _all_pairs(trainer):
    """The micro-batches of all the trainer's pairs, in the log-prob head's layout."""
    c = trainer.dataset.columns
    return trainer._micro(c["prompt"], c["chosen"], c["rejected"])


def test_dpo_lora_reference_is_the_policys_base_with_adapters_off(lora_assets, tmp_path):
    """DPO with LoRA and no --ref_model: the reference is the policy itself with its adapters switched off (one
    compiled graph, a switch read as a graph input), so no second copy of the base is loaded, and its log-probs are a
    plain base model's, bit for bit, while the adapters (B non-zero) change the policy's; the adapters are on again
    afterwards; so are the precomputed ones (--precompute_ref_log_probs). With --ref_model the given model is loaded as
    the reference."""
    from mindrlhf.models import get_weights, load_model
    from mindrlhf.models.lora import lora_modules
    from mindrlhf.trainer.update import AdaptersOff

    a = lora_assets
    lora = _pair_trainer("dpo", a, tmp_path / "lora", lora_init_from=a["adapter"])
    plain = _pair_trainer("dpo", a, tmp_path / "plain")
    micro = _all_pairs(lora)
    assert isinstance(lora.ref_runner, AdaptersOff) and lora.ref_runner.model is lora.model
    # The memory: a full DPO holds two models; LoRA DPO one, plus its adapters and a scalar switch per adapter.
    count = lambda m: sum(int(np.prod(p.shape)) for p in m.get_parameters())  # noqa: E731
    assert plain.ref_runner.model is not plain.model
    extra = sum(int(np.prod(p.shape)) for p in lora.model.trainable_params()) + len(lora_modules(lora.model))
    assert count(lora.model) - count(plain.model) == extra
    policy_before = lora.updater.forward(micro)
    ours, base = lora.ref_runner.forward(micro), plain.ref_runner.forward(micro)
    for o, b, p in zip(ours, base, policy_before):
        np.testing.assert_array_equal(o, b)
        assert np.abs(p - b).max() > 1e-3  # the adapters change the policy: the switch did something
    for p, q in zip(policy_before, lora.updater.forward(micro)):
        np.testing.assert_array_equal(p, q)  # switched on again

    pre = _pair_trainer("dpo", a, tmp_path / "pre", lora_init_from=a["adapter"], precompute_ref_log_probs="true")
    assert pre.ref_runner is None  # run once before training, then dropped (here: nothing to free)
    want = plain._reference_all(plain.dataset.columns)
    assert len(pre.ref_logps["train"]) == len(want) == 8
    for got, row in zip(pre.ref_logps["train"], want):
        np.testing.assert_array_equal(got, row)

    given = _pair_trainer("dpo", a, tmp_path / "given", lora_init_from=a["adapter"], ref_model=a["other"])
    assert not isinstance(given.ref_runner, AdaptersOff) and given.ref_runner.model is not given.model
    want = get_weights(load_model(a["other"]))
    got = get_weights(given.ref_runner.model)
    assert set(got) == set(want) and all(np.array_equal(got[n], want[n]) for n in want)


def test_dpo_lora_steps_equal_a_float64_torch_reference(lora_assets, tmp_path):
    """Two DPO steps with LoRA (sigmoid loss, beta 0.5, two micro-batches a step, the reference the base with the
    adapters off): loss, grad_norm and adapters after each step equal a float64 torch reference (<= 1e-4 relative),
    the base is bit-identical afterwards, and the run ends with output_dir/adapter holding the trained adapters."""
    import torch

    from mindrlhf.models.lora import adapter_weights

    a = lora_assets
    trainer = _pair_trainer("dpo", a, tmp_path / "out", lora_init_from=a["adapter"])
    model = trainer.model
    adapters = set(adapter_weights(model))
    assert set(trainer.updater.master_weights()) == adapters
    base = {n: p.asnumpy().copy() for n, p in model.parameters_and_names() if n not in adapters}
    initial = adapter_weights(model)

    ref = _TorchLoRA(a["model"], a["adapter"])
    c = trainer.dataset.columns
    rows = [(np.r_[p, x], len(p)) for p, ch, rj in zip(c["prompt"], c["chosen"], c["rejected"]) for x in (ch, rj)]

    def seq_logps():
        return torch.stack([ref.logp(ids)[n - 1:].sum() for ids, n in rows])

    with torch.no_grad():
        ref.on = False
        base_logps = seq_logps()
        ref.on = True

    def step_loss():
        margin = seq_logps() - base_logps
        return -torch.nn.functional.logsigmoid(BETA * (margin[0::2] - margin[1::2])).mean()

    losses, norms, want = ref.train(step_loss, 2)
    history = trainer.train()
    _check_steps(history, losses, norms, want, initial, adapter_weights(model))
    for name, value in model.parameters_and_names():
        if name not in adapters:
            np.testing.assert_array_equal(value.asnumpy(), base[name], err_msg=name)
    _, saved = read_adapter(tmp_path / "out" / "adapter")
    after = adapter_weights(model)
    assert set(saved) == adapters and all(np.array_equal(saved[n], after[n]) for n in adapters)


@pytest.mark.slow
@byhand_only("the SFT LoRA tests resume adapters and moments exactly through the shared offline trainer")
def test_dpo_lora_resumes_exactly(lora_assets, tmp_path):
    """LoRA DPO (the reference: the base with the adapters off): 3 steps uninterrupted vs a new trainer resumed from
    the first run's step-2 checkpoint and trained to step 3: the same step-3 metrics, bit-identical adapters."""
    from mindrlhf.models.lora import adapter_weights

    a, kw = lora_assets, dict(lora_rank=R, lora_alpha=ALPHA, max_steps=3, save_steps=1, keep_last=3)
    full = _pair_trainer("dpo", a, tmp_path / "full", **kw)
    history = full.train()
    resumed = _pair_trainer("dpo", a, tmp_path / "resumed", **kw)
    resumed.resume(tmp_path / "full" / "checkpoints" / "step_00000002")
    assert resumed.step == 2
    last = resumed.train()[-1]
    assert {k: v for k, v in last.items() if "time" not in k} == \
        {k: v for k, v in history[-1].items() if "time" not in k}
    want, got = adapter_weights(full.model), adapter_weights(resumed.model)
    assert set(got) == set(want) and all(np.array_equal(got[n], want[n]) for n in want)


@pytest.mark.slow
def test_sft_lora_dropout_changes_training_not_forward_passes_and_resumes_exactly(lora_assets, tmp_path):
    """--lora_dropout 0.3 (layer graphs, two micro-batches a step): the first step's adapters differ from p = 0's (the
    masks act in the gradient pass); forward passes (evaluation, log-probs: the runner's forward, the model's logits)
    of the same adapters are bit-identical at p = 0.3 and p = 0 (no masks outside the gradient pass); resumed from the
    step-1 checkpoint, step 2's metrics and adapters equal the uninterrupted run's bit for bit (the masks are drawn
    from the run's seed and the optimizer step the checkpoint holds)."""
    import mindspore as ms
    from mindspore import Tensor

    from mindrlhf.models.lora import adapter_weights, set_adapter_weights
    from mindrlhf.sft import SFT, sft_micro_batches
    from mindrlhf.testing import padded_batch
    from mindrlhf.trainer.entry import setup_runtime

    a = lora_assets

    def trainer(out, dropout, steps=2):
        cfg = SFT.parse(_flags(model=a["model"], train_file=a["rows"], output_dir=tmp_path / out, max_steps=steps,
                               batch_size=4, micro_batch_size=2, max_length=64, seed=3, progress_bar="false",
                               recompute="full", save_steps=1, lora_rank=R, lora_alpha=ALPHA, lora_dropout=dropout,
                               **STEP))
        return SFT.build(cfg, setup_runtime(cfg))

    dropped = trainer("full", 0.3)
    history = dropped.train()
    after = adapter_weights(dropped.model)
    ckpt = tmp_path / "full" / "checkpoints" / "step_00000001"
    first = {k: v.asnumpy() for k, v in ms.load_checkpoint(str(ckpt / "policy.ckpt")).items()}
    plain = trainer("plain", 0.0, steps=1)
    plain.train_one_step()
    moved = [np.abs(v - first[k]).max() for k, v in adapter_weights(plain.model).items() if ".lora_B." in k]
    assert max(moved) > 1e-4  # the masks changed the first step's B gradients

    set_adapter_weights(plain.model, after)
    cols = plain.dataset.columns
    micro = sft_micro_batches(cols["input_ids"], cols["trained"], 2, plain.pad_id)
    counts = (sum(float(m.sum()) for m in cols["trained"]),)
    for want, got in zip(plain.updater.forward(micro), dropped.updater.forward(micro)):
        np.testing.assert_array_equal(got, want)
    assert dropped.updater.evaluate(micro, counts) == plain.updater.evaluate(micro, counts)
    ids, mask = padded_batch(plain.model.config.vocab_size)
    np.testing.assert_array_equal(dropped.model(Tensor(ids), Tensor(mask)).asnumpy(),
                                  plain.model(Tensor(ids), Tensor(mask)).asnumpy())

    resumed = trainer("resumed", 0.3)
    resumed.resume(ckpt)
    assert resumed.step == 1
    last = resumed.train()[-1]
    assert {k: v for k, v in last.items() if "time" not in k} == \
        {k: v for k, v in history[-1].items() if "time" not in k}
    got = adapter_weights(resumed.model)
    assert set(got) == set(after) and all(np.array_equal(got[n], after[n]) for n in after)


def _one_step_trains_only_the_adapters(trainer, model) -> dict:
    """One ``train_one_step``: the optimizer holds ``model``'s adapters only, B moves off zero, every other parameter
    stays bit-identical. Returns the step's metrics."""
    from mindrlhf.models.lora import adapter_weights

    adapters = set(adapter_weights(model))
    assert set(trainer.updater.master_weights()) == adapters
    base = {n: p.asnumpy().copy() for n, p in model.parameters_and_names() if n not in adapters}
    res = trainer.train_one_step()
    assert np.isfinite(res["loss"]) and res["grad_norm"] > 0
    assert all(np.abs(v).max() > 0 for n, v in adapter_weights(model).items() if ".lora_B." in n)
    for name, value in model.parameters_and_names():
        if name not in adapters:
            np.testing.assert_array_equal(value.asnumpy(), base[name], err_msg=name)
    return res


@pytest.fixture
def length_reward(tmp_path, monkeypatch) -> str:
    """A reward function module on the path: the completion's length / 50 (GRPO's reward_funcs entry)."""
    (tmp_path / "len_reward.py").write_text("def length(completions, solution, **kw):\n"
                                            "    return [len(c) / 50.0 for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "len_reward:length"


def test_orpo_lora_trains_only_the_adapters(lora_assets, tmp_path):
    """ORPO (no reference) with --lora_rank: the optimizer holds the adapters only, one step moves B off zero and
    leaves the base bit-identical."""
    trainer = _pair_trainer("orpo", lora_assets, tmp_path / "out", lora_rank=R, lora_alpha=ALPHA)
    _one_step_trains_only_the_adapters(trainer, trainer.model)


def test_rm_lora_trains_adapters_and_score_head_like_a_float64_reference(lora_assets, tmp_path):
    """The reward model with LoRA: the adapters (here from --lora_init_from, B non-zero) and the new score head in full
    (PEFT's modules_to_save of task SEQ_CLS) are all the optimizer holds; two steps (two micro-batches each) equal a
    float64 torch reference in loss, grad_norm, adapters and score head (<= 1e-4 relative); the base is bit-identical;
    output_dir/adapter is PEFT's SEQ_CLS adapter (score.weight beside the factors), read back onto a new RM it gives
    the same scores, and, where the bench virtualenv has peft, peft loads it onto transformers' model with our
    scores."""
    import torch
    from mindspore import Tensor
    from transformers import AutoModelForSequenceClassification

    from mindrlhf.models.lora import adapter_weights

    a = lora_assets
    trainer = _pair_trainer("rm", a, tmp_path / "out", lora_init_from=a["adapter"])
    model = trainer.model
    trained = set(adapter_weights(model))
    assert "score.weight" in trained and set(trainer.updater.master_weights()) == trained
    base = {n: p.asnumpy().copy() for n, p in model.parameters_and_names() if n not in trained}
    initial = adapter_weights(model)

    ref = _TorchLoRA(a["model"], a["adapter"], auto=AutoModelForSequenceClassification, num_labels=1)
    score = torch.tensor(initial["score.weight"], dtype=torch.float64, requires_grad=True)
    c = trainer.dataset.columns  # each pair's two rows: prompt + chosen, prompt + rejected
    rows = [np.r_[p, x] for p, ch, rj in zip(c["prompt"], c["chosen"], c["rejected"]) for x in (ch, rj)]

    def step_loss():
        rewards = torch.stack([ref.model.model(input_ids=torch.tensor(r, dtype=torch.long)[None])
                               .last_hidden_state[0, -1] @ score[0] for r in rows])
        return -torch.nn.functional.logsigmoid(rewards[0::2] - rewards[1::2]).mean()

    losses, norms, want = ref.train(step_loss, 2, extra={"score.weight": score})
    history = trainer.train()
    _check_steps(history, losses, norms, want, initial, adapter_weights(model))
    for name, value in model.parameters_and_names():
        if name not in trained:
            np.testing.assert_array_equal(value.asnumpy(), base[name], err_msg=name)

    out = tmp_path / "out" / "adapter"
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["classifier", "score"]
    spec, saved = read_adapter(out)
    after = adapter_weights(model)
    assert spec.modules_to_save == ("classifier", "score") and set(saved) == trained
    assert all(np.array_equal(saved[n], after[n]) for n in trained)
    reread = _pair_trainer("rm", a, tmp_path / "reread", lora_init_from=out, seed=9)  # another seed: another head
    ids = np.asarray(rows[0], np.int32)[None]
    ours = model.scores(Tensor(ids), Tensor(np.ones_like(ids))).asnumpy()
    np.testing.assert_array_equal(reread.model.scores(Tensor(ids), Tensor(np.ones_like(ids))).asnumpy(), ours)
    python = _peft_python()
    if not python.is_file():
        return
    script = ("import json,sys,torch;from transformers import AutoModelForSequenceClassification as A;"
              "from peft import PeftModel;"
              "m=PeftModel.from_pretrained(A.from_pretrained(sys.argv[1],num_labels=1),sys.argv[2]).eval();"
              "x=torch.tensor(json.loads(sys.argv[3]));"
              "print(json.dumps(m.base_model.model.model(input_ids=x).last_hidden_state[:,-1].matmul("
              "m.base_model.model.score.modules_to_save['default'].weight.T).tolist()))")
    proc = subprocess.run([str(python), "-c", script, str(a["model"]), str(out), json.dumps(ids.tolist())],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert np.abs(np.array(json.loads(proc.stdout)) - ours).max() <= 1e-4


def _run_sft(argv, env_extra=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "mindrlhf.sft", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)


def _peft_python() -> Path:
    venv = Path(os.environ.get("MINDRLHF_TRL_VENV", REPO / "bench" / ".venv-trl"))
    return venv / "bin" / "python"


@pytest.mark.slow
def test_sft_lora_run_writes_a_peft_adapter_and_resumes_exactly(lora_assets, tmp_path):
    """3 LoRA steps uninterrupted vs killed (SIGKILL) in step 3 and resumed: the same metrics and bit-identical
    adapters. Each checkpoint is a PEFT adapter folder (no config.json: the base is not in it) whose policy.ckpt
    holds the adapters alone; output_dir/adapter reads back onto the base; a resume with another --model is
    refused in one line; and, where the bench virtualenv has peft, peft loads the adapter onto transformers'
    model with our logits."""
    import mindspore as ms
    from mindspore import Tensor

    from mindrlhf.checkpoint.manager import CheckpointManager
    from mindrlhf.errors import MindRLHFError
    from mindrlhf.models import load_model
    from mindrlhf.models.lora import load_adapter
    from mindrlhf.testing import padded_batch

    a = lora_assets
    common = dict(model=a["model"], train_file=a["rows"], max_steps=3, batch_size=4, micro_batch_size=2,
                  max_length=64, seed=3, progress_bar="false", save_steps=1, recompute="full", lora_rank=R,
                  lora_alpha=ALPHA, lr=1e-2)
    full, killed = tmp_path / "full", tmp_path / "killed"
    proc = _run_sft(_flags(output_dir=full, **common))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(the LoRA adapters), adapter/ (the PEFT adapter on" in proc.stderr
    assert f"evaluate it: mindrlhf-eval --model {full / 'adapter'}" in proc.stderr
    step, ckpt = CheckpointManager(str(full / "checkpoints")).latest_complete()
    assert step == 3 and (ckpt / ADAPTER_CONFIG).is_file() and not (ckpt / "config.json").exists()
    saved = ms.load_checkpoint(str(ckpt / "policy.ckpt"))
    assert saved and all(".lora_A." in n or ".lora_B." in n for n in saved)
    spec, adapter = read_adapter(full / "adapter")
    assert spec.r == R and spec.alpha == ALPHA and set(adapter) == set(saved)
    assert all(np.array_equal(adapter[n], saved[n].asnumpy()) for n in saved)
    assert any(np.any(v) for n, v in adapter.items() if ".lora_B." in n)  # B left zero: it trained

    proc = _run_sft(_flags(output_dir=killed, **common), env_extra={"MINDRLHF_KILL_AT": "0:3:grad_allreduce"})
    assert proc.returncode != 0 and "kills itself at step 3" in proc.stderr
    proc = _run_sft(_flags(output_dir=killed, resume="latest", **common))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (full, killed)]
    assert [r["step"] for r in rows[1]] == [1, 2, 3]
    for want, got in zip(*rows):
        assert {k: v for k, v in want.items() if "time" not in k} == {k: v for k, v in got.items() if "time" not in k}
    _, resumed = read_adapter(killed / "adapter")
    for name, value in adapter.items():
        np.testing.assert_array_equal(resumed[name], value, err_msg=name)

    proc = _run_sft(_flags(output_dir=killed, resume="latest", **dict(common, model=a["other"], max_steps=4)))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()[-1:]) == 1
    assert "--model" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]

    with pytest.raises(MindRLHFError, match="holds LoRA adapters .* not a model"):  # a run's folder, a step's
        load_model(full)
    model = load_model(a["model"])
    load_adapter(model, full / "adapter")
    ids, mask = padded_batch(model.config.vocab_size)
    ours = model(Tensor(ids), Tensor(mask)).asnumpy()
    python = _peft_python()
    if not python.is_file():
        return
    script = ("import json,sys,torch;from transformers import AutoModelForCausalLM;from peft import PeftModel;"
              "m=PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sys.argv[1]),sys.argv[2]).eval();"
              "d=json.loads(sys.argv[3]);x=torch.tensor(d['ids']);"
              "print(json.dumps(m(input_ids=x,attention_mask=torch.tensor(d['mask'])).logits.tolist()))")
    proc = subprocess.run([str(python), "-c", script, str(a["model"]), str(full / "adapter"),
                           json.dumps({"ids": ids.tolist(), "mask": mask.tolist()})],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = np.array(json.loads(proc.stdout), np.float32)
    real = mask.astype(bool)
    assert np.abs(ours[real] - theirs[real]).max() <= 1e-4


def test_grpo_lora_at_beta_0_trains_the_adapters_and_samples_with_them(grpo_assets, tmp_path, length_reward):
    """GRPO with --lora_rank at beta 0: the sampler is the policy itself (its layers apply the adapters, so every
    step samples with the adapted weights), the optimizer holds the adapters only, a step moves B off zero and leaves
    the base bit-identical; with --lora_dropout (its hash masks in the sampler's graphs too, switched off there).
    sync_ref_model and a separate generator are refused in one line."""
    from grpo_runs import grpo_args
    from mindrlhf import grpo
    from mindrlhf.configs import parse_args
    from mindrlhf.errors import MindRLHFError

    args = dict(max_steps=1, lr=1e-2, reward_funcs=[length_reward], lora_rank=R, lora_alpha=ALPHA, lora_dropout=0.1)
    trainer = grpo.build_trainer(parse_args(grpo_args(grpo_assets, tmp_path / "out", **args)))
    assert trainer.sampler.holds(trainer.policy)
    _one_step_trains_only_the_adapters(trainer, trainer.policy)
    for flags, said in (({"beta": 0.1, "sync_ref_model": "true"}, "set sync_ref_model false"),
                        ({"infer_dp": 2, "chunk_size": 2}, "generator must be")):
        with pytest.raises(MindRLHFError, match=said):
            parse_args(grpo_args(grpo_assets, tmp_path / "x", **dict(args, **flags)))


def test_grpo_lora_merged_sampler_holds_the_merged_weights_and_samples_as_the_adapted_policy(
        grpo_assets, tmp_path, length_reward):
    """--lora_sampler merged: the sampler is a plain model (no adapters) that holds, after every update, exactly the
    merged export of the policy (W + scaling * B A, bit for bit, the base's other weights as they are), and it samples
    what the policy with its adapters samples: the same tokens, log-probs to float32 rounding. Without LoRA the
    setting is refused in one line."""
    from grpo_runs import grpo_args
    from mindrlhf import grpo
    from mindrlhf.configs import parse_args
    from mindrlhf.errors import MindRLHFError
    from mindrlhf.generation import SamplingParams
    from mindrlhf.generation.factory import native_sampler
    from mindrlhf.models.lora import lora_modules, merged_weights
    from mindrlhf.models.weights import get_weights

    args = dict(max_steps=1, lr=1e-2, reward_funcs=[length_reward], lora_rank=R, lora_alpha=ALPHA,
                lora_sampler="merged")
    trainer = grpo.build_trainer(parse_args(grpo_args(grpo_assets, tmp_path / "out", **args)))
    sampler_model = trainer.sampler.model
    assert not trainer.sampler.holds(trainer.policy) and not lora_modules(sampler_model)
    _one_step_trains_only_the_adapters(trainer, trainer.policy)  # its sync loads only the merged projections
    merged, held = merged_weights(trainer.policy), get_weights(sampler_model)
    assert set(held) == set(merged)
    for name, value in merged.items():
        np.testing.assert_array_equal(held[name], value, err_msg=name)

    prompts = [[40, 1079, 264, 3405, 13], [9, 8, 7, 6, 5]]
    params = SamplingParams(n=2, temperature=0.7, max_tokens=12, seed=5)
    ours = trainer.sampler.generate(prompts, params)
    adapted = native_sampler(trainer.policy, jit=True).generate(prompts, params)
    for a, b in zip(ours, adapted):
        assert list(a.token_ids) == list(b.token_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    with pytest.raises(MindRLHFError, match="lora_sampler = merged without LoRA"):
        parse_args(grpo_args(grpo_assets, tmp_path / "x", max_steps=1, lora_sampler="merged"))


def test_grpo_lora_with_beta_takes_its_base_with_adapters_off_as_the_reference(grpo_assets, tmp_path,
                                                                              length_reward):
    """GRPO with --lora_rank and beta > 0: no reference model is loaded (the reference runner runs the policy itself
    with its adapters switched off); step 1's KL is exactly 0 (B = 0: the policy is its base), and after it the
    reference log-probs equal a plain base model's bit for bit while the policy's differ, and the adapters are on
    again afterwards. With --ref_path another model is loaded as the reference."""
    from grpo_runs import grpo_args
    from mindrlhf import grpo
    from mindrlhf.configs import parse_args
    from mindrlhf.models import load_model
    from mindrlhf.models.heads import LogProbHead
    from mindrlhf.trainer.rollout import PhaseTimer
    from mindrlhf.trainer.update import AdaptersOff, build_frozen_runner

    args = dict(max_steps=2, lr=1e-2, beta=0.1, reward_funcs=[length_reward], lora_rank=R, lora_alpha=ALPHA)
    cfg = parse_args(grpo_args(grpo_assets, tmp_path / "out", **args))
    trainer = grpo.build_trainer(cfg)
    assert trainer.ref_model is None and isinstance(trainer.ref_runner, AdaptersOff)
    assert trainer.ref_runner.model is trainer.policy
    first = trainer.train_one_step()
    assert first["kl"] == 0.0 and first["grad_norm"] > 0

    exp = trainer.collect(2, PhaseTimer()).exp
    ref = trainer.completion_forward(trainer.ref_runner, exp)
    base = load_model(grpo_assets["model"])
    head = LogProbHead(trainer.loss_settings.temperature)
    plain = trainer.completion_forward(build_frozen_runner(cfg, base, trainer.updater.groups, head,
                                                           share_prompts=cfg.parallel.share_prompts), exp)
    mask = exp.completion_mask.astype(bool)
    np.testing.assert_array_equal(ref[mask], plain[mask])
    policy = trainer.completion_forward(trainer.updater.runner, exp)  # the adapters are on again
    assert np.abs(policy[mask] - plain[mask]).max() > 1e-4

    other = tmp_path / "ref_model"
    other.symlink_to(Path(grpo_assets["model"]).resolve())
    with_ref = grpo.build_trainer(parse_args(grpo_args(grpo_assets, tmp_path / "out2", ref_path=str(other), **args)))
    assert with_ref.ref_model is not None and not isinstance(with_ref.ref_runner, AdaptersOff)


@pytest.mark.slow
def test_grpo_lora_step_equals_a_float64_torch_reference(grpo_assets, tmp_path, length_reward):
    """One GRPO step with LoRA at beta 0 (one mini-batch of all eight completions, one iteration: the ratio is 1)
    equals a float64 torch computation on the same rollout: eight rows replayed (--replay_data_file) with prompts of
    different (left-padded) lengths, completions of 2 to 12 tokens (one with a token left out of the loss) and given
    advantages; transformers' model with the same adapters (B non-zero, from --lora_init_from), GRPO's clipped
    surrogate per token, seq-mean-token-mean, torch's AdamW with clipping. The loss, grad_norm and the adapters after
    the update agree to 1e-4 relative."""
    import torch

    from grpo_runs import grpo_args
    from mindrlhf import grpo
    from mindrlhf.configs import parse_args
    from mindrlhf.models import load_model
    from mindrlhf.models.lora import LoRASpec, adapter_weights, apply_lora, save_adapter, set_adapter_weights
    from mindrlhf.testing import lora_numpy_init
    from mindrlhf.trainer.experience import Experience, save_experience, step_file

    model = load_model(grpo_assets["model"])
    apply_lora(model, LoRASpec(r=R, alpha=ALPHA, target_modules=("q_proj", "v_proj", "o_proj", "up_proj",
                                                                  "down_proj")))
    set_adapter_weights(model, {k: lora_numpy_init(k, v.shape, 13) for k, v in adapter_weights(model).items()})
    adapter = save_adapter(model, tmp_path / "adapter")

    n, p, c = 8, 10, 12
    rng = np.random.default_rng(4)
    prompt_len = np.repeat([6, 10], 4)  # two prompts (chunk_size 2) of four completions each
    prompt_mask = (np.arange(p)[None] >= p - prompt_len[:, None]).astype(np.int32)
    prompt_ids = np.where(prompt_mask > 0, np.repeat(rng.integers(1, 5000, (2, p)), 4, axis=0), 0).astype(np.int32)
    lengths = np.array([2, 12, 5, 9, 12, 3, 7, 10])
    present = (np.arange(c)[None] < lengths[:, None]).astype(np.int32)
    completion_ids = np.where(present > 0, rng.integers(1, 5000, (n, c)), 0).astype(np.int32)
    loss_mask = present.astype(np.float32)
    loss_mask[3, 4] = 0.0
    advantages = np.array([1.2, -0.4, 0.3, -1.1, 0.8, -0.2, 0.5, -0.4], np.float32)  # loss -0.0875
    zeros = np.zeros(n, np.float32)
    dump = tmp_path / "exp" / "rollouts.npz"
    save_experience(Experience(prompt_ids, prompt_mask, completion_ids, loss_mask, np.zeros((n, c), np.float32),
                               lengths == c, zeros, zeros[:, None], advantages, np.repeat(np.arange(2), 4),
                               extras={"completion_present": present}), step_file(str(dump), 1))
    cfg = parse_args(grpo_args(grpo_assets, tmp_path / "out", max_steps=1, lora_init_from=adapter, beta=0.0,
                               mini_batch_size=8, reward_funcs=[length_reward], replay_data_file=dump,
                               max_completion_length=c, importance_sampling_correction="false", **STEP))
    trainer = grpo.build_trainer(cfg)
    initial = adapter_weights(trainer.policy)
    res = trainer.train_one_step()
    after = adapter_weights(trainer.policy)

    ref = _TorchLoRA(grpo_assets["model"], adapter)
    rows = [(np.concatenate([prompt_ids[i][prompt_mask[i] > 0], completion_ids[i][:lengths[i]]]), prompt_len[i],
             torch.tensor(loss_mask[i][:lengths[i]], dtype=torch.float64), float(advantages[i])) for i in range(n)]

    def step_loss():
        per_seq = []
        for ids, start, mask, advantage in rows:
            x = torch.tensor(ids, dtype=torch.long)[None]
            # The completion tokens' log-probs (temperature 1); only their positions' logits are kept for backward.
            logits = ref.model(input_ids=x).logits[0, start - 1:-1]
            logp = torch.log_softmax(logits, -1).gather(-1, x[0, start:, None])[:, 0]
            ratio = torch.exp(logp - logp.detach())  # 1, with the policy's gradient
            per_seq.append((-advantage * ratio * mask).sum() / mask.sum())
        return torch.stack(per_seq).mean()

    losses, norms, want = ref.train(step_loss, 1)
    assert res["loss"] == pytest.approx(losses[0], rel=1e-4)
    _check_steps([res], losses, norms, want, initial, after)


def test_eval_takes_a_lora_adapter_folder_on_its_recorded_base(lora_assets, tmp_path):
    """``mindrlhf-eval --model ADAPTER``: the base that adapter_config.json records, with the adapters on it, writes
    the completions of that model built by hand (not the base's); a base that is gone is one line naming
    --base_model, which then works; a reward model's adapter and --base_model beside a full model are refused."""
    import shutil

    from mindrlhf.errors import MindRLHFError
    from mindrlhf.evaluation.gsm8k_eval import evaluate
    from mindrlhf.models import load_model
    from mindrlhf.models.lora import load_adapter

    a = lora_assets
    kw = dict(limit=2, batch_size=2, max_new_tokens=6, progress=False)

    def completions(model, name, **extra):
        out = tmp_path / f"{name}.jsonl"
        evaluate(model, output=out, **kw, **extra)
        return [json.loads(line)["completions"] for line in out.read_text().splitlines()]

    by_hand = load_model(a["model"])
    load_adapter(by_hand, a["adapter"])
    want = completions(by_hand, "by_hand", tokenizer_dir=a["model"])
    assert completions(a["adapter"], "adapter") == want
    assert completions(a["model"], "base") != want  # the adapters change the answers

    moved = tmp_path / "moved"
    shutil.copytree(a["adapter"], moved)
    config = json.loads((moved / ADAPTER_CONFIG).read_text())
    (moved / ADAPTER_CONFIG).write_text(json.dumps(dict(config, base_model_name_or_path=str(tmp_path / "gone"))))
    with pytest.raises(MindRLHFError, match=r"is not there; pass the base model it was trained on as --base_model"):
        evaluate(moved, **kw)
    assert completions(moved, "moved", base_model=a["model"]) == want
    (moved / ADAPTER_CONFIG).write_text(json.dumps(dict(config, task_type="SEQ_CLS")))
    with pytest.raises(MindRLHFError, match="SEQ_CLS adapter"):
        evaluate(moved, **kw)
    with pytest.raises(MindRLHFError, match="drop --base_model"):
        evaluate(a["model"], base_model=a["model"], **kw)


def test_an_adapter_trained_on_the_packaged_default_names_its_folder_as_base():
    """A run on the packaged SmolLM2 (recorded as the default, path '') names the converted folder it loaded as its
    adapter's base_model_name_or_path (it was null, so mindrlhf-eval could not find the base); a given path is kept;
    PPO's critic: --critic_model, else --reward_model, else --model (the default here too)."""
    from types import SimpleNamespace

    from mindrlhf.checkpoint.smollm2 import prepare_smollm2
    from mindrlhf.ppo import PPOTrainer
    from mindrlhf.trainer.base import Trainer

    default = str(prepare_smollm2())
    run = SimpleNamespace(input_models={"--sft_path_train": {"path": ""}, "--ref_path": {"path": ""}})
    assert Trainer.base_model(run) == default and Path(default, "config.json").is_file()
    assert Trainer.base_model(SimpleNamespace(input_models={"--model": {"path": "/m", "sha256": "x"}})) == "/m"
    assert Trainer.base_model(SimpleNamespace(input_models={})) is None
    ppo = {"--model": {"path": ""}, "--reward_model": {"path": "/rm"}, "--critic_model": {"path": ""}}
    assert PPOTrainer.critic_base(SimpleNamespace(input_models=ppo)) == "/rm"
    ppo = {"--model": {"path": ""}, "--reward_model": {"path": ""}, "--critic_model": {"path": ""}}
    assert PPOTrainer.critic_base(SimpleNamespace(input_models=ppo)) == default
