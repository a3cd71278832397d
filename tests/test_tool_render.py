"""Tools through the chat template on the real Qwen2.5 tokenizer: the tools' schemas in the prompt as transformers
renders them, a turn's tool results as the exact ids the template renders for ``tool`` messages, a trajectory of
policy ids and tool ids that re-renders to the same ids, and the template problems that are refused or reported."""
from __future__ import annotations

import json
import shutil

import pytest

from mindrlhf.errors import MindRLHFError
from mindrlhf.rollout_tools import (
    assistant_message,
    check_template_renders_tools,
    render_prompt,
    retokenization_drift,
    tool_result_ids,
    trajectory_messages,
)
from mindrlhf.rollout_tools.builtin import calculator
from mindrlhf.tokenizer import Tokenizer

QUESTION = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 48 / 2 + 5?"}]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "48 / 2"}}\n</tool_call>'


def _with_template(tmp_path, qwen_tokenizer_dir, template: str) -> Tokenizer:
    folder = tmp_path / "tok"
    shutil.copytree(qwen_tokenizer_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return Tokenizer.from_dir(folder)


def test_the_prompt_shows_the_tools_as_transformers_renders_them(tok, calc, qwen_tokenizer_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))
    # transformers builds the schema from the function itself: the same text proves the same schema and rendering
    expected = hf.apply_chat_template(QUESTION, tools=[calculator], tokenize=False, add_generation_prompt=True)
    assert render_prompt(tok, QUESTION, calc.schemas) == expected
    assert '"name": "calculator"' in expected and expected.endswith("<|im_start|>assistant\n")
    assert render_prompt(tok, QUESTION, []) == hf.apply_chat_template(QUESTION, tokenize=False,
                                                                       add_generation_prompt=True)


def test_tool_result_ids_are_the_templates_tool_message(tok, calc):
    (result,) = calc.run(CALL)
    ids = tool_result_ids(tok, [result])
    assert tok.decode(ids, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n24\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert ids == tok.encode("\n<|im_start|>user\n<tool_response>\n24\n</tool_response><|im_end|>\n"
                              "<|im_start|>assistant\n")
    # two calls in one turn: one user block holding both responses, as Qwen2.5's template groups them
    results = calc.run(CALL + "\n" + CALL.replace("48 / 2", "24 + 5"))
    assert [r.content for r in results] == ["24", "29"]
    assert tok.decode(tool_result_ids(tok, results), skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n24\n</tool_response>\n<tool_response>\n29\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    # a failed call is a result the model reads like any other
    (failed,) = calc.run(CALL.replace("48 / 2", "48 / 0"))
    assert "<tool_response>\nerror: division by zero\n</tool_response>" in tok.decode(
        tool_result_ids(tok, [failed]), skip_special_tokens=False)


def test_a_trajectory_of_policy_and_tool_ids_re_renders_to_the_same_ids(tok, calc):
    prompt_ids = tok.encode(render_prompt(tok, QUESTION, calc.schemas))
    first_turn = "I will compute it.\n" + CALL
    first_ids = tok.encode(first_turn + "<|im_end|>")      # what the sampler returns: the turn and its stop token
    results = calc.run(first_turn)
    tool_ids = tool_result_ids(tok, results)
    final_turn = "48 / 2 = 24, and 24 + 5 = 29. The answer is 29."
    final_ids = tok.encode(final_turn + "<|im_end|>")
    trajectory = prompt_ids + first_ids + tool_ids + final_ids
    mask = [1] * len(first_ids) + [0] * len(tool_ids) + [1] * len(final_ids)
    assert len(mask) == len(trajectory) - len(prompt_ids) and sum(mask) == len(first_ids) + len(final_ids)
    messages = (QUESTION + [assistant_message(first_turn)]
                + [{"role": "tool", "name": r.name, "content": r.content} for r in results]
                + [assistant_message(final_turn)])
    assert messages[2] == {"role": "assistant", "content": "I will compute it.", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "48 / 2"}}}]}
    assert retokenization_drift(tok, messages, trajectory, tools=calc.schemas) is None
    # and back: the completion's ids and tool mask read as those messages (what a completions dump shows)
    assert trajectory_messages(tok, trajectory[len(prompt_ids):], mask) == messages[2:]


def test_a_turn_with_two_calls_reads_back_as_two_named_tool_messages(tok, calc):
    """Two calls in one turn (one failing) and a turn cut before its end: the messages name each result after its
    call, in order."""
    turn = CALL + "\n" + CALL.replace("48 / 2", "1 / 0")
    results = calc.run(turn)
    assert [r.failed for r in results] == [False, True]
    ids = tok.encode(turn + "<|im_end|>") + tool_result_ids(tok, results) + tok.encode("It is 24 and")
    mask = [1] * len(tok.encode(turn + "<|im_end|>")) + [0] * len(tool_result_ids(tok, results))
    mask += [1] * (len(ids) - len(mask))
    messages = trajectory_messages(tok, ids, mask)
    assert messages == [assistant_message(turn)] + [{"role": "tool", "name": "calculator", "content": r.content}
                                                    for r in results] + [{"role": "assistant",
                                                                          "content": "It is 24 and"}]


def test_a_policy_writing_its_call_otherwise_is_reported_not_hidden(tok, calc):
    turn = '<tool_call>{"name":"calculator","arguments":{"expression":"48 / 2"}}</tool_call>'  # no spaces, no \n
    prompt_ids = tok.encode(render_prompt(tok, QUESTION, calc.schemas))
    ids = prompt_ids + tok.encode(turn + "<|im_end|>") + tool_result_ids(tok, calc.run(turn))
    messages = QUESTION + [assistant_message(turn), {"role": "tool", "name": "calculator", "content": "24"}]
    drift = retokenization_drift(tok, messages + [{"role": "assistant", "content": "Done."}],
                                 ids + tok.encode("Done.<|im_end|>"), tools=calc.schemas)
    # the first difference: right after the <tool_call> token, where the template writes "\n" and the policy did not
    assert drift is not None and drift.startswith(f"re-rendered trajectory differs from the sampled ids at token "
                                                  f"{len(prompt_ids) + 1} of {len(ids) + 3} ")
    assert "\n" not in drift.split(" (")[0]


def test_a_malformed_call_stays_in_the_message_content():
    text = 'Let me see. <tool_call>{oops}</tool_call>'
    assert assistant_message(text) == {"role": "assistant", "content": text}


#: A ChatML template that renders no tools (SmolLM2's kind).
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
#: What the drop and re-render templates below write first: the tools (so they are the templates used).
SHOWS_TOOLS = "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"


def test_a_chatml_template_without_tools_uses_the_hermes_form(tmp_path, qwen_tokenizer_dir, calc):
    """The schemas go into the system turn, a call and its result render as the Qwen2.5 template writes them, the
    whole trajectory re-renders to its ids; a conversation without tools keeps the model's own template."""
    tok = _with_template(tmp_path, qwen_tokenizer_dir, CHATML)
    check_template_renders_tools(tok, calc.schemas)
    prompt = render_prompt(tok, QUESTION, calc.schemas)
    assert prompt.startswith("<|im_start|>system\nUse the calculator.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(calc.schemas[0]) + "\n</tools>" in prompt
    assert prompt.endswith("<|im_start|>user\nWhat is 48 / 2 + 5?<|im_end|>\n<|im_start|>assistant\n")
    results = calc.run(CALL)
    tool = tool_result_ids(tok, results)
    assert tok.decode(tool, skip_special_tokens=False) == ("\n<|im_start|>user\n<tool_response>\n24\n</tool_response>"
                                                           "<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(prompt) + tok.encode(CALL + "<|im_end|>") + tool + tok.encode("29<|im_end|>")
    messages = (QUESTION + [assistant_message(CALL)] + [{"role": "tool", "name": r.name, "content": r.content}
                                                        for r in results] + [{"role": "assistant", "content": "29"}])
    assert retokenization_drift(tok, messages, ids, tools=calc.schemas) is None
    completion = ids[len(tok.encode(prompt)):]
    mask = [1] * len(tok.encode(CALL + "<|im_end|>")) + [0] * len(tool) + [1] * len(tok.encode("29<|im_end|>"))
    assert trajectory_messages(tok, completion, mask) == messages[2:]
    assert tok.apply_chat_template(QUESTION) == ("<|im_start|>system\nUse the calculator.<|im_end|>\n<|im_start|>user\n"
                                                 "What is 48 / 2 + 5?<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_without_tools_is_refused(tmp_path, qwen_tokenizer_dir, calc):
    plain = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|endoftext|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")  # not ChatML: no Hermes form either
    tok = _with_template(tmp_path, qwen_tokenizer_dir, plain)
    with pytest.raises(MindRLHFError, match="does not render tools"):
        check_template_renders_tools(tok, calc.schemas)
    with pytest.raises(MindRLHFError, match="does not render tools"):
        render_prompt(tok, QUESTION, calc.schemas)
    assert render_prompt(tok, QUESTION, []).endswith("<|assistant|>\n")  # no tools: rendered as ever


def test_a_template_dropping_tool_messages_is_refused(tmp_path, qwen_tokenizer_dir, calc):
    drops = (SHOWS_TOOLS + "{% for m in messages %}{% if m.role != 'tool' %}<|im_start|>{{ m.role }}\n"
             "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = _with_template(tmp_path, qwen_tokenizer_dir, drops)
    with pytest.raises(MindRLHFError, match="does not render tool messages"):
        tool_result_ids(tok, calc.run(CALL))


def test_a_template_re_rendering_the_turn_before_a_tool_message_is_refused(tmp_path, qwen_tokenizer_dir, calc):
    # the assistant turn gains a marker once a tool message follows it: the policy's ids would no longer be a prefix
    shifty = (SHOWS_TOOLS + "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
              "{% if m.role == 'assistant' and not loop.last %} [called]{% endif %}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = _with_template(tmp_path, qwen_tokenizer_dir, shifty)
    with pytest.raises(MindRLHFError, match="renders the assistant turn differently once a tool message follows"):
        tool_result_ids(tok, calc.run(CALL))
    with pytest.raises(MindRLHFError, match="at least one result"):
        tool_result_ids(tok, [])


def test_the_runs_tools_are_shown_in_prompts_without_their_own(tmp_path, tok, calc):
    """A GRPO run with tools renders them into every conversational prompt row without a ``tools`` column and into
    the default data's prompts (as TRL renders its tools), and ``mindrlhf-data --tools`` into a prompt mindrecord;
    a row's own tools win."""
    from mindrlhf.configs.grpo_configs import GRPOConfig
    from mindrlhf.data.dataset import PromptDataset
    from mindrlhf.data.gsm8k import DEFAULT_SYSTEM_PROMPT, build_prompt
    from mindrlhf.data.rlhf_data import main as convert
    from mindrlhf.data.text_rows import read_prompt_rows
    from mindrlhf.resources import GSM8K_TRAIN_SAMPLE
    from mindrlhf.trainer.sampling import resolve_dataset, tool_schemas

    other = [{"type": "function", "function": {"name": "own_tool", "description": "A row's own.", "parameters": {}}}]
    rows = [{"prompt": QUESTION, "answer": "29"}, {"prompt": QUESTION, "answer": "29", "tools": other}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    read, _ = read_prompt_rows(path, tok, max_prompt_length=1024, show_progress=False, tools=calc.schemas)
    texts = [tok.decode(ids, skip_special_tokens=False) for ids in read.prompt_ids]
    assert texts == [render_prompt(tok, QUESTION, calc.schemas), render_prompt(tok, QUESTION, other)]
    plain, _ = read_prompt_rows(path, tok, max_prompt_length=1024, show_progress=False)
    assert tok.decode(plain.prompt_ids[0], skip_special_tokens=False) == tok.apply_chat_template(QUESTION)

    cfg = GRPOConfig.from_dict({"tools": ["calculator"], "max_prompt_length": 640,
                                "output_dir": str(tmp_path / "run")}, validate=False)
    assert tool_schemas(cfg) == calc.schemas
    default = resolve_dataset(cfg, tok)
    assert default.endswith("gsm8k_train_sample_tools.mindrecord")
    first = json.loads(GSM8K_TRAIN_SAMPLE.read_text(encoding="utf-8").splitlines()[0])["question"]
    data = PromptDataset(default, batch_size=1)
    shown = [int(t) for t in data.prompt_ids[0, :int(data.prompt_length[0])]]
    assert shown == tok.encode(build_prompt(first, tok, DEFAULT_SYSTEM_PROMPT, tools=calc.schemas))
    assert '"name": "calculator"' in tok.decode(shown, skip_special_tokens=False)

    out = tmp_path / "cli.mindrecord"
    assert convert(["--tokenizer_dir", str(tok.source), "--file_path", str(GSM8K_TRAIN_SAMPLE), "--output_path",
                    str(out), "--max_prompt_length", "640", "--tools", "calculator", "--no_progress"]) == 0
    cli = PromptDataset(str(out), batch_size=1)
    assert [int(t) for t in cli.prompt_ids[0, :int(cli.prompt_length[0])]] == shown
    assert convert(["--tokenizer_dir", str(tok.source), "--file_path", str(GSM8K_TRAIN_SAMPLE), "--output_path",
                    str(tmp_path / "bad.mindrecord"), "--tools", "calculatr"]) == 2
