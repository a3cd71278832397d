#!/usr/bin/env bash
# One command from a fresh machine to a GRPO run: virtualenv (.venv unless one is active), install,
# train the embedded default (SmolLM2-135M-Instruct on a packaged GSM8K sample, CPU). Extra
# arguments go to mindrlhf-grpo, e.g. `bash scripts/quickstart.sh --max_steps 5 --beta 0.04`.
set -euo pipefail
# shellcheck source=scripts/_env.sh
. "$(dirname "$0")/_env.sh" ""
mindrlhf-grpo "$@"
# The other commands (mindrlhf-sft, -rm, -dpo, -ppo, -eval, -data, ...) live in the environment's bin/.
echo "mindrlhf's commands (mindrlhf-sft, mindrlhf-eval, mindrlhf-data, ...) are in $VIRTUAL_ENV/bin: in a new shell," \
     "run 'source $VIRTUAL_ENV/bin/activate' first"
