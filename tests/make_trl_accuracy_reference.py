"""Record how TRL 1.16's ``accuracy_reward`` (math-verify) scores tricky answers, for tests/test_rewards.py.

Runs in TRL's virtualenv (bench/.venv-trl or $MINDRLHF_TRL_VENV, with math-verify installed); it never imports
mindrlhf. Each case is a (solution, completion) pair whose solution is mathematics rather than a plain number:
equivalent fractions and roots, LaTeX spellings, sets, intervals, expressions, units, percentages, infinity.

    bench/.venv-trl/bin/python tests/make_trl_accuracy_reference.py [--output tests/data/trl_accuracy_reference.json]
"""
from __future__ import annotations

import argparse
import json
from importlib.metadata import version
from pathlib import Path

import trl
from trl.rewards import accuracy_reward

HERE = Path(__file__).resolve().parent

#: (name, solution, completion): the solution as a MATH-style dataset writes it ($...$ or a boxed worked answer).
CASES = [
    ("fraction", r"$\frac{1}{3}$", r"The answer is \boxed{\frac{1}{3}}."),
    ("equivalent_fraction", r"$\frac{1}{3}$", r"So we get \boxed{\frac{2}{6}}"),
    ("wrong_fraction", r"$\frac{1}{3}$", r"\boxed{\frac{1}{2}}"),
    ("dfrac", r"$\dfrac{3}{4}$", r"\boxed{\frac34}"),
    ("root", r"$\sqrt{2}$", r"Hence \boxed{\sqrt{2}}"),
    ("root_simplified", r"$2\sqrt{2}$", r"\boxed{\sqrt{8}}"),
    ("root_decimal", r"$\sqrt{2}$", r"\boxed{1.414}"),
    ("root_fraction", r"The answer is $\boxed{\frac{\sqrt{3}}{2}}$.", r"\boxed{\frac{\sqrt3}{2}}"),
    ("pi", r"$2\pi$", r"\boxed{2\pi}"),
    ("pi_product", r"$2\pi$", r"\boxed{\pi \cdot 2}"),
    ("set", r"$\{1,2,3\}$", r"\boxed{\{3,2,1\}}"),
    ("wrong_set", r"$\{1,2,3\}$", r"\boxed{\{1,2\}}"),
    ("open_interval", r"$(1, 2)$", r"\boxed{(1,2)}"),
    ("closed_interval", r"$[0,1]$", r"\boxed{[0, 1]}"),
    ("interval_ends", r"$[0,1]$", r"\boxed{(0, 1)}"),
    ("polynomial", r"$x^2+2x+1$", r"\boxed{(x+1)^2}"),
    ("wrong_polynomial", r"$x^2+2x+1$", r"\boxed{(x-1)^2}"),
    ("equation", r"$x=2$", r"\boxed{x = 2}"),
    ("exponential", r"$e^{2}$", r"\boxed{e^2}"),
    ("percent", r"$10\%$", r"\boxed{10\%}"),
    ("percent_decimal", r"$10\%$", r"\boxed{0.1}"),
    ("infinity", r"$\infty$", r"\boxed{\infty}"),
    ("inline_math", r"$\sqrt{3}$", r"The side is $\sqrt{3}$."),
    ("no_latex", r"$\sqrt{3}$", r"The side is the square root of three."),
    ("boxed_text_units", r"$\sqrt{5}$", r"\boxed{\sqrt{5}\text{ cm}}"),
    ("negative_root", r"$-\sqrt{2}$", r"\boxed{-\sqrt{2}}"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(HERE / "data" / "trl_accuracy_reference.json"),
                        help="where to write the JSON reference")
    out = Path(parser.parse_args().output)
    scores = accuracy_reward([[{"role": "assistant", "content": c}] for _, _, c in CASES], [s for _, s, _ in CASES])
    cases = {name: {"solution": sol, "completion": text, "trl": score}
             for (name, sol, text), score in zip(CASES, scores)}
    out.write_text(json.dumps({"trl": trl.__version__, "math_verify": version("math-verify"), "cases": cases},
                              indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main()
