"""Tools in the shared rollout of a GRPO run: a run with ``tools`` in which no completion calls one is today's
one-turn run bit for bit (metrics and weights), with the tool metrics at zero; a tiny model taught by SFT to call
the calculator makes a GRPO step whose rows are its call, the tool's result (masked) and its answer, exactly the ids
the chat template renders, and the same step with a generator rank running the tools (by hand); what such a run
refuses (PPO, an unknown tool)."""
from __future__ import annotations

import json

import mindspore as ms
import numpy as np
import pytest

from grpo_runs import byhand_only, grpo_args, is_timing, msrun, read_rows, run_inprocess
from mindrlhf.data.gsm8k import DEFAULT_SYSTEM_PROMPT
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
    from mindrlhf.ppo import main as ppo

    assert ppo(["--tools", "calculator", "--output_dir", str(tmp_path / "c"), "--reward_funcs", "accuracy"]) == 2
    assert "tools with PPO: its GAE does not yet carry credit across the tool tokens" in capsys.readouterr().err


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
    out = root / "sft"
    assert sft(["--model", str(grpo_assets["model"]), "--train_file", str(root / "sft.jsonl"), "--output_dir", str(out),
                "--batch_size", "4", "--micro_batch_size", "4", "--lr", "1e-2", "--max_steps", "150", "--save_steps",
                "150", "--max_length", "512", "--lr_schedule", "constant", "--warmup_steps", "0", "--progress_bar",
                "false", "--tensorboard", "false", "--recompute", "full", "--layer_graph_shapes", "dynamic"]) == 0
    return {"model": out, "prompts": root / "prompts.jsonl", "tokenizer": tok, "box": box}


@pytest.mark.slow
def test_a_grpo_step_with_a_tool_call(tool_caller, grpo_assets, tmp_path):
    out = tmp_path / "run"
    assert run_inprocess(grpo_args(grpo_assets, out, sft_path_train=tool_caller["model"],
                                   mind_dataset_dir=tool_caller["prompts"], max_prompt_length=512,
                                   max_completion_length=96, num_generations=2, max_steps=1, save_steps=1,
                                   temperature=0.05, tools=["calculator"], tensorboard="false",
                                   save_data_file=tmp_path / "dump")) == 0
    (row,) = read_rows(out)
    tok, box = tool_caller["tokenizer"], tool_caller["box"]
    dump = np.load(tmp_path / "dump.step1.npz")
    policy_tokens = []
    assert len(dump["completion_ids"]) == 4  # two prompts (in the dataset's shuffled order), two completions each
    for g in range(4):
        prompt = [int(t) for t, m in zip(dump["prompt_ids"][g], dump["prompt_mask"][g]) if m]
        (question, expression, answer), = [q for q in QUESTIONS if q[0] in tok.decode(prompt)]
        call, reply = tok.encode(_call(expression) + "<|im_end|>"), tok.encode(f"The answer is {answer}.<|im_end|>")
        results = box.run(_call(expression))
        tool = tool_result_ids(tok, results)
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
