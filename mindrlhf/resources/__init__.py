"""Data the package ships for its default run: a 512-question GSM8K training sample and a
256-question test sample (MIT, see GSM8K_LICENSE)."""
from pathlib import Path

GSM8K_TRAIN_SAMPLE = Path(__file__).resolve().parent / "gsm8k_train_sample.jsonl"
GSM8K_TEST_SAMPLE = Path(__file__).resolve().parent / "gsm8k_test_sample.jsonl"
