"""GSM8K answers as tool-using conversations (``mindrlhf-data --sft --tools calculator``): each ``<<48/2=24>>``
calculator annotation becomes a Hermes call of the built-in ``calculator`` and the calculator's own result, so a small
model learns the call format before GRPO with ``tools: [calculator]``.

``Natalia sold 48/2 = <<48/2=24>>24 clips in May.\\n... #### 72`` becomes the completion

* assistant ``Natalia sold 48/2 =`` with ``tool_calls`` ``calculator({"expression": "48/2"})``,
* tool ``24`` (what ``ToolBox`` answers at rollout, the same message ``rollout_tools.render`` renders),
* assistant ``24 clips in May. ...``, and so on for every annotation; the last assistant turn ends with the
  ``#### <number>`` line of the plain ``--sft`` rows (``gsm8k.sft_row``).

Each assistant turn's text is stripped (as ``hermes.assistant_message`` writes a parsed turn back), so the trained
turn re-renders to itself. The row keeps ``sft_row``'s prompt (the style's system prompt and the question) and
carries the tools' schemas as its ``tools`` column, which the chat template renders into the prompt exactly as
GRPO's prompt rows with ``tools`` are rendered.

**Row form.** One TRL conversational prompt/completion row per question, the whole tool-using answer as the
completion. ``text_rows.read_sft_rows`` trains only a completion's assistant turns: a ``tool`` message's tokens, from
after the assistant's end-of-turn token through the next assistant header, are out of the loss (TRL's
``assistant_only_loss``), which are exactly the ids ``generation.tool_loop`` appends with ``tool_mask`` 0 at rollout.
One row per question (rather than one per assistant turn, the ``tool_caller`` test fixture's form) trains each
prompt and turn once.

**Checks.** The calculator answers every annotation's expression; a row is skipped, never altered, when an
annotation has no ``=`` or no number after it (``bad_annotation``), when the calculator refuses the expression
(``calculator_refused``) or when its result differs from the annotation's as numbers (``calculator_disagrees``;
``24`` and ``24.0`` agree). An answer with no annotation is kept as the plain row with the ``tools`` column and no
call (the model also sees the tools offered and unused); the converter counts those rows in its summary.
"""
from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Sequence

from mindrlhf.data.gsm8k import DEFAULT_PROMPT_STYLE, sft_row
from mindrlhf.errors import MindRLHFError
from mindrlhf.rollout_tools import ToolBox, ToolCall

#: The tools ``mindrlhf-data --sft --tools`` can write calls of: GSM8K's annotations are calculator notes.
SFT_TOOLS = ("calculator",)
#: The converter's summary warning for rows kept without a call.
NO_ANNOTATION_WARNING = "no calculator annotation: kept as plain answers (tools offered, no call)"
_NOTE = re.compile(r"<<([^<>]*)>>")


class AnnotationError(Exception):
    """A GSM8K answer whose annotations cannot become calls: ``reason`` (a ``report.REASONS`` key) and ``detail``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def calculator_box(tools: Sequence[str] = SFT_TOOLS) -> ToolBox:
    """The ``ToolBox`` whose answers and schemas the rows hold (no time limit: the calculator bounds its numbers)."""
    unknown = [name for name in tools if name not in SFT_TOOLS]
    if unknown or not tools:
        raise MindRLHFError(f"--tools {' '.join(tools) or '(none)'}: GSM8K's annotations are calculator notes; use "
                            f"--tools {' '.join(SFT_TOOLS)}")
    return ToolBox(list(tools), timeout=0)


def _number(text: str):
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def calculator_turns(answer: str, box: ToolBox) -> List[Dict[str, Any]]:
    """The completion messages of a GSM8K ``answer`` (see the module docstring): assistant turns with one
    ``calculator`` call each, the calculator's ``tool`` messages, and the final assistant turn; one assistant message
    when the answer has no annotation. Raises ``AnnotationError`` for an annotation that cannot be checked or that the
    calculator does not confirm."""
    messages: List[Dict[str, Any]] = []
    last = 0
    for match in _NOTE.finditer(answer):
        note = match.group(0)
        expression, equals, written = match.group(1).rpartition("=")
        expression = expression.strip()
        if not equals or not expression:
            raise AnnotationError("bad_annotation", f"annotation {note} has no 'expression=result'")
        expected = _number(written)
        if expected is None:
            raise AnnotationError("bad_annotation", f"annotation {note}: {written.strip()!r} after '=' is not a "
                                                    "number")
        result = box.call(ToolCall("calculator", {"expression": expression}))
        if result.failed:
            raise AnnotationError("calculator_refused", f"annotation {note}: the calculator says "
                                                        f"{result.content!r}")
        got = _number(result.content)
        if got is None or not math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12):
            raise AnnotationError("calculator_disagrees", f"annotation {note}: the calculator gives "
                                                          f"{result.content}, the annotation {written.strip()}")
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
        messages.append({"role": "assistant", "content": answer[last:match.start()].strip(), "tool_calls": [call]})
        messages.append({"role": "tool", "name": result.name, "content": result.content})
        last = match.end()
    messages.append({"role": "assistant", "content": answer[last:].strip()})
    return messages


def tool_sft_row(question: str, answer: str, box: ToolBox, style: str = DEFAULT_PROMPT_STYLE) -> Dict[str, Any]:
    """One conversational SFT row with tool calls: ``sft_row``'s prompt, ``calculator_turns`` as the completion and
    the tools' schemas as ``tools`` (raises ``AnnotationError`` as ``calculator_turns`` does)."""
    row = sft_row(question, answer, style)
    return {"prompt": row["prompt"], "completion": calculator_turns(answer, box), "tools": box.schemas}

