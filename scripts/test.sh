#!/usr/bin/env bash
# Set up (or reuse) .venv with the package and its test extras (the .venv scripts/quickstart.sh uses too; installs
# only what changed: scripts/venv.sh), install the local Slurm test cluster's Debian packages when possible (root +
# apt-get; otherwise the Slurm tests say they skip and why), run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/venv.sh
source scripts/venv.sh
venv_install test
bash tests/slurm/cluster.sh install || echo "note: Slurm could not be installed here; tests/test_slurm.py will skip"
# two workers on the 2-core machine, each test module on one worker (its fixtures built once; Slurm tests together);
# the slowest tests listed at the end (docs/testing.md's run log keeps the suite under 12 minutes)
exec .venv/bin/python -m pytest -n 2 --dist loadscope --durations=12 "$@"
