"""``mindrlhf-data --sft --tools calculator``: GSM8K's ``<<a*b=c>>`` annotations as calculator calls and results, the
rows' checks against the calculator, and how ``mindrlhf-sft``'s reader trains them: the assistant turns only, on the
very ids ``generation.tool_loop`` produces at rollout (real Qwen2.5 tokenizer and chat template; no model)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from mindrlhf.data.gsm8k import sft_row
from mindrlhf.data.gsm8k_tools import NO_ANNOTATION_WARNING, calculator_box, calculator_turns, tool_sft_row
from mindrlhf.data.rlhf_data import write_sft_rows
from mindrlhf.data.text_rows import read_sft_rows
from mindrlhf.errors import MindRLHFError
from mindrlhf.generation.tool_loop import ToolLoop
from mindrlhf.resources import GSM8K_TRAIN_SAMPLE
from mindrlhf.rollout_tools import (
    ToolCall,
    ToolResult,
    assistant_message,
    parse_tool_calls,
    render_prompt,
    retokenization_drift,
    tool_result_ids,
)
from mindrlhf.tools.data_cli import main as data_main
from test_tool_loop import ScriptedSampler, _params

QUESTION = "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in all?"
ANSWER = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in "
          "April and May.\n#### 72")


def _call(expression: str) -> dict:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


def test_two_annotations_become_two_calls_and_the_calculators_results():
    box = calculator_box()
    assert calculator_turns(ANSWER, box) == [
        {"role": "assistant", "content": "Natalia sold 48/2 =", "tool_calls": [_call("48/2")]},
        {"role": "tool", "name": "calculator", "content": "24"},
        {"role": "assistant", "content": "24 clips in May.\nNatalia sold 48+24 =", "tool_calls": [_call("48+24")]},
        {"role": "tool", "name": "calculator", "content": "72"},
        {"role": "assistant", "content": "72 clips altogether in April and May.\n#### 72"}]
    row = tool_sft_row(QUESTION, ANSWER, box)
    assert row["prompt"] == sft_row(QUESTION, ANSWER)["prompt"]  # the plain rows' system prompt and question
    assert row["tools"] == box.schemas and row["tools"][0]["function"]["name"] == "calculator"
    # the tool message is the calculator's own answer, written as the rollout writes it; "= 24.0" agrees with 24
    assert calculator_turns("Half: <<48/2=24.0>>24.\n#### 24", box)[1]["content"] == "24"
    assert calculator_turns("0.1 and 0.2 make <<0.1+0.2=0.3>>0.3\n#### 0.3", box)[1]["content"] == "0.3"
    # no annotation: one assistant message, the plain row's completion
    assert calculator_turns("It is 7.\n#### 7", box) == sft_row(QUESTION, "It is 7.\n#### 7")["completion"]
    # each trained turn is a fixed point of the rollout's parse: assistant_message(rendered turn) gives it back
    text = 'Natalia sold 48/2 =\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "48/2"}}\n</tool_call>'
    assert assistant_message(text) == calculator_turns(ANSWER, box)[0]
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "48/2"})]
    with pytest.raises(MindRLHFError, match=r"^--tools search: GSM8K's annotations are calculator notes; use --tools "
                                            r"calculator$"):
        calculator_box(["search"])


def test_an_annotation_the_calculator_refuses_or_disagrees_with_skips_the_row_by_name(tmp_path, capsys):
    rows = [{"question": QUESTION, "answer": ANSWER},                                          # 1 two calls
            {"question": "A third of 10?", "answer": "10/3 = <<10/3=3.33>>3.33\n#### 3.33"},  # 2 rounded: disagrees
            {"question": "2 cubed?", "answer": "2^3 = <<2^3=8>>8\n#### 8"},                   # 3 refused
            {"question": "Half of 48?", "answer": "It is <<48/2>>24.\n#### 24"},              # 4 no '='
            {"question": "Twice 4?", "answer": "<<2*4=eight>>8\n#### 8"},                     # 5 no number
            {"question": "Seven?", "answer": "It is 7.\n#### 7"},                             # 6 no annotation
            {"question": "Sum?", "answer": "<<1+2=3>>3 and <<3+4=8>>8\n#### 8"}]              # 7 second wrong
    source = tmp_path / "gsm8k.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "sft.jsonl"
    assert data_main(["--sft", "--tools", "calculator", "--data_path", str(source), "--output", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "line 2: skipped (calculator disagrees with an annotation): annotation <<10/3=3.33>>: the calculator gives "
        "3.33333333333, the annotation 3.33",
        "line 3: skipped (calculator refused an annotation): annotation <<2^3=8>>: the calculator says "
        "'error: unsupported operator ^ (write powers as **); use + - * / // % **'",
        "line 4: skipped (unreadable calculator annotation): annotation <<48/2>> has no 'expression=result'",
        "line 5: skipped (unreadable calculator annotation): annotation <<2*4=eight>>: 'eight' after '=' is not a "
        "number",
        "line 7: skipped (calculator disagrees with an annotation): annotation <<3+4=8>>: the calculator gives 7, "
        "the annotation 8",
        f"{source}: 7 rows read, 2 written, 5 skipped (unreadable calculator annotation: 2, calculator refused an "
        f"annotation: 1, calculator disagrees with an annotation: 2) -> {out}; 1 rows: {NO_ANNOTATION_WARNING}"]
    assert json.loads(captured.out) == {"output": str(out), "rows": 2, "skipped": 5, "source": str(source)}
    box = calculator_box()
    written = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert written == [tool_sft_row(QUESTION, ANSWER, box), tool_sft_row("Seven?", "It is 7.\n#### 7", box)]
    assert written[1]["completion"] == [{"role": "assistant", "content": "It is 7.\n#### 7"}]  # kept, no call
    # --strict writes nothing when an annotation is skipped
    strict = tmp_path / "strict.jsonl"
    assert data_main(["--sft", "--tools", "calculator", "--data_path", str(source), "--output", str(strict),
                      "--strict"]) == 1
    assert "error: --strict: 5 rows skipped; nothing written" in capsys.readouterr().err and not strict.exists()


def _trained_runs(mask: np.ndarray):
    """(start, end) of each run of trained tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def test_the_loss_covers_the_assistant_turns_only_on_the_ids_the_rollout_produces(tok, tmp_path):
    box = calculator_box()
    row = tool_sft_row(QUESTION, ANSWER, box)
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    rows, report = read_sft_rows(path, tok, max_length=1024, show_progress=False)
    ids, mask = [int(t) for t in rows.input_ids[0]], rows.completion_mask[0]
    assert not report.skipped and not report.warnings

    # the rollout's pieces, built without the reader: the prompt with the tools, the policy's turns as the template
    # renders them, and the tool results as tool_loop appends them
    prompt = tok.encode(render_prompt(tok, row["prompt"], box.schemas))
    turns = [tok.encode(f'{text}\n<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{e}"}}}}\n'
                        "</tool_call><|im_end|>")
             for text, e in (("Natalia sold 48/2 =", "48/2"), ("24 clips in May.\nNatalia sold 48+24 =", "48+24"))]
    results = [tool_result_ids(tok, [ToolResult("calculator", value, False)]) for value in ("24", "72")]
    last = tok.encode("72 clips altogether in April and May.\n#### 72<|im_end|>")
    rollout = prompt + turns[0] + results[0] + turns[1] + results[1] + last
    assert ids == rollout + tok.encode("\n")  # the template's newline after the last turn, as in the plain rows
    expected = ([0] * len(prompt) + [1] * len(turns[0]) + [0] * len(results[0]) + [1] * len(turns[1])
                + [0] * len(results[1]) + [1] * (len(last) + 1))
    assert mask.tolist() == expected
    trained = [tok.decode(ids[a:b], skip_special_tokens=False) for a, b in _trained_runs(mask)]
    assert trained[:2] == [
        'Natalia sold 48/2 =\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "48/2"}}\n</tool_call>'
        "<|im_end|>",
        '24 clips in May.\nNatalia sold 48+24 =\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
        '"48+24"}}\n</tool_call><|im_end|>']
    assert "<tool_response>" not in "".join(trained)
    assert retokenization_drift(tok, row["prompt"] + row["completion"], rollout, tools=box.schemas) is None

    # the rollout itself: a policy that writes the trained turns, answered by ToolLoop with the calculator
    def policy(context):
        assert ids[:len(context)] == context
        end = next(i for i in range(len(context), len(ids)) if not mask[i] or i == len(ids) - 1)
        return tok.decode(ids[len(context):end + 1], skip_special_tokens=False)

    (completion,) = ToolLoop(box, tok, max_iterations=4).generate(ScriptedSampler(tok, policy), [prompt],
                                                                 _params(tok, max_tokens=400))
    assert prompt + completion.token_ids == rollout
    assert completion.tool_mask == mask[len(prompt):len(rollout)].tolist()
    assert (completion.tool_calls, completion.tool_failures, completion.turns) == (2, 0, 3)


def test_a_template_that_rerenders_earlier_turns_skips_the_row(tok, tmp_path, qwen_tokenizer_dir):
    from test_tool_render import SHOWS_TOOLS, _with_template

    # a template that marks the last message: the turn before a tool message renders differently in the whole
    template = (SHOWS_TOOLS + "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                "{% if loop.last %} (last){% endif %}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    odd = _with_template(tmp_path, qwen_tokenizer_dir, template)
    row = tool_sft_row(QUESTION, ANSWER, calculator_box())
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(sft_row(QUESTION, ANSWER)) + "\n", encoding="utf-8")
    rows, report = read_sft_rows(path, odd, max_length=1024, show_progress=False)
    assert rows.lines == [2]
    assert [(r.line, r.reason) for r in report.skipped] == [(1, "chat_template_error")]
    assert "renders the turns before a tool message differently" in report.skipped[0].detail


def test_cli_on_the_packaged_sample_writes_rows_the_sft_reader_trains(tok, tmp_path, capsys):
    out = tmp_path / "tool_sft.jsonl"
    assert data_main(["--sft", "--tools", "calculator", "--output", str(out)]) == 0
    captured = capsys.readouterr()
    source = [json.loads(line) for line in GSM8K_TRAIN_SAMPLE.read_text(encoding="utf-8").splitlines()]
    plain = sum("<<" not in r["answer"] for r in source)
    assert plain == 11  # the sample's answers without an annotation: kept, counted
    assert json.loads(captured.out) == {"output": str(out), "rows": len(source), "skipped": 0,
                                        "source": str(GSM8K_TRAIN_SAMPLE)}
    assert captured.err.strip().endswith(f"0 skipped -> {out}; {plain} rows: {NO_ANNOTATION_WARNING}")
    written = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    calls = sum(len(m.get("tool_calls", [])) for r in written for m in r["completion"])
    assert calls == sum(r["answer"].count("<<") for r in source) > len(source)
    # the final turn keeps the plain rows' answer form
    assert all(r["completion"][-1]["content"].endswith(f"#### {s['answer'].rsplit('#### ', 1)[1]}")
               for r, s in zip(written, source))
    # mindrlhf-sft's reader takes every row (a slice keeps the test short), each trained on assistant tokens only
    head = tmp_path / "head.jsonl"
    head.write_text("".join(json.dumps(r) + "\n" for r in written[:24]), encoding="utf-8")
    rows, report = read_sft_rows(head, tok, max_length=1024, strict=True, show_progress=False)
    assert len(rows) == 24 and not report.warnings
    for ids, mask in zip(rows.input_ids, rows.completion_mask):
        text = tok.decode([int(t) for t, m in zip(ids, mask) if m], skip_special_tokens=False)
        assert "<tool_response>" not in text and "<|im_start|>" not in text
    # the same rows written with write_sft_rows directly
    again = tmp_path / "again.jsonl"
    write_sft_rows(GSM8K_TRAIN_SAMPLE, again, tools=["calculator"])
    assert again.read_bytes() == out.read_bytes()
