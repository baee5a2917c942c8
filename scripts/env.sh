#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment at .venv in the repository root.
# Idempotent: it reinstalls only when pyproject.toml changed since the last install.
# torch is pinned to 2.13.0 in pyproject.toml: on this machine kind that is the CPU build lying on disk.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.swarm-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "[env] installing swarm and its dependencies into $venv (first run takes a minute or two)" >&2
    "$venv/bin/pip" install --quiet --upgrade pip >&2 2>/dev/null || true
    # uv where it installs (PyPI has it): it resolves the same versions as pip and installs and compiles them in
    # parallel (torch 15 s against pip's 39, the rest 29 against 57, here); pip where uv is not to be had
    uv=""
    if "$venv/bin/pip" install --quiet uv >&2 2>/dev/null && [ -x "$venv/bin/uv" ]; then
        uv="$venv/bin/uv"
    fi
    # torch first and alone, so nothing else can pull a different (CUDA) build: the CPU build that lies in pip's
    # find-links folder on this machine kind, taken by uv from there only (no index), else by pip (which looks
    # there and is capped by the machine's constraints)
    links=()
    for link in ${PIP_FIND_LINKS:-}; do
        links+=(--find-links "$link")
    done
    if [ -z "$uv" ] || [ "${#links[@]}" -eq 0 ] || ! "$uv" pip install --quiet --python "$venv/bin/python" \
        --compile-bytecode --no-index --no-deps "${links[@]}" "torch==2.13.0" >&2 2>/dev/null; then
        "$venv/bin/pip" install --quiet "torch==2.13.0" >&2
    fi
    if [ -n "$uv" ]; then
        "$uv" pip install --quiet --python "$venv/bin/python" --compile-bytecode -e "$root[dev,bench]" >&2
    else
        "$venv/bin/pip" install --quiet -e "$root[dev,bench]" >&2
    fi
    echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
# The project's own modules' bytecode, written here once: where PYTHONDONTWRITEBYTECODE is set (this machine kind
# sets it), no import writes any, so every process compiled the modules it imports again (0.3-0.5 CPU-s for a peer
# or a trainer; the suite starts hundreds). An import still checks each file's timestamp and size against its
# source, so an edited module is compiled afresh (in memory) until this runs again; up-to-date files are skipped.
"$venv/bin/python" -m compileall -q -j 0 "$root/swarm" "$root/peers" "$root/compression" "$root/kernels" \
    "$root/proto" >/dev/null || true
