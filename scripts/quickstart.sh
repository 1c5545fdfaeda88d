#!/usr/bin/env bash
# The main job: set up (or reuse) .venv (shared with scripts/test.sh; installs only what changed: scripts/venv.sh),
# train a small collaborative DeiT on scikit-learn's handwritten digits (written as a PNG ImageFolder under
# data/digits on first use) on the CPU, then evaluate the exported weights.
# Extra arguments go to train.py (any config key, e.g. --epochs 10).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/venv.sh
source scripts/venv.sh
# shellcheck disable=SC2119  # no extras: the package alone (the script's arguments go to train.py)
venv_install
run="runs/quickstart-$(date +%Y%m%d-%H%M%S)"
.venv/bin/python train.py -c configs/quickstart.yaml --output "$run" "$@"
.venv/bin/python eval.py --checkpoint "$run/model.safetensors" --data-dir data/digits --workers 0 --output "$run/eval.json"
