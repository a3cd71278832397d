#!/usr/bin/env bash
# The test suite in the project's environment (the active virtualenv, else .venv, created if
# missing): installs the test extra, then runs pytest. Extra arguments go to pytest, e.g.
# `bash scripts/test.sh -m "not slow"` or `bash scripts/test.sh tests/test_rewards.py`.
set -euo pipefail
# shellcheck source=scripts/_env.sh
. "$(dirname "$0")/_env.sh" test
python -m pytest -q "$@"
