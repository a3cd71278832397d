"""Tools in the shared rollout of a GRPO run: a run with ``tools`` in which no completion calls one is today's
one-turn run bit for bit (metrics and weights), with the tool metrics at zero; a tiny model taught by SFT to call
the calculator makes a GRPO step whose rows are its call, the tool's result (masked) and its answer, exactly the ids
the chat template renders, and the same step with a generator rank running the tools (by hand); a PPO step with the
calculator and in an environment (GAE across the tool tokens, by hand); what such a run refuses (an unknown tool)."""
from __future__ import annotations

import json
import re

import mindspore as ms
import numpy as np
import pytest

from grpo_runs import SUITE_RECOMPUTE, byhand, byhand_only, grpo_args, is_timing, msrun, read_rows, run_inprocess
from mindrlhf.data.gsm8k import DEFAULT_SYSTEM_PROMPT
from mindrlhf.errors import MindRLHFError
from mindrlhf.evaluation.gsm8k_eval import evaluate
from mindrlhf.rollout_tools import ToolBox, assistant_message, render_prompt, retokenization_drift, tool_result_ids
from mindrlhf.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tool_prompts(tmp_path_factory, data_dir):
    """GSM8K's first 8 test questions as TRL conversational prompt rows whose ``tools`` column holds the
    calculator's schema (the chat template renders it into every prompt)."""
    schemas = ToolBox(["calculator"]).schemas
    rows = [json.loads(line) for line in (data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()[:8]]
    path = tmp_path_factory.mktemp("tool_prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                                                   {"role": "user", "content": r["question"]}],
                                        "answer": r["answer"], "tools": schemas}) + "\n" for r in rows),
                    encoding="utf-8")
    return path


@pytest.mark.slow
def test_a_step_without_calls_is_the_one_turn_step_bit_for_bit(grpo_assets, tool_prompts, tmp_path):
    common = dict(mind_dataset_dir=tool_prompts, max_prompt_length=512, max_steps=2, save_steps=2,
                  tensorboard="false", log_completions_steps=0)
    plain, tools = tmp_path / "plain", tmp_path / "tools"
    assert run_inprocess(grpo_args(grpo_assets, plain, **common)) == 0
    assert run_inprocess(grpo_args(grpo_assets, tools, tools=["calculator"], **common)) == 0
    a, b = read_rows(plain), read_rows(tools)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for x, y in zip(a, b):
        assert {k for k in set(y) - set(x)} == {"tools/call_frequency", "tools/failure_frequency", "tools/turns/mean"}
        assert (y["tools/call_frequency"], y["tools/failure_frequency"], y["tools/turns/mean"]) == (0.0, 0.0, 1.0)
        for key, value in x.items():
            if not is_timing(key):
                assert y[key] == value or (value != value and y[key] != y[key]), (x["step"], key, y[key], value)
    w1, w2 = (ms.load_checkpoint(str(run / "checkpoints" / "step_00000002" / "policy.ckpt")) for run in (plain, tools))
    assert set(w1) == set(w2)
    for name in w1:
        np.testing.assert_array_equal(w2[name].asnumpy(), w1[name].asnumpy(), err_msg=name)
    # the prompts the policy saw showed the calculator
    tok = Tokenizer.from_dir(grpo_assets["model"])
    from mindrlhf.data.text_rows import read_prompt_rows

    rows, _ = read_prompt_rows(tool_prompts, tok, max_prompt_length=512, show_progress=False)
    assert '"name": "calculator"' in tok.decode(rows.prompt_ids[0], skip_special_tokens=False)


def test_tools_are_refused_before_any_model_loads(grpo_assets, tmp_path, capsys):
    from mindrlhf.grpo import main

    assert main(grpo_args(grpo_assets, tmp_path / "a", tools=["calculatr"])) != 0
    assert "unknown tool 'calculatr'; built-ins: calculator" in capsys.readouterr().err


def test_ppo_takes_tools_and_environments_and_refuses_what_grpo_refuses_in_one_line(tmp_path, capsys):
    """PPO's config takes ``tools`` and an ``environment`` (with its reward); what is still refused is GRPO's rule for
    every rollout stage, one line naming the fix, before any model loads."""
    from mindrlhf.configs.ppo import parse_ppo_args
    from mindrlhf.ppo import main as ppo

    out = ["--output_dir", str(tmp_path / "o")]
    assert parse_ppo_args(["--tools", "calculator", "--reward_funcs", "accuracy", *out]).generation.tools == \
        ["calculator"]
    cfg = parse_ppo_args(["--environment", "tool_envs:CalculatorEnv", "--reward_funcs", "accuracy", "environment",
                          *out])
    assert (cfg.generation.environment, cfg.reward.reward_funcs) == ("tool_envs:CalculatorEnv",
                                                                      ["accuracy", "environment"])
    for argv, message in [
            (["--tools", "calculatr"], "unknown tool 'calculatr'; built-ins: calculator"),
            (["--reward_funcs", "accuracy", "environment"],
             "reward_funcs has 'environment' (an environment's get_reward()) but environment is ''; set environment"),
            (["--environment", "tool_envs:CalculatorEnv", "--gen_workers", "1", "--use_parallel", "true"],
             "environment with gen_workers = 1: a disaggregated rollout does not carry environments' rewards yet; "
             "set gen_workers 0, or use tools")]:
        assert ppo([*argv, *out]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


QUESTIONS = [("What is 48 / 2?", "48 / 2", "24"), ("What is 7 * 6?", "7 * 6", "42")]


def _call(expression: str) -> str:
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>' % expression


@pytest.fixture(scope="module")
def tool_caller(tmp_path_factory, grpo_assets):
    """The tiny Qwen2 after SFT on two questions' tool-using answers (the call, then after the calculator's result
    'The answer is N.'), and those questions as prompt rows with the calculator's schema."""
    from mindrlhf.sft import main as sft

    root = tmp_path_factory.mktemp("tool_caller")
    tok, box = Tokenizer.from_dir(grpo_assets["model"]), ToolBox(["calculator"])
    sft_rows, prompt_rows = [], []
    for question, expression, answer in QUESTIONS:
        messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": question}]
        prompt = render_prompt(tok, messages, box.schemas)
        results = tok.decode(tool_result_ids(tok, box.run(_call(expression))), skip_special_tokens=False)
        sft_rows += [{"prompt": prompt, "completion": _call(expression) + "<|im_end|>"},
                     {"prompt": prompt + _call(expression) + "<|im_end|>" + results,
                      "completion": f"The answer is {answer}.<|im_end|>"}]
        prompt_rows.append({"prompt": messages, "answer": f"#### {answer}", "tools": box.schemas})
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft_rows), encoding="utf-8")
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompt_rows), encoding="utf-8")
    # the same questions as GSM8K rows, for the evaluation
    (root / "questions.jsonl").write_text("".join(json.dumps({"question": q, "answer": f"{e} = {a}\n#### {a}"}) + "\n"
                                                  for q, e, a in QUESTIONS), encoding="utf-8")
    out = root / "sft"
    assert sft(["--model", str(grpo_assets["model"]), "--train_file", str(root / "sft.jsonl"), "--output_dir", str(out),
                "--batch_size", "4", "--micro_batch_size", "4", "--lr", "1e-2", "--max_steps", "150", "--save_steps",
                "150", "--max_length", "512", "--lr_schedule", "constant", "--warmup_steps", "0", "--progress_bar",
                "false", "--tensorboard", "false", "--recompute", "full", "--layer_graph_shapes", "dynamic"]) == 0
    return {"model": out, "prompts": root / "prompts.jsonl", "questions": root / "questions.jsonl", "tokenizer": tok,
            "box": box}


@pytest.fixture(scope="module")
def tool_step(tool_caller, grpo_assets, tmp_path_factory):
    """One near-greedy GRPO step of the taught model with the calculator, evaluated on its questions after the
    step; its run folder and the step's dumped rows."""
    root = tmp_path_factory.mktemp("tool_step")
    out = root / "run"
    assert run_inprocess(grpo_args(grpo_assets, out, sft_path_train=tool_caller["model"],
                                   mind_dataset_dir=tool_caller["prompts"], max_prompt_length=512,
                                   max_completion_length=96, num_generations=2, max_steps=1, save_steps=1,
                                   temperature=0.05, tools=["calculator"], tensorboard="false",
                                   save_data_file=root / "dump", eval_steps=1,
                                   eval_file=tool_caller["questions"])) == 0
    return out, np.load(root / "dump.step1.npz")


def _segments(tok, box, dump, g: int):
    """Row ``g`` of the dump: its prompt ids, its question and the ids of the taught call, the calculator's result
    (as the template renders it) and the reply."""
    prompt = [int(t) for t, m in zip(dump["prompt_ids"][g], dump["prompt_mask"][g]) if m]
    (question, expression, answer), = [q for q in QUESTIONS if q[0] in tok.decode(prompt)]
    call, reply = tok.encode(_call(expression) + "<|im_end|>"), tok.encode(f"The answer is {answer}.<|im_end|>")
    return prompt, (question, expression, answer), call, tool_result_ids(tok, box.run(_call(expression))), reply


@pytest.mark.slow
def test_a_grpo_step_with_a_tool_call(tool_caller, tool_step):
    out, dump = tool_step
    (row,) = read_rows(out)
    tok, box = tool_caller["tokenizer"], tool_caller["box"]
    policy_tokens = []
    assert len(dump["completion_ids"]) == 4  # two prompts (in the dataset's shuffled order), two completions each
    for g in range(4):
        prompt, (question, expression, answer), call, tool, reply = _segments(tok, box, dump, g)
        results = box.run(_call(expression))
        # near-greedy sampling: the taught call and answer
        n = len(call) + len(tool) + len(reply)
        assert dump["completion_ids"][g, :n].tolist() == call + tool + reply, g
        # the tool's tokens are attended to but out of the loss
        assert dump["completion_mask"][g, :n].tolist() == [1.0] * len(call) + [0.0] * len(tool) + [1.0] * len(reply)
        assert not dump["completion_mask"][g, n:].any() and dump["completion_present"][g, :n].all()
        assert not dump["sampler_logp"][g, len(call):len(call) + len(tool)].any()
        policy_tokens.append(len(call) + len(reply))
        # token in, token out: the trajectory re-rendered as messages is exactly the sampled ids
        messages = ([{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": question},
                     assistant_message(_call(expression))]
                    + [{"role": "tool", "name": r.name, "content": r.content} for r in results]
                    + [{"role": "assistant", "content": f"The answer is {answer}."}])
        assert retokenization_drift(tok, messages, prompt + call + tool + reply, tools=box.schemas) is None
    assert (row["tools/call_frequency"], row["tools/failure_frequency"], row["tools/turns/mean"]) == (1.0, 0.0, 2.0)
    assert row["completions/mean_length"] == pytest.approx(np.mean(policy_tokens))  # policy tokens only
    assert row["rewards/accuracy/mean"] == 1.0
    # the completions dump shows each trajectory as messages: the call, the calculator's result, the reply
    dumped = [json.loads(line) for line in (out / "completions_step_1.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(dumped) == 4
    for d in dumped:
        (question, expression, answer), = [q for q in QUESTIONS if q[0] in d["prompt"]]
        assert d["messages"] == ([assistant_message(_call(expression))]
                                 + [{"role": "tool", "name": r.name, "content": r.content}
                                    for r in box.run(_call(expression))]
                                 + [{"role": "assistant", "content": f"The answer is {answer}."}])
    # evaluation while training runs the same tool loop: its rows are mindrlhf-eval's of the step's checkpoint
    summary = evaluate(str(out / "checkpoints" / "step_00000001"), data_path=tool_caller["questions"],
                       max_new_tokens=96, progress=False, tools=box)
    assert (summary["accuracy"], summary["tool_call_frequency"], summary["tool_failure_frequency"],
            summary["turns_mean"]) == (1.0, 1.0, 0.0, 2.0)
    assert {k: v for k, v in row.items() if k.startswith("eval/") and not k.startswith("eval/reward/")} == {
        "eval/accuracy": 1.0, "eval/format_rate": summary["format_rate"],
        "eval/mean_length": summary["mean_completion_tokens"], "eval/truncated_rate": 0.0,
        "eval/tools/call_frequency": 1.0, "eval/tools/failure_frequency": 0.0, "eval/tools/turns/mean": 2.0}
    assert summary["mean_completion_tokens"] == pytest.approx(np.mean(policy_tokens))  # the tool tokens left out


def test_mindrlhf_eval_with_and_without_the_calculator(tool_caller, tmp_path, capsys):
    """The taught model answers its two questions through the calculator, and none without it.
    ``mindrlhf-eval --tools calculator`` runs on the packaged test sample."""
    from mindrlhf.evaluation.gsm8k_eval import main

    tok, box = tool_caller["tokenizer"], tool_caller["box"]
    kw = dict(data_path=tool_caller["questions"], max_new_tokens=96, progress=False)
    with_tool = evaluate(str(tool_caller["model"]), tools=box, output=tmp_path / "with.jsonl", **kw)
    alone = evaluate(str(tool_caller["model"]), output=tmp_path / "alone.jsonl", **kw)
    assert (with_tool["accuracy"], with_tool["tool_call_frequency"], with_tool["turns_mean"]) == (1.0, 1.0, 2.0)
    assert with_tool["tools"] == ["calculator"] and "tools" not in alone
    for question, expression, answer in QUESTIONS:
        row = next(json.loads(line) for line in (tmp_path / "with.jsonl").read_text().splitlines()
                   if json.loads(line)["question"] == question)
        results = box.run(_call(expression))
        result = results[0].content
        # the whole trajectory as the trainer decodes it: the call, the tool's answer, the model's reply
        want = tok.decode(tok.encode(_call(expression) + "<|im_end|>") + tool_result_ids(tok, results)
                          + tok.encode(f"The answer is {answer}.<|im_end|>"), skip_special_tokens=True)
        assert (row["completions"], row["tool_calls"], row["tool_failures"]) == ([want], [1], [0]), question
        assert result == answer and f"The answer is {answer}." in want
    # without tools the prompt shows none: the taught model is lost (it never saw such a prompt)
    assert alone["accuracy"] == 0.0 and all(not json.loads(line)["correct"] and "tool_calls" not in json.loads(line)
                                            for line in (tmp_path / "alone.jsonl").read_text().splitlines())
    assert main(["--model", str(tool_caller["model"]), "--tools", "calculator", "--limit", "2", "--max_new_tokens",
                 "48", "--batch_size", "2", "--no_progress"]) == 0
    out = capsys.readouterr().out
    assert "GSM8K pass@1 on 2 questions" in out and "tools          calculator: " in out
    assert main(["--tools", "calculatr", "--limit", "1"]) == 2
    assert "unknown tool 'calculatr'; built-ins: calculator" in capsys.readouterr().err


def _row_logp(model, prompt, completion, temperature: float):
    """log softmax(logits / T) of each completion token given what precedes it, the row alone (no padding)."""
    from mindspore import Tensor, ops

    n, c = len(prompt), len(completion)
    logits = model(Tensor(np.array([list(prompt) + list(completion)], np.int32)))[0, n - 1:n - 1 + c] / temperature
    return ops.gather_elements(ops.log_softmax(logits, -1), 1, Tensor(np.array(completion, np.int32)[:, None]))[:, 0]


def _hand_loss_and_grads(model, rows, temperature: float, eps: float, beta: float, loss_agg_mode: str):
    """The GRPO loss written out on each row alone (its prompt and completion, no padding) and its gradients by
    autodiff: per token −min(r·A, clip(r, 1−ε, 1+ε)·A) + β·(e^(ref−logp) − (ref−logp) − 1) with
    r = e^(logp − old), over the tokens each row's ``keep`` marks, averaged over all of them (token-mean) or per
    row, then over the rows (seq-mean-token-mean)."""
    import mindspore as ms
    from mindspore import Tensor, ops

    params = model.trainable_params()
    tokens = float(sum(r["keep"].sum() for r in rows))

    def loss_fn():
        total = 0.0
        for r in rows:
            logp = _row_logp(model, r["prompt"], r["completion"], temperature)
            ratio = ops.exp(logp - Tensor(r["old"]))
            adv = float(r["advantage"])
            surrogate = -ops.minimum(ratio * adv, ops.clamp(ratio, 1 - eps, 1 + eps) * adv)
            d = Tensor(r["ref"]) - logp
            per_token = surrogate + beta * (ops.exp(d) - d - 1)
            kept = (per_token * Tensor(r["keep"])).sum()
            total = total + (kept / tokens if loss_agg_mode == "token-mean"
                             else kept / float(r["keep"].sum()) / len(rows))
        return total

    loss, grads = ms.value_and_grad(loss_fn, None, params)()
    return float(loss.asnumpy()), {p.name: g.asnumpy() for p, g in zip(params, grads)}


@pytest.mark.slow
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", byhand("seq-mean-token-mean", "the token-mean case runs the "
                                                                 "same masks; aggregation modes: test_train_step")])
def test_the_update_of_a_tool_trajectory_equals_the_loss_by_hand(tool_caller, tool_step, grpo_assets, loss_agg_mode):
    """The GRPO step's own rows (the call, the calculator's result, the reply), with advantages and old/reference
    log-probs set apart from the policy's so the clip and the KL act: the Updater's loss and gradients (padded,
    as the trainer lays them out, with the mask the rollout built) equal the loss written out by hand over the
    call and reply tokens only; the same sum with the tool tokens kept is another loss. The policy is the tiny
    model before its SFT: the taught one gives its tokens p ~ 1, whose gradients (1 - p) float32 resolves to ~1%."""
    import mindspore as ms

    from mindrlhf.grpo import GRPOObjective, LossSettings
    from mindrlhf.models import load_model
    from mindrlhf.models.heads import LogProbHead
    from mindrlhf.trainer.update import Updater

    _, dump = tool_step
    tok, box = tool_caller["tokenizer"], tool_caller["box"]
    model = load_model(grpo_assets["model"])
    rng = np.random.default_rng(0)
    advantages = np.array([0.9, -0.4, 1.3, -1.1], np.float32)
    width = dump["completion_ids"].shape[1]
    old = np.zeros((4, width), np.float32)
    ref = np.zeros((4, width), np.float32)
    rows = []
    for g in range(4):
        prompt, _, call, tool, reply = _segments(tok, box, dump, g)
        completion = call + tool + reply
        keep = np.array([1.0] * len(call) + [0.0] * len(tool) + [1.0] * len(reply), np.float32)
        n = len(completion)
        # old/reference log-probs a little off the policy's, so ratios run past 1 ± ε and KL > 0
        logp = _row_logp(model, prompt, completion, 1.0).asnumpy()
        old[g, :n] = logp + rng.uniform(-0.4, 0.4, n).astype(np.float32)
        ref[g, :n] = logp + rng.uniform(-0.3, 0.3, n).astype(np.float32)
        rows.append({"prompt": prompt, "completion": completion, "keep": keep, "advantage": advantages[g],
                     "old": old[g, :n], "ref": ref[g, :n]})
    settings = LossSettings(loss_type="grpo", loss_agg_mode=loss_agg_mode, epsilon_low=0.2, epsilon_high=0.2,
                            beta=0.04, kl_estimator="k3", max_completion_length=96, temperature=1.0,
                            off_policy=True)
    want_loss, want_grads = _hand_loss_and_grads(model, rows, 1.0, 0.2, 0.04, loss_agg_mode)
    with_tools, _ = _hand_loss_and_grads(model, [dict(r, keep=np.ones_like(r["keep"])) for r in rows], 1.0, 0.2,
                                         0.04, loss_agg_mode)
    assert abs(with_tools - want_loss) > 1e-3  # the mask matters: the tool tokens would change the loss

    objective = GRPOObjective(settings)
    updater = Updater(model, objective, head=LogProbHead(1.0), lr=0.0, weight_decay=0.0, betas=(0.9, 0.999),
                      eps=1e-8, max_grad_norm=0.0, jit=False)
    ids = np.concatenate([dump["prompt_ids"], dump["completion_ids"]], axis=1)[:, :-1].astype(np.int32)
    attention = np.concatenate([dump["prompt_mask"], dump["completion_present"]], axis=1)[:, :-1].astype(np.int32)
    mask = dump["completion_mask"].astype(np.float32)
    micro = {"input_ids": ids, "attention_mask": attention, "completion_ids": dump["completion_ids"].astype(np.int32),
             "completion_mask": mask, "advantages": advantages, "old_logp": old, "ref_logp": ref,
             "sampler_logp": dump["sampler_logp"].astype(np.float32)}
    # the step's global token and sequence counts, then the loss scale (1: float32)
    counts = tuple(ms.Tensor(np.float32(x)) for x in (mask.sum(), (mask.sum(1) > 0).sum(), 1.0))
    grads, loss, _ = updater.runner.loss_and_grads([micro], objective.inputs, extra=counts)
    assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    for p, g in zip(updater.params, grads):
        want = want_grads[p.name]
        np.testing.assert_allclose(g.asnumpy(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max() + 1e-9,
                                   err_msg=p.name)


@pytest.mark.slow
@pytest.mark.msrun
@byhand_only("CI runs tests/test_disaggregated.py's 1 + 1 equality run with tools (no completion calls one) and the "
             "wire format's round trip of tool-using rows")
def test_a_generator_rank_runs_the_tools_as_a_colocated_rank(tool_caller, grpo_assets, tmp_path):
    """The tool-calling step of ``test_a_grpo_step_with_a_tool_call`` under msrun with gen_workers 1: the generator
    runs the calculator, the rows (their tool tokens masked) and every metric equal the colocated run's."""
    job = dict(sft_path_train=tool_caller["model"], mind_dataset_dir=tool_caller["prompts"], max_prompt_length=512,
               max_completion_length=96, num_generations=2, max_steps=1, save_steps=1, temperature=0.05,
               tools=["calculator"], tensorboard="false")
    one, two = tmp_path / "colocated", tmp_path / "disaggregated"
    assert run_inprocess(grpo_args(grpo_assets, one, save_data_file=tmp_path / "one", **job)) == 0
    msrun(2, grpo_args(grpo_assets, two, use_parallel="true", gen_workers=1, save_data_file=tmp_path / "two", **job),
          tmp_path / "log", 8229)
    (a,), (b,) = read_rows(one), read_rows(two)
    assert (b["tools/call_frequency"], b["tools/failure_frequency"], b["tools/turns/mean"]) == (1.0, 0.0, 2.0)
    assert {k for k in set(b) - set(a) if not is_timing(k)} == {"staleness/mean", "staleness/max"}
    for key, value in a.items():
        if not is_timing(key) and value == value:
            assert b[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (key, b[key], value)
    want, got = np.load(tmp_path / "one.step1.npz"), np.load(tmp_path / "two.step1.npz")
    assert set(want.files) == set(got.files)
    assert (got["completion_mask"] < got["completion_present"]).any()  # the tool tokens: attended, out of the loss
    for name in want.files:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-9, err_msg=name)


def _ppo_tool_step(tool_caller, tmp_path, **extra):
    """One near-greedy PPO step of the taught model (the critic its body with a new head, no reward model, one
    mini-batch and no value normaliser: the setting in which the critic's first update would compute the old values
    itself); its metrics, its recorded rows, what ``values_pass`` and ``advantages_and_returns`` saw and made, and
    its algorithm settings."""
    from mindrlhf.configs.ppo import parse_ppo_args
    from mindrlhf.ppo import build_trainer
    from mindrlhf.trainer.entry import setup_runtime

    args = {"model": tool_caller["model"], "train_file": tool_caller["prompts"], "output_dir": tmp_path / "run",
            "reward_model": "", "batch_size": 2, "num_generations": 2, "max_new_tokens": 96,
            "max_prompt_length": 512, "temperature": 0.05, "max_steps": 1, "ppo_epochs": 1, "num_mini_batches": 1,
            "micro_batch_size": 0, "value_norm": "false", "lr": 1e-4, "progress_bar": "false",
            "tensorboard": "false", "log_completions_steps": 0, "save_data_file": tmp_path / "dump",
            **SUITE_RECOMPUTE, **extra}
    cfg = parse_ppo_args([x for k, v in args.items()
                          for x in (f"--{k}", *(map(str, v) if isinstance(v, list) else [str(v)]))])
    trainer = build_trainer(cfg, setup_runtime(cfg))
    assert trainer.values_in_update  # a one-turn step would take its old values from the critic's update
    seen = {}

    def recorded(name, real):
        def call(*a):
            seen[name] = (a, real(*a))
            return seen[name][1]
        return call

    for name in ("values_pass", "advantages_and_returns"):
        setattr(trainer, name, recorded(name, getattr(trainer, name)))
    row = trainer.train_one_step()
    row.update(trainer.evaluate_step())  # as the loop does after a step (eval_steps)
    return row, np.load(tmp_path / "dump.step1.npz"), seen, cfg.algorithm


def _gae_by_hand(rewards, values, gamma: float, lam: float):
    """GAE on one row's policy tokens alone (a list): A_t = r_t + γ·V_(t+1) − V_t + γλ·A_(t+1), 0 past the end."""
    adv, running, next_value = [0.0] * len(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        adv[t], next_value = running, values[t]
    return adv


@pytest.mark.slow
def test_a_ppo_step_with_a_tool_call(tool_caller, tmp_path):
    """The taught model's PPO step with the calculator: the rows are its call, the calculator's result and its answer,
    the result's tokens out of the mask PPO trains on; the score (accuracy) goes on the answer's last token, the
    tool tokens get no KL penalty, the step takes the separate values pass (the mask is no prefix), and the
    advantages at the policy tokens are GAE by hand on the rewards and values with the tool tokens removed (then
    whitened over the step's policy tokens), the critic's targets its returns; the tool tokens' are 0. Evaluation
    while training calls the calculator too."""
    row, dump, seen, a = _ppo_tool_step(tool_caller, tmp_path, tools=["calculator"], reward_funcs=["accuracy"],
                                        eval_steps=1, eval_file=tool_caller["questions"])
    tok, box = tool_caller["tokenizer"], tool_caller["box"]
    assert (row["tools/call_frequency"], row["tools/failure_frequency"], row["tools/turns/mean"]) == (1.0, 0.0, 2.0)
    assert row["objective/scores"] == 1.0 and row["rewards/accuracy/mean"] == 1.0
    # evaluation while training runs the same tool loop
    assert (row["eval/accuracy"], row["eval/tools/call_frequency"], row["eval/tools/turns/mean"]) == (1.0, 1.0, 2.0)
    assert len(dump["completion_ids"]) == 4
    spans = []
    for g in range(4):
        _, _, call, tool, reply = _segments(tok, box, dump, g)
        n = len(call) + len(tool) + len(reply)
        assert dump["completion_ids"][g, :n].tolist() == call + tool + reply, g
        assert dump["completion_mask"][g].tolist() == \
            [1.0] * len(call) + [0.0] * len(tool) + [1.0] * len(reply) + [0.0] * (dump["completion_mask"].shape[1] - n)
        assert dump["completion_present"][g, :n].all()
        spans.append((len(call), len(call) + len(tool), n))
    _, values = seen["values_pass"]
    assert values is not None and row["time/values"] > 0  # the separate values pass ran
    (exp, targets, _, batch), _ = seen["advantages_and_returns"]
    np.testing.assert_array_equal(batch.mask, dump["completion_mask"])
    assert (a.gamma, a.lam, a.kl_coef, a.adv_norm) == (1.0, 0.95, 0.05, True)  # PPO's defaults
    policy_adv, by_hand, one_turn_first = [], [], []
    for g, (tool_start, tool_end, n) in enumerate(spans):
        keep = np.flatnonzero(batch.mask[g])
        assert keep.tolist() == [*range(tool_start), *range(tool_end, n)]
        # no KL penalty nor reward on the tool tokens; the score on the last policy token
        assert not batch.kl[g, tool_start:tool_end].any() and not batch.rewards[g, tool_start:tool_end].any()
        assert batch.rewards[g, n - 1] == pytest.approx(batch.score[g] - a.kl_coef * batch.kl[g, n - 1], abs=1e-12)
        adv = _gae_by_hand(batch.rewards[g, keep].tolist(), batch.values[g, keep].tolist(), a.gamma, a.lam)
        by_hand += adv
        policy_adv += exp.advantages[g, keep].tolist()
        assert not exp.advantages[g, tool_start:tool_end].any() and not exp.advantages[g, n:].any()
        # the critic's targets: the returns, advantages + values before the whitening, 0 on the tool tokens
        np.testing.assert_allclose(targets.returns[g, keep], np.array(adv) + batch.values[g, keep], rtol=1e-5,
                                   atol=1e-6)
        assert not targets.returns[g, tool_start:tool_end].any()
        # what ending the call's credit at the tool block would give its first token
        call_alone = _gae_by_hand(batch.rewards[g, :tool_start].tolist(), batch.values[g, :tool_start].tolist(),
                                  a.gamma, a.lam)
        one_turn_first.append(abs(call_alone[0] - adv[0]))
    x = np.array(by_hand)
    white = (x - x.mean()) / np.sqrt(((x - x.mean()) ** 2).sum() / (len(x) - 1) + 1e-8)  # adv_norm (TRL's whiten)
    np.testing.assert_allclose(policy_adv, white, rtol=1e-5, atol=1e-6)
    assert min(one_turn_first) > 0.05  # the carried credit is not a vacuous difference
    assert np.isfinite(row["loss/value_avg"]) and row["val/grad_norm"] > 0 and row["grad_norm"] > 0


@pytest.mark.slow
def test_a_ppo_step_in_an_environment_scores_its_reward(tool_caller, tmp_path):
    """The taught model's PPO step in ``CalculatorEnv`` (the calculator a method of each completion's instance): the
    rollout's reward functions get the environment's ``get_reward()``, which adds to the score as any rule reward."""
    row, dump, _, _ = _ppo_tool_step(tool_caller, tmp_path, environment="tool_envs:CalculatorEnv",
                                     reward_funcs=["accuracy", "environment"], kl_coef=0.0)
    assert (row["tools/call_frequency"], row["tools/turns/mean"]) == (1.0, 2.0)
    assert (row["rewards/environment/mean"], row["rewards/accuracy/mean"], row["objective/scores"]) == (1.0, 1.0, 2.0)
    assert (dump["completion_mask"] < dump["completion_present"]).any()


def test_an_environment_is_read_and_refused_in_one_line(grpo_assets, tmp_path, capsys):
    from mindrlhf.grpo import main
    from mindrlhf.rollout_tools.environment import Environment

    env = Environment("tool_envs:CalculatorEnv")
    assert (env.methods, env.has_reward) == (["calculator"], True)
    assert env.schemas == ToolBox(["calculator"]).schemas  # the built-in's schema: the taught model calls it alike
    instance = env.start({"solution": "24", "question": "What is 48 / 2?"})
    assert (env.tools(instance)[0]("48 / 2"), env.reward(instance)) == ("24", 1.0)
    assert env.reward(env.start({"solution": "25"})) == 0.0  # a new instance: nothing called yet
    for path, message in [("tool_envs:Talkative", "reset returned an observation ('The numbers are small.')"),
                          ("tool_envs:NoTools", "has no public methods besides reset/get_reward"),
                          ("tool_envs:NeedsArguments", "NeedsArguments() failed: TypeError"),
                          ("tool_envs:builtin_calculator", "is not a class"),
                          ("tool_envs:Missing", "module 'tool_envs' has no callable 'Missing'")]:
        with pytest.raises(MindRLHFError, match=re.escape(message)):
            Environment(path).start({})
    assert main(grpo_args(grpo_assets, tmp_path / "a", reward_funcs=["accuracy", "environment"])) != 0
    assert "reward_funcs has 'environment' (an environment's get_reward()) but environment is ''" in \
        capsys.readouterr().err
    assert main(grpo_args(grpo_assets, tmp_path / "b", environment="tool_envs:NoTools")) != 0
    assert "environment NoTools has no public methods" in capsys.readouterr().err
    assert main(grpo_args(grpo_assets, tmp_path / "c", environment="tool_envs:CalculatorEnv", gen_workers=1,
                          use_parallel="true")) != 0
    assert "environment with gen_workers = 1: a disaggregated rollout does not carry" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow
def test_a_grpo_step_in_an_environment_is_the_tool_step_with_its_reward(tool_caller, tool_step, grpo_assets, tmp_path):
    """The taught model in ``CalculatorEnv`` (the calculator as a method of one instance per completion, reset with
    the row): the same prompts, completions and tool metrics as the step with the built-in calculator, and the
    environment's reward (1.0: each rollout's call gave its row's answer) in training and in the evaluation."""
    _, want = tool_step
    out = tmp_path / "run"
    assert run_inprocess(grpo_args(grpo_assets, out, sft_path_train=tool_caller["model"],
                                   mind_dataset_dir=tool_caller["prompts"], max_prompt_length=512,
                                   max_completion_length=96, num_generations=2, max_steps=1, save_steps=1,
                                   temperature=0.05, environment="tool_envs:CalculatorEnv", tensorboard="false",
                                   reward_funcs=["accuracy", "environment"], save_data_file=tmp_path / "dump",
                                   eval_steps=1, eval_file=tool_caller["questions"])) == 0
    (row,) = read_rows(out)
    got = np.load(tmp_path / "dump.step1.npz")
    for name in ("prompt_ids", "completion_ids", "completion_mask"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert (row["tools/call_frequency"], row["tools/failure_frequency"], row["tools/turns/mean"]) == (1.0, 0.0, 2.0)
    assert (row["rewards/environment/mean"], row["rewards/accuracy/mean"]) == (1.0, 1.0)
    assert (row["eval/reward/environment"], row["eval/tools/call_frequency"], row["eval/accuracy"]) == (1.0, 1.0, 1.0)


@pytest.mark.slow
@pytest.mark.msrun
@byhand_only("CI runs the tool masks through one process's update (the loss by hand above) and the disaggregated "
             "1 + 1 run with tools")
def test_two_data_parallel_workers_with_tools_train_as_one_process(tool_caller, grpo_assets, tmp_path):
    """Two data-parallel workers sample the taught model's tool calls (each its share of the prompts) and train one
    step whose loss divides by the global count of policy tokens (the tool tokens of both replicas left out); one
    process replaying their recorded rows computes the same step: loss, grad norm and weights."""
    from grpo_runs import assert_same_updated_weights

    # temperature 1.5: the taught model's tokens have p ~ 1 at its sampling temperature, and so gradients ~1e-6
    job = dict(sft_path_train=tool_caller["model"], mind_dataset_dir=tool_caller["prompts"], max_prompt_length=512,
               max_completion_length=96, num_generations=2, max_steps=1, save_steps=1, temperature=1.5,
               tensorboard="false", advantage_estimator="reinforce_plus_plus", loss_agg_mode="token-mean",
               reward_funcs=["e2e_rewards:length_reward"], lr=1e-3)
    two, one, dump = tmp_path / "dp2", tmp_path / "one", tmp_path / "rows" / "rollouts.npz"
    msrun(2, grpo_args(grpo_assets, two, use_parallel="true", train_dp=2, infer_dp=2, tools=["calculator"],
                       save_data_file=dump, **job), tmp_path / "log", 8231)
    (b,) = read_rows(two)
    assert b["tools/call_frequency"] > 0 and b["tools/turns/mean"] > 1.0
    rows = np.load(tmp_path / "rows" / "rollouts.step1.npz")
    assert (rows["completion_mask"] < rows["completion_present"]).any()  # tool tokens: attended, out of the loss
    assert run_inprocess(grpo_args(grpo_assets, one, replay_data_file=dump, **job)) == 0
    (a,) = read_rows(one)
    assert a["grad_norm"] > 1e-4  # not a vacuous comparison
    for key in ("loss", "grad_norm", "reward", "completions/mean_length"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (key, b[key], a[key])
    assert_same_updated_weights(*(ms.load_checkpoint(str(run / "checkpoints" / "step_00000001" / "policy.ckpt"))
                                  for run in (one, two)), lr=1e-3)


@pytest.mark.slow
def test_a_tool_turn_continues_from_its_kept_cache(tool_caller):
    """The taught model's tool loop on the native sampler: the continuation after the calculator's result prefills
    only the result (the call's cache is kept), and samples what a sampler that prefills everything samples."""
    from mindrlhf.generation import NativeSampler, SamplingParams
    from mindrlhf.generation.tool_loop import ToolLoop
    from mindrlhf.models import load_model

    tok, box = tool_caller["tokenizer"], tool_caller["box"]
    prompts = [tok.encode(render_prompt(tok, [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                                              {"role": "user", "content": q}], box.schemas)) for q, _, _ in QUESTIONS]
    model = load_model(str(tool_caller["model"]))
    params = SamplingParams(n=2, temperature=0.7, max_tokens=96, stop_token_ids=tok.stop_token_ids, seed=5)
    # One tool round, so the sampler's last call is the continuation measured below (at this temperature the taught
    # model sometimes calls twice, which would start a second round).
    loop = ToolLoop(box, tok, max_iterations=1)
    reusing, whole = NativeSampler(model), NativeSampler(model, keep_bytes=0)
    got = loop.generate(reusing, prompts, params)
    reused = reusing.last_stats["reused_tokens"]
    want = loop.generate(whole, prompts, params)
    assert all(c.tool_calls == 1 for c in got) and reused > 0 and whole.last_stats["reused_tokens"] == 0, \
        ([c.tool_calls for c in got], [tok.decode(c.token_ids) for c in got])
    # Each continuation (prompt, call, tool result) is left-padded to P columns; its prompt and call but the call's
    # last token are kept, and the prefill's 32-token pieces start at the one holding the first column to compute.
    kept = [len(prompts[c.prompt_index]) + c.tool_mask.index(0) - 1 for c in got]
    lengths = [len(prompts[c.prompt_index]) + c.tool_mask.index(1, c.tool_mask.index(0)) for c in got]
    P = -(-max(lengths) // 32) * 32
    start = min(P - n + k for n, k in zip(lengths, kept)) // 32 * 32
    assert reused == sum(start - (P - n) for n in lengths) > 0.8 * sum(kept)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.tool_mask for c in got] == [c.tool_mask for c in want]
    for x, y in zip(got, want):
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-5)
