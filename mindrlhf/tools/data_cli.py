"""``mindrlhf-data``: the data commands behind one name.

``mindrlhf-data --pairs ...`` builds GSM8K preference pairs from a model's own wrong answers
(``evaluation.gsm8k_pairs``); ``mindrlhf-data --sft ...`` writes GSM8K as conversational SFT rows
(``data.gsm8k.sft_rows_main``); anything else is ``rlhf_data.py``'s GSM8K → prompt mindrecord conversion.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``mindrlhf-data``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--pairs" in args:
        from mindrlhf.evaluation.gsm8k_pairs import main as pairs

        args.remove("--pairs")
        return pairs(args)
    if "--sft" in args:
        from mindrlhf.data.gsm8k import sft_rows_main

        args.remove("--sft")
        return sft_rows_main(args)
    from mindrlhf.data.rlhf_data import main as convert

    return convert(args)


if __name__ == "__main__":
    sys.exit(main())
