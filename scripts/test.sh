#!/usr/bin/env bash
# The test suite in the project's environment (the active virtualenv, else .venv, created if
# missing): installs the test extra, then runs pytest. Extra arguments go to pytest, e.g.
# `bash scripts/test.sh -m "not slow"` or `bash scripts/test.sh tests/test_rewards.py`.
#
# With no arguments (what CI runs) the suite runs in two parts: the single-process tests two at a
# time (pytest-xdist, whole files to a worker so module fixtures are built once, in tests/conftest.py's
# order: the files with the most slow tests first; a tiny-model test keeps about one core busy: graph
# compiles, Python), then the msrun launches, again two test files at a time (alone, a launch of tiny models
# leaves a third of the cores idle: process starts, cluster setup, ranks waiting for each other or for a
# dead worker's timeout; the dead-worker tests' collective timeouts leave room for the sharing), with the vLLM
# tests (their engines, in processes of their own, start while the launches wait).
# MINDRLHF_TEST_WORKERS sets how many run at once in both parts (1: one after another).
set -euo pipefail
# shellcheck source=scripts/_env.sh
. "$(dirname "$0")/_env.sh" test
if [ $# -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
# vLLM's CPU build goes into .venv-vllm (its own environment: scripts/install_vllm.sh) while the single-process
# tests run; the vLLM tests run with the second part and wait for it (tests/test_vllm.py reads install.rc).
mkdir -p .venv-vllm
rm -f .venv-vllm/install.rc
touch .venv-vllm/install.pending
( bash scripts/install_vllm.sh .venv-vllm > .venv-vllm/install.out 2>&1; echo $? > .venv-vllm/install.rc
  rm -f .venv-vllm/install.pending ) &
workers="${MINDRLHF_TEST_WORKERS:-2}"
rc=0
parallel=()
if [ "$workers" -gt 1 ]; then
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
python -m pytest -q -m "not msrun and not vllm" "${parallel[@]}" || rc=$?
python -m pytest -q -m "msrun or vllm" "${parallel[@]}" || rc=$((rc ? rc : $?))
exit "$rc"
