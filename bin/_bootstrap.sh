# Sourced by bin/serve and bin/test: find Python >= 3.12, create .venv/, install
# the pinned requirements when they changed. Idempotent and quiet when up to date.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
REQS="${MEMSITE_REQUIREMENTS:-requirements.txt}"

is_py312() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }

find_python() {
  local c
  for c in "${MEMSITE_PYTHON:-}" python3.13 python3.12 python3 python \
           "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3 /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9]; do
    [ -n "$c" ] || continue
    command -v "$c" >/dev/null 2>&1 || [ -x "$c" ] || continue
    if is_py312 "$c"; then command -v "$c" 2>/dev/null || echo "$c"; return 0; fi
  done
  return 1
}

if [ ! -x "$VENV/bin/python" ] || ! is_py312 "$VENV/bin/python"; then
  PY="$(find_python)" || {
    echo "memsite needs Python >= 3.12 and none was found." >&2
    echo "Install it (e.g. 'apt-get install python3.12 python3.12-venv' or 'pyenv install 3.12')," >&2
    echo "or point MEMSITE_PYTHON at the interpreter." >&2
    exit 1
  }
  rm -rf "$VENV"
  echo "memsite: creating .venv with $PY" >&2
  "$PY" -m venv "$VENV"
fi

stamp="$VENV/.installed-${REQS%.txt}"
want="$(cat "$ROOT"/requirements*.txt | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "memsite: installing $REQS into .venv (first run takes a few minutes)" >&2
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip >/dev/null
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$ROOT/$REQS"
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
