"""Tools in the shared rollout of a GRPO run: a run with ``tools`` in which no completion calls one is today's
one-turn run bit for bit (metrics and weights), with the tool metrics at zero; what such a run refuses."""
from __future__ import annotations

import json

import mindspore as ms
import numpy as np
import pytest

from grpo_runs import grpo_args, is_timing, read_rows, run_inprocess
from mindrlhf.data.gsm8k import DEFAULT_SYSTEM_PROMPT
from mindrlhf.rollout_tools import ToolBox
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
    assert main(grpo_args(grpo_assets, tmp_path / "b", tools=["calculator"], gen_workers=1)) != 0
    assert "a disaggregated rollout does not run tools yet" in capsys.readouterr().err
