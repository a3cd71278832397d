"""Data the package ships for its default run: a 512-question GSM8K training sample and a
256-question test sample (MIT, see GSM8K_LICENSE); the Hermes tool template for ChatML models."""
from pathlib import Path

GSM8K_TRAIN_SAMPLE = Path(__file__).resolve().parent / "gsm8k_train_sample.jsonl"
GSM8K_TEST_SAMPLE = Path(__file__).resolve().parent / "gsm8k_test_sample.jsonl"
#: The Hermes tool form for ChatML models whose chat template renders no tools (``Tokenizer.apply_chat_template``).
HERMES_CHATML_TOOLS = Path(__file__).resolve().parent / "hermes_chatml_tools.jinja"
