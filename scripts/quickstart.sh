#!/usr/bin/env bash
# Set up (or reuse) .venv with the package, then run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e .
exec .venv/bin/collab-vit demo "$@"
