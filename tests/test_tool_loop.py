"""The multi-turn rollout (``generation.tool_loop.ToolLoop``) on the real Qwen2.5 tokenizer, driven by a scripted
policy: a Sampler whose completions are fixed token ids (the loop's contract is the Sampler's, so this is a real
backend of it, not a stand-in for MindSpore). Trajectories, tool masks, log-probs, budgets, round limits, counts and
seeds are checked token by token."""
from __future__ import annotations

from typing import Callable, List, Sequence

import pytest

from mindrlhf.errors import MindRLHFError
from mindrlhf.generation import Completion, Sampler, SamplingParams
from mindrlhf.generation.tool_loop import ToolLoop
from mindrlhf.rollout_tools import render_prompt, tool_result_ids
from mindrlhf.tokenizer import Tokenizer

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "48 / 2"}}\n</tool_call><|im_end|>'
ANSWER = "The answer is 24.<|im_end|>"


class ScriptedSampler(Sampler):
    """Completions from ``policy(prompt_ids) -> text``: its ids cut at ``max_tokens`` and at the first stop id, each
    token's log-prob -(its position + 1) / 100; every request's params are kept in ``requests``."""

    def __init__(self, tokenizer: Tokenizer, policy: Callable[[List[int]], str]):
        self.tokenizer, self.policy = tokenizer, policy
        self.requests: List[SamplingParams] = []
        self.last_stats, self.tokens_generated = {}, 0

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> List[Completion]:
        self.requests.append(params)
        out = []
        for i, prompt in enumerate(prompts):
            for _ in range(params.n):
                ids = self.tokenizer.encode(self.policy(list(prompt)))
                stop = next((k for k, t in enumerate(ids) if t in params.stop_token_ids), None)
                ids = ids[:stop + 1] if stop is not None else ids
                finish = "stop" if stop is not None and stop < params.max_tokens else "length"
                ids = ids[:params.max_tokens]
                out.append(Completion(i, ids, [-(k + 1) / 100 for k in range(len(ids))], finish,
                                      entropies=[0.5] * len(ids) if params.entropy else []))
        return out

    def load_weights(self, named_arrays) -> int:
        return 0

    def release(self) -> None:
        pass


def _prompt(tok, calc, question: str) -> List[int]:
    return tok.encode(render_prompt(tok, [{"role": "user", "content": question}], calc.schemas))


def _params(tok, **kw) -> SamplingParams:
    return SamplingParams(**{"n": 1, "max_tokens": 200, "stop_token_ids": tok.stop_token_ids, "seed": 11,
                             "entropy": True, **kw})


def _after_tool(tok, prompt: List[int]) -> bool:
    return "<tool_response>" in tok.decode(prompt, skip_special_tokens=False)


def test_a_call_is_answered_and_the_policy_continues(tok, calc):
    calls_then_answers = ScriptedSampler(tok, lambda p: ANSWER if _after_tool(tok, p) else CALL)
    loop = ToolLoop(calc, tok, max_iterations=3)
    prompts = [_prompt(tok, calc, "What is 48 / 2?")]
    (row,) = loop.generate(calls_then_answers, prompts, _params(tok))
    first, reply = tok.encode(CALL), tok.encode(ANSWER)
    suffix = tool_result_ids(tok, calc.run(CALL))
    assert "<tool_response>\n24\n</tool_response>" in tok.decode(suffix, skip_special_tokens=False)
    assert row.token_ids == first + suffix + reply
    assert row.tool_mask == [1] * len(first) + [0] * len(suffix) + [1] * len(reply)
    # the tools' tokens carry no log-prob or entropy; the policy's are the sampler's, turn by turn
    assert row.logprobs == ([-(k + 1) / 100 for k in range(len(first))] + [0.0] * len(suffix)
                            + [-(k + 1) / 100 for k in range(len(reply))])
    assert row.entropies == [0.5] * len(first) + [0.0] * len(suffix) + [0.5] * len(reply)
    assert (row.finish_reason, row.turns, row.tool_calls, row.tool_failures) == ("stop", 2, 1, 0)
    # the continuation was asked for prompt + first turn + results, one completion, with the budget left
    second = calls_then_answers.requests[1]
    assert (second.n, second.max_tokens, second.min_tokens) == (1, 200 - len(first) - len(suffix), 0)
    assert second.seed == (11 + 1_000_003) % 2 ** 31 != calls_then_answers.requests[0].seed


def test_a_batch_without_calls_is_the_samplers_own(tok, calc):
    answers = ScriptedSampler(tok, lambda p: ANSWER)
    prompts = [_prompt(tok, calc, "What is 1 + 1?"), _prompt(tok, calc, "What is 2 + 2?")]
    plain = answers.generate(prompts, _params(tok, n=2))
    looped = ToolLoop(calc, tok, max_iterations=3).generate(answers, prompts, _params(tok, n=2))
    assert looped == plain and all(c.tool_mask == [] and c.turns == 1 for c in looped)
    assert len(answers.requests) == 2  # no second round was asked for


def test_rows_advance_together_and_only_callers_continue(tok, calc):
    # prompt 0 calls, prompt 1 answers at once: one continuation request, for prompt 0's row alone
    policy = ScriptedSampler(tok, lambda p: ANSWER if _after_tool(tok, p) or "2 + 2" in tok.decode(p)
                             else CALL)
    prompts = [_prompt(tok, calc, "What is 48 / 2?"), _prompt(tok, calc, "What is 2 + 2?")]
    rows = ToolLoop(calc, tok, max_iterations=3).generate(policy, prompts, _params(tok, n=2))
    assert [r.turns for r in rows] == [2, 2, 1, 1] and [r.prompt_index for r in rows] == [0, 0, 1, 1]
    assert [r.tool_calls for r in rows] == [1, 1, 0, 0]
    assert rows[2].token_ids == tok.encode(ANSWER) and rows[2].tool_mask == [1] * len(rows[2].token_ids)
    assert len(policy.requests) == 2


def test_failures_are_results_and_counted(tok, calc):
    bad = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "48 / 0"}}\n</tool_call>' \
          '<tool_call>{oops}</tool_call><|im_end|>'
    policy = ScriptedSampler(tok, lambda p: ANSWER if _after_tool(tok, p) else bad)
    (row,) = ToolLoop(calc, tok, max_iterations=3).generate(policy, [_prompt(tok, calc, "q")], _params(tok))
    assert (row.tool_calls, row.tool_failures, row.turns) == (2, 2, 2)
    tool_text = tok.decode([t for t, m in zip(row.token_ids, row.tool_mask) if m == 0], skip_special_tokens=False)
    assert "error: division by zero" in tool_text and "error: malformed tool call: not JSON" in tool_text


def test_the_round_limit_and_the_budget(tok, calc):
    always = ScriptedSampler(tok, lambda p: CALL)
    first = tok.encode(CALL)
    suffix = tool_result_ids(tok, calc.run(CALL))
    (row,) = ToolLoop(calc, tok, max_iterations=2).generate(always, [_prompt(tok, calc, "q")], _params(tok))
    # two rounds ran; the third turn's call is not run (nor counted) and the completion ends there
    assert (row.turns, row.tool_calls) == (3, 2) and row.token_ids == first + suffix + first + suffix + first
    (none,) = ToolLoop(calc, tok, max_iterations=0).generate(always, [_prompt(tok, calc, "q")], _params(tok))
    assert none.token_ids == first and none.turns == 1 and none.tool_calls == 0
    # results that do not fit with one more token: not appended, the row ends with its call unanswered
    tight = len(first) + len(suffix)
    (cut,) = ToolLoop(calc, tok, max_iterations=2).generate(always, [_prompt(tok, calc, "q")],
                                                            _params(tok, max_tokens=tight))
    assert cut.token_ids == first and cut.tool_calls == 1 and cut.turns == 1
    # room for part of the reply: it is cut at the budget, a "length" completion of exactly max_tokens tokens
    answers = ScriptedSampler(tok, lambda p: ANSWER if _after_tool(tok, p) else CALL)
    (short,) = ToolLoop(calc, tok, max_iterations=2).generate(answers, [_prompt(tok, calc, "q")],
                                                              _params(tok, max_tokens=tight + 2))
    assert short.finish_reason == "length" and len(short.token_ids) == tight + 2
    assert short.token_ids[-2:] == tok.encode(ANSWER)[:2] and short.tool_mask[-2:] == [1, 1]


def test_a_negative_round_limit_is_refused(tok, calc):
    with pytest.raises(MindRLHFError, match="max_tool_calling_iterations must be >= 0"):
        ToolLoop(calc, tok, max_iterations=-1)
