"""The multi-turn rollout: generate, run the tools the turn called, append their results as token ids, generate on.

``ToolLoop.generate(sampler, prompts, params)`` keeps the Sampler contract (``params.n`` completions per prompt,
prompt-major) for completions that may span several assistant turns. A turn that ends with a stop token and holds
``<tool_call>`` blocks has its calls answered by the ``ToolBox``; the results' ids (``rollout_tools.render``: the
template's ``tool`` messages and the next assistant header) are appended and the policy continues from
``prompt + everything so far``. Every row that continues is sampled in one batched call, so rows advance together
and a row without calls waits for nobody. A row stops at a turn without calls, after ``max_iterations`` tool rounds,
or when the completion budget (``params.max_tokens``, shared by all turns and the tool tokens) is spent: results that
would not fit are not appended (the row ends with its call unanswered), a continuation is cut at what is left
(``finish_reason`` "length"). ``tool_calls`` counts the calls that ran.

With an ``Environment`` (``rollout_tools.environment``) every completion gets its own instance, reset with its
prompt's row before the first turn; its calls go to that instance's methods (and the run's tools), and its
``get_reward()`` is read into ``Completion.env_reward`` after the last turn.

Inside the sampler's ``reuse_prefixes`` a turn that calls tools may keep its KV cache, so its continuation
prefills only the tool results (the native sampler does; vLLM's prefix caching does the same on its own).

Token in, token out: the policy's ids are never re-tokenised. ``Completion.tool_mask`` marks the policy's tokens (1)
and the tools' (0); the tools' log-probs and entropies are 0. A batch in which no turn calls a tool returns the
sampler's completions untouched.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence

from mindrlhf.errors import MindRLHFError
from mindrlhf.generation.base import Sampler
from mindrlhf.generation.params import Completion, SamplingParams
from mindrlhf.rollout_tools import ToolBox, parse_tool_calls, tool_result_ids
from mindrlhf.rollout_tools.environment import Environment

if TYPE_CHECKING:
    from mindrlhf.tokenizer import Tokenizer


class ToolLoop:
    """Generation with tools: ``toolbox`` answers the calls (with ``environment``, each completion's instance
    too), ``tokenizer`` (its chat template) renders the results, at most ``max_iterations`` tool rounds per
    completion."""

    def __init__(self, toolbox: ToolBox, tokenizer: "Tokenizer", max_iterations: int,
                 environment: Optional[Environment] = None):
        if max_iterations < 0:
            raise MindRLHFError(f"max_tool_calling_iterations must be >= 0, got {max_iterations}")
        self.toolbox, self.tokenizer, self.max_iterations = toolbox, tokenizer, int(max_iterations)
        self.environment = environment
        names = toolbox.names + (environment.methods if environment is not None else [])
        if len(set(names)) < len(names):
            raise MindRLHFError(f"a tool and a method of environment {environment.name} share a name "
                                f"({', '.join(sorted(n for n in set(names) if names.count(n) > 1))}); rename one")

    @property
    def schemas(self) -> List[Dict[str, Any]]:
        """What the prompts show: the tools' schemas, then the environment's."""
        return self.toolbox.schemas + (self.environment.schemas if self.environment is not None else [])

    @property
    def names(self) -> List[str]:
        """Every tool's name, as the model calls it."""
        return [schema["function"]["name"] for schema in self.schemas]

    def _turn_text(self, ids: Sequence[int]) -> str:
        # Special tokens kept: a <tool_call> that is an added token is text the parser must see.
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _calls(self, completion: Completion, turn: Sequence[int]):
        if completion.finish_reason != "stop":  # cut by the budget: nothing after it could be generated
            return []
        return parse_tool_calls(self._turn_text(turn))

    def generate(self, sampler: Sampler, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 rows: Optional[Sequence[Mapping[str, Any]]] = None) -> List[Completion]:
        """``params.n`` completions per prompt, each continued through its tool calls (see the module docstring).
        ``rows``: each prompt's row (its columns and solution), which an environment is reset with."""
        boxes, instances = None, None
        if self.environment is not None:
            if rows is None or len(rows) != len(prompts):
                raise MindRLHFError("an environment needs each prompt's row to reset with")
            # One instance per completion (prompt-major, as the sampler returns them), reset before it is sampled.
            instances = [self.environment.start(rows[p]) for p in range(len(prompts)) for _ in range(params.n)]
            boxes = [self.environment.toolbox(x, self.toolbox) for x in instances]
        # A turn that calls tools is continued next round: the sampler may keep its cache for that.
        with sampler.reuse_prefixes(lambda ids: bool(parse_tool_calls(self._turn_text(ids)))):
            first = sampler.generate(prompts, params)
            rows_out = self._continue(sampler, prompts, params, first, boxes)
        if instances is not None:
            for c, instance in zip(rows_out, instances):
                c.env_reward = self.environment.reward(instance)
        return rows_out

    def _continue(self, sampler: Sampler, prompts: Sequence[Sequence[int]], params: SamplingParams,
                  first: List[Completion], boxes: Optional[List[ToolBox]]) -> List[Completion]:
        """The tool rounds after the first turn (``boxes``: each completion's tools; None: the run's toolbox)."""
        pending = {i: calls for i, c in enumerate(first) if (calls := self._calls(c, c.token_ids))}
        if not pending or not self.max_iterations:
            return first
        rows = [replace(c, token_ids=list(c.token_ids), logprobs=list(c.logprobs), entropies=list(c.entropies),
                        tool_mask=[1] * len(c.token_ids)) for c in first]
        with_entropy = all(len(c.entropies) == len(c.token_ids) for c in first)
        budget = params.max_tokens
        for round_index in range(self.max_iterations):
            continuing, inputs, room = [], [], []
            for i, calls in pending.items():
                row = rows[i]
                box = boxes[i] if boxes is not None else self.toolbox
                results = [box.call(call) for call in calls]
                row.tool_calls += len(results)
                row.tool_failures += sum(r.failed for r in results)
                suffix = tool_result_ids(self.tokenizer, results)
                left = budget - len(row.token_ids) - len(suffix)
                if left < 1:  # no room for the results and a reply: the row ends with its call unanswered
                    continue
                row.token_ids += suffix
                row.logprobs += [0.0] * len(suffix)
                if with_entropy:
                    row.entropies += [0.0] * len(suffix)
                row.tool_mask += [0] * len(suffix)
                continuing.append(i)
                inputs.append(list(prompts[row.prompt_index]) + row.token_ids)
                room.append(left)
            if not continuing:
                break
            # Each round draws from a seed of its own, derived from the request's, so a step stays reproducible.
            more = replace(params, n=1, max_tokens=max(room), min_tokens=0,
                           seed=(params.seed + 1_000_003 * (round_index + 1)) % (2 ** 31))
            replies = sampler.generate(inputs, more)
            pending = {}
            for i, left, reply in zip(continuing, room, replies):
                row = rows[i]
                ids, logps, ents = reply.token_ids[:left], reply.logprobs[:left], reply.entropies[:left]
                finish = "length" if len(reply.token_ids) > left else reply.finish_reason
                row.token_ids += ids
                row.logprobs += logps
                if with_entropy:
                    row.entropies += ents
                row.tool_mask += [1] * len(ids)
                row.finish_reason, row.turns = finish, row.turns + 1
                if finish == "stop" and len(row.token_ids) < budget:
                    calls = parse_tool_calls(self._turn_text(ids))
                    if calls:
                        pending[i] = calls
            if not pending:
                break
        return rows  # calls left when the rounds ran out are not run, so not counted (as TRL counts)


def environment_rewards(completions: Sequence[Completion]) -> Dict[str, list]:
    """The reward functions' ``environment_reward`` column (each completion's ``get_reward()``) when an environment
    gave them; empty otherwise."""
    if all(c.env_reward is None for c in completions):
        return {}
    return {"environment_reward": [c.env_reward for c in completions]}


def tool_loop_of(cfg, tokenizer: "Tokenizer") -> Optional[ToolLoop]:
    """The run's ``ToolLoop`` from its generation config (None without ``tools`` or ``environment``); the template
    must render tools."""
    g = cfg.generation
    if not g.tools and not g.environment:
        return None
    from mindrlhf.rollout_tools import check_template_renders_tools

    box = ToolBox(g.tools, timeout=g.tool_timeout, max_response_length=g.max_tool_response_length)
    loop = ToolLoop(box, tokenizer, g.max_tool_calling_iterations,
                    environment=Environment(g.environment) if g.environment else None)
    check_template_renders_tools(tokenizer, loop.schemas)
    return loop
