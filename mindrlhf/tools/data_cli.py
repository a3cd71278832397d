"""``mindrlhf-data``: the data commands behind one name.

``mindrlhf-data --pairs ...`` builds GSM8K preference pairs from a model's own wrong answers
(``evaluation.gsm8k_pairs``); ``mindrlhf-data --sft ...`` writes GSM8K as conversational SFT rows
(``data.rlhf_data.sft_rows_main``); anything else is ``rlhf_data.py``'s GSM8K → prompt mindrecord conversion.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

MODES = {"--pairs": "build GSM8K preference pairs (ReaL's prompt/pos_answers/neg_answers jsonl, for mindrlhf-rm "
                    "and mindrlhf-dpo) from a model's own wrong answers; options: mindrlhf-data --pairs --help",
         "--sft": "write GSM8K as conversational SFT rows (prompt/completion jsonl, for mindrlhf-sft); options: "
                  "mindrlhf-data --sft --help"}


def build_parser() -> argparse.ArgumentParser:
    """The help of ``mindrlhf-data``: the prompt-mindrecord conversion's options and the other commands."""
    from mindrlhf.data.rlhf_data import build_parser as conversion_parser

    parser = conversion_parser()
    parser.prog = "mindrlhf-data"
    parser.description = ("Without --pairs / --sft: " + (parser.description or "")[:1].lower()
                          + (parser.description or "")[1:])
    commands = parser.add_argument_group("other commands (given first, each with its own --help)")
    for flag, text in MODES.items():
        commands.add_argument(flag, action="store_true", help=text)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``mindrlhf-data``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--pairs" in args:
        from mindrlhf.evaluation.gsm8k_pairs import main as pairs

        args.remove("--pairs")
        return pairs(args)
    if "--sft" in args:
        from mindrlhf.data.rlhf_data import sft_rows_main

        args.remove("--sft")
        return sft_rows_main(args)
    if "-h" in args or "--help" in args:
        build_parser().print_help()
        return 0
    from mindrlhf.data.rlhf_data import main as convert

    return convert(args)


if __name__ == "__main__":
    sys.exit(main())
