"""Tools through the chat template: their schemas into the prompt (``tools=``), and a turn's tool results as the
token ids the template renders for ``tool`` messages, appended after the policy's own tokens.

The policy's tokens are never re-tokenised: a tool turn appends ids. Those ids are the template's rendering of the
tool messages (plus the next assistant header), taken as the suffix between a conversation rendered without them and
with them, as TRL does; the suffix is only trusted when the shorter rendering's ids are a prefix of the longer's (cut
after the end-of-turn token the policy stopped at) and every result's text is in it. Anything else is a one-line
``MindRLHFError`` naming the template, never ids silently trained on.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from mindrlhf.errors import MindRLHFError
from mindrlhf.rollout_tools.calling import ToolResult
from mindrlhf.rollout_tools.hermes import assistant_message

if TYPE_CHECKING:
    from mindrlhf.tokenizer import Tokenizer

Message = Dict[str, Any]
_PROBE = [{"role": "user", "content": "What is 6 * 7?"}]
#: A tool message as the Hermes form renders it (Qwen2.5 / Qwen3 templates, and ours for ChatML models).
_RESPONSE = re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.DOTALL)


def render_prompt(tokenizer: "Tokenizer", messages: Sequence[Message], schemas: Sequence[Dict[str, Any]],
                  add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
    """The prompt text of ``messages`` with the tools' schemas rendered by the chat template (``tools=``); a
    template that leaves them out is an error (a model cannot call tools it was never shown)."""
    if not schemas:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             **template_kwargs)
    check_template_renders_tools(tokenizer, schemas, **template_kwargs)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=list(schemas),
                                         **template_kwargs)


def check_template_renders_tools(tokenizer: "Tokenizer", schemas: Sequence[Dict[str, Any]],
                                 **template_kwargs: Any) -> None:
    """Raise unless the chat template writes every tool's name into a prompt rendered with ``tools=``."""
    plain = tokenizer.apply_chat_template(_PROBE, add_generation_prompt=True, **template_kwargs)
    shown = tokenizer.apply_chat_template(_PROBE, add_generation_prompt=True, tools=list(schemas), **template_kwargs)
    names = [schema["function"]["name"] for schema in schemas]
    if shown == plain or not all(name in shown for name in names):
        raise MindRLHFError(f"the chat template of {tokenizer.source} does not render tools (tools=); use a model "
                            "whose template supports tool calling (Qwen2.5, Qwen3: the Hermes <tool_call> form) or a "
                            "ChatML one (<|im_start|> turns), which gets the Hermes form")


def _tool_messages(results: Sequence[ToolResult]) -> List[Message]:
    return [{"role": "tool", "name": r.name, "content": r.content} for r in results]


def tool_result_ids(tokenizer: "Tokenizer", results: Sequence[ToolResult], **template_kwargs: Any) -> List[int]:
    """The ids that follow the policy's end-of-turn token after a turn whose calls gave ``results``: the template's
    ``tool`` messages and the next assistant header (``add_generation_prompt``)."""
    if not results:
        raise MindRLHFError("tool_result_ids needs at least one result (a turn without calls appends nothing)")
    calls = [{"type": "function", "function": {"name": r.name or "tool", "arguments": {}}} for r in results]
    # A fixed conversation before the tool messages: how the policy's own turn would re-render does not matter,
    # since only the suffix after its end-of-turn token is taken.
    before = [{"role": "user", "content": "What is 6 * 7?"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = tokenizer.apply_chat_template(before, add_generation_prompt=False, tokenize=True, **template_kwargs)
    full = tokenizer.apply_chat_template(before + _tool_messages(results), add_generation_prompt=True, tokenize=True,
                                         **template_kwargs)
    stops = set(tokenizer.stop_token_ids)
    ends = [i for i, token in enumerate(prefix) if token in stops]
    if not ends:
        raise MindRLHFError(f"the chat template of {tokenizer.source} ends an assistant turn with no stop token "
                            f"(ids {sorted(stops)}); tool results cannot be appended where the policy stops")
    prefix = prefix[:ends[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise MindRLHFError(f"the chat template of {tokenizer.source} renders the assistant turn differently once a "
                            "tool message follows; its tool-result ids cannot be appended to the policy's tokens")
    suffix = full[len(prefix):]
    text = tokenizer.decode(suffix, skip_special_tokens=False)
    missing = [r.content for r in results if r.content not in text]
    if missing:
        raise MindRLHFError(f"the chat template of {tokenizer.source} does not render tool messages (result "
                            f"{missing[0][:40]!r} is not in its output); use a template with a 'tool' role")
    return suffix


def retokenization_drift(tokenizer: "Tokenizer", messages: Sequence[Message], ids: Sequence[int],
                         **template_kwargs: Any) -> Optional[str]:
    """None when rendering ``messages`` (a whole trajectory: prompt, assistant turns, tool messages) with the chat
    template and tokenising gives ``ids``; otherwise where they first differ, in one line (a report, since the trainer
    trains on the sampled ids, never on a re-rendering)."""
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True, **template_kwargs)
    ids = list(ids)
    stops = set(tokenizer.stop_token_ids)
    ends = [i for i, token in enumerate(rendered) if token in stops]
    if ids and ids[-1] in stops and ends:  # the policy stopped at its end-of-turn token; the template goes on ("\n")
        rendered = rendered[:ends[-1] + 1]
    if rendered == ids:
        return None
    first = next((i for i, (a, b) in enumerate(zip(rendered, ids)) if a != b), min(len(rendered), len(ids)))
    return (f"re-rendered trajectory differs from the sampled ids at token {first} of {len(ids)} (re-rendered "
            f"{tokenizer.decode(rendered[first:first + 8], skip_special_tokens=False)!r}, sampled "
            f"{tokenizer.decode(ids[first:first + 8], skip_special_tokens=False)!r})")


def trajectory_messages(tokenizer: "Tokenizer", ids: Sequence[int], tool_mask: Sequence[int]) -> List[Message]:
    """A multi-turn completion (``ids``; ``tool_mask`` 1 on the policy's tokens, 0 on the tools') as chat messages:
    each run of policy tokens an assistant turn (its calls as ``tool_calls``, ``assistant_message``), each run of tool
    tokens its ``tool`` messages (the Hermes ``<tool_response>`` blocks, named after the calls before them; a template
    that renders no such blocks gives one message with the run's text). For reading a rollout, never for training:
    the trainer trains on the ids."""
    stops = set(tokenizer.stop_token_ids)
    runs: List[Tuple[bool, List[int]]] = []  # (the policy's?, its ids)
    for i, token in enumerate(ids):
        if i == 0 or bool(tool_mask[i]) != bool(tool_mask[i - 1]):
            runs.append((bool(tool_mask[i]), []))
        runs[-1][1].append(int(token))
    messages: List[Message] = []
    for policy, run in runs:
        if policy:
            while run and run[-1] in stops:  # the end-of-turn token is the template's, not the content's
                run = run[:-1]
            messages.append(assistant_message(tokenizer.decode(run, skip_special_tokens=False)))
        else:
            text = tokenizer.decode(run, skip_special_tokens=False)
            calls = messages[-1].get("tool_calls", []) if messages else []
            names = [c["function"]["name"] for c in calls]
            contents = _RESPONSE.findall(text) or [text]
            messages += [{"role": "tool", **({"name": names[k]} if k < len(names) else {}), "content": content}
                         for k, content in enumerate(contents)]
    return messages
