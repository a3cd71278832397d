"""Parity of mindrlhf.tokenizer.Tokenizer with transformers' fast tokenizers (the reference)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mindrlhf.errors import MindRLHFError
from mindrlhf.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TRICKY = [
    "",
    "Hello world",
    " leading space and trailing  ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "text<|endoftext|>more<|im_end|><|im_start|>",
    "<tool_call>{\"name\": \"f\"}</tool_call>",
    "1234567890 12,345.67 $1,000,000 3/4 -42 1e10",
    "tabs\t\tand   spaces     and\n\n\nnewlines \r\n end",
    "   \n  \t  ",
    "I'm sure they'll say it's fine, DON'T you think? We've seen it.",
    "Café naïve résumé – “quotes” ‘single’ … ½ ÷ × ≤ ≥ √π",
    "e\u0301 vs \u00e9, Ａ Ｂ Ｃ (fullwidth), ﬁ ligature",
    "你好，世界！这是一个测试。日本語のテキスト 한국어 Россия",
    "emoji 😀👍🏽 👨‍👩‍👧 and zero\u200bwidth",
    "x<<16-3-4=9>>9 #### 18",
]


@pytest.fixture(scope="module")
def ours(qwen_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(qwen_tokenizer_dir)


@pytest.fixture(scope="module")
def hf(qwen_tokenizer_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))


@pytest.fixture(scope="module")
def gsm8k_test(data_dir: Path) -> list:
    with open(data_dir / "gsm8k" / "test.jsonl", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _hf_ids(hf, text: str, add_special_tokens: bool = False) -> list:
    return hf(text, add_special_tokens=add_special_tokens)["input_ids"]


def test_all_gsm8k_test_questions_match_transformers(ours, hf, gsm8k_test):
    questions = [row["question"] for row in gsm8k_test]
    assert len(questions) == 1319
    ours_ids = ours.encode_batch(questions)
    for i, question in enumerate(questions):
        assert ours_ids[i] == _hf_ids(hf, question), f"question {i}: {question!r}"
        assert ours.encode(question) == ours_ids[i]


def test_gsm8k_answers_match_transformers(ours, hf, gsm8k_test):
    answers = [row["answer"] for row in gsm8k_test[:300]]
    assert ours.encode_batch(answers) == [_hf_ids(hf, a) for a in answers]


@pytest.mark.parametrize("text", TRICKY)
def test_tricky_strings_match_transformers(ours, hf, text):
    assert ours.encode(text) == _hf_ids(hf, text)
    assert ours.encode(text, add_special_tokens=True) == _hf_ids(hf, text, add_special_tokens=True)
    ids = ours.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_special_tokens_are_single_ids(ours):
    for token, token_id in [("<|endoftext|>", 151643), ("<|im_start|>", 151644), ("<|im_end|>", 151645)]:
        assert ours.encode(token) == [token_id]
        assert ours.token_to_id(token) == token_id


def test_from_files_equals_from_dir(ours, qwen_tokenizer_dir, gsm8k_test):
    d = qwen_tokenizer_dir
    other = Tokenizer.from_files(d / "vocab.json", d / "merges.txt", d / "tokenizer_config.json")
    texts = [row["question"] for row in gsm8k_test[:200]] + TRICKY
    assert other.encode_batch(texts) == ours.encode_batch(texts)
    assert len(other) == len(ours)


def test_properties_match_transformers(ours, hf):
    assert ours.vocab_size == len(ours) == len(hf) == 151665
    assert ours.eos_token_id == hf.eos_token_id == 151645
    assert ours.pad_token_id == hf.pad_token_id == 151643
    assert ours.bos_token_id is None and hf.bos_token_id is None
    assert ours.stop_token_ids == [151645, 151643]


def test_decode_round_trip(ours, hf, gsm8k_test):
    for row in gsm8k_test[:300]:
        for text in (row["question"], row["answer"]):
            ids = ours.encode(text)
            assert ours.decode(ids) == text
    batch = [ours.encode(t) for t in TRICKY[:5]]
    assert ours.batch_decode(batch) == hf.batch_decode(batch, skip_special_tokens=True)


CONVERSATIONS = [
    [{"role": "system", "content": "Reason step by step."}, {"role": "user", "content": "What is 2+3?"}],
    [{"role": "user", "content": "Janet’s ducks lay 16 eggs per day. How many?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think> greet </think> <answer> Hello </answer>"},
        {"role": "user", "content": "And 12*12?\n\nThanks."},
    ],
    [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "second", "tool_calls": None},
        {"role": "user", "content": "  spaced  \n"},
        {"role": "assistant", "content": "last"},
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["system+user", "user", "multi-turn", "none-values"])
def test_chat_template_matches_transformers(ours, hf, conversation, add_generation_prompt):
    expected = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected
    ids = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == _hf_ids(hf, expected)


def test_chat_template_with_tools_matches_transformers(ours, hf):
    tools = [{"type": "function", "function": {"name": "add", "description": "Add <a> & b",
                                                "parameters": {"type": "object", "properties": {}}}}]
    conversation = [{"role": "user", "content": "add 1 and 2"}]
    expected = hf.apply_chat_template(conversation, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(conversation, tools=tools) == expected


def test_missing_files_raise_one_line_errors(tmp_path, qwen_tokenizer_dir):
    with pytest.raises(MindRLHFError, match="vocab.json not found") as err:
        Tokenizer.from_files(tmp_path / "vocab.json", qwen_tokenizer_dir / "merges.txt")
    assert "\n" not in str(err.value)
    with pytest.raises(MindRLHFError, match="merges.txt not found"):
        Tokenizer.from_files(qwen_tokenizer_dir / "vocab.json", tmp_path / "merges.txt")
    with pytest.raises(MindRLHFError, match="neither tokenizer.json nor vocab.json"):
        Tokenizer.from_dir(tmp_path)


def test_missing_chat_template_error_names_file_and_fix(tmp_path, qwen_tokenizer_dir):
    config = json.loads((qwen_tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    del config["chat_template"]
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(qwen_tokenizer_dir / name, folder / name)
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = Tokenizer.from_dir(folder)
    assert not tok.has_chat_template
    assert tok.encode("<|im_end|>") == [151645]  # special tokens still come from the config
    with pytest.raises(MindRLHFError, match="tokenizer_config.json.*no chat_template") as err:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "\n" not in str(err.value)


def test_raise_exception_helper_and_bos_eos_variables(tmp_path, qwen_tokenizer_dir):
    import jinja2

    config = json.loads((qwen_tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "[{{ bos_token }}|{{ eos_token }}]{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    d = qwen_tokenizer_dir
    tok = Tokenizer.from_files(d / "vocab.json", d / "merges.txt", path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[|<|im_end|>]x"  # bos is null
    with pytest.raises(jinja2.TemplateError, match="user first"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


# ---------------------------------------------------------------- GPT2-style (SmolLM2 family)
GPT2_CONFIG = {
    "tokenizer_class": "GPT2Tokenizer",
    "add_prefix_space": False,
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|im_end|>",
    "unk_token": "<|endoftext|>",
    "added_tokens_decoder": {
        "0": {"content": "<|endoftext|>", "lstrip": False, "normalized": False, "rstrip": False,
              "single_word": False, "special": True},
        "1": {"content": "<|im_start|>", "lstrip": False, "normalized": False, "rstrip": False,
              "single_word": False, "special": True},
        "2": {"content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False,
              "single_word": False, "special": True},
    },
    "chat_template": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
}


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, gsm8k_test) -> Path:
    """A small byte-level BPE trained on GSM8K text, saved as vocab.json + merges.txt + config."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator([r["question"] + "\n" + r["answer"] for r in gsm8k_test[:600]], trainer)
    folder = tmp_path_factory.mktemp("gpt2_tok")
    backend.model.save(str(folder))
    (folder / "tokenizer_config.json").write_text(json.dumps(GPT2_CONFIG), encoding="utf-8")
    return folder


def test_gpt2_style_matches_transformers(gpt2_dir, gsm8k_test, tmp_path):
    ours = Tokenizer.from_dir(gpt2_dir)
    for name in ("vocab.json", "merges.txt"):  # the bare class on the same two files (no config)
        shutil.copy(gpt2_dir / name, tmp_path / name)
    fast = transformers.GPT2TokenizerFast.from_pretrained(str(tmp_path))
    auto = transformers.AutoTokenizer.from_pretrained(str(gpt2_dir))
    texts = [r["question"] for r in gsm8k_test] + TRICKY
    ids = ours.encode_batch(texts)
    assert ids == [auto(t, add_special_tokens=False)["input_ids"] for t in texts]
    # The bare class (no config) knows only the <|endoftext|> special token; compare on plain text.
    plain = [t for t in texts if "<|" not in t]
    assert ours.encode_batch(plain) == [fast(t, add_special_tokens=False)["input_ids"] for t in plain]
    assert len(ours) == len(auto)
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (auto.eos_token_id, auto.bos_token_id,
                                                                          auto.pad_token_id)
    assert ours.stop_token_ids == [2, 0]
    conversation = [{"role": "user", "content": "What is 7*6?"}]
    assert ours.apply_chat_template(conversation) == auto.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True)
    for i in range(0, len(texts), 97):
        assert ours.decode(ids[i]) == auto.decode(ids[i], skip_special_tokens=True)


def test_gpt2_class_selects_gpt2_regex(gpt2_dir):
    """Digit runs split differently under the GPT-2 and Qwen regexes: the class must pick the pipeline."""
    gpt2 = Tokenizer.from_dir(gpt2_dir)
    qwen_config = dict(GPT2_CONFIG, tokenizer_class="Qwen2Tokenizer")
    path = gpt2_dir / "qwen_style_config.json"
    path.write_text(json.dumps(qwen_config), encoding="utf-8")
    qwen = Tokenizer.from_files(gpt2_dir / "vocab.json", gpt2_dir / "merges.txt", path)
    text = "She paid 12345 dollars"
    assert gpt2.encode(text) != qwen.encode(text)
    assert all(len(gpt2.decode([i])) == 1 for i in qwen.encode("12345"))  # Qwen: one digit per token


def test_tokenizer_json_is_used_verbatim(gpt2_dir, tmp_path, gsm8k_test):
    ours_files = Tokenizer.from_dir(gpt2_dir)
    folder = tmp_path / "with_json"
    folder.mkdir()
    ours_files.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(GPT2_CONFIG), encoding="utf-8")
    ours_json = Tokenizer.from_dir(folder)
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    texts = [r["question"] for r in gsm8k_test[:200]] + TRICKY
    expected = [reference(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert ours_json.encode_batch(texts) == expected == ours_files.encode_batch(texts)


def test_vocab_and_merges_without_config_match_bare_qwen2_class(qwen_tokenizer_dir, tmp_path):
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(qwen_tokenizer_dir / name, tmp_path / name)
    ours = Tokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    reference = transformers.Qwen2TokenizerFast.from_pretrained(str(tmp_path))
    for text in TRICKY:
        assert ours.encode(text) == _hf_ids(reference, text), text
    assert len(ours) == len(reference)
    assert ours.eos_token_id == reference.eos_token_id == 151643  # class default <|endoftext|>


def test_unknown_class_falls_back_to_qwen2_with_warning(gpt2_dir, tmp_path, caplog):
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps(dict(GPT2_CONFIG, tokenizer_class="MysteryTokenizer")), encoding="utf-8")
    with caplog.at_level("WARNING", logger="mindrlhf.tokenizer"):
        tok = Tokenizer.from_files(gpt2_dir / "vocab.json", gpt2_dir / "merges.txt", path)
    assert "MysteryTokenizer" in caplog.text
    qwen_path = tmp_path / "qwen_config.json"
    qwen_path.write_text(json.dumps(dict(GPT2_CONFIG, tokenizer_class="Qwen2Tokenizer")), encoding="utf-8")
    qwen = Tokenizer.from_files(gpt2_dir / "vocab.json", gpt2_dir / "merges.txt", qwen_path)
    assert tok.encode("paid 12345 dollars") == qwen.encode("paid 12345 dollars")


def test_add_bos_token_matches_transformers(gpt2_dir, tmp_path):
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(gpt2_dir / name, tmp_path / name)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(GPT2_CONFIG, add_bos_token=True)), encoding="utf-8")
    ours = Tokenizer.from_dir(tmp_path)
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ["Hello 12 world", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text, add_special_tokens=True) == auto(text)["input_ids"]
        assert ours.encode(text, add_special_tokens=True)[0] == ours.bos_token_id == 1
        assert ours.encode(text) == auto(text, add_special_tokens=False)["input_ids"]
