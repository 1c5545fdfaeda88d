#!/usr/bin/env bash
# The whole suite on another torch release: bash scripts/test-torch.sh TORCH TORCHVISION [pytest args ...]
# e.g. bash scripts/test-torch.sh 2.9.1 0.24.1   (the floors in pyproject.toml; README "Supported versions")
#
# Creates (or reuses) .venv-torch-TORCH/, installs that torch and torchvision first, then the package with its test
# extras (and timm==$TIMM when TIMM is set), and fails if that install brought another torch (pyproject.toml
# states a floor, never a pin). Releases other than the newest come from the registry as CUDA builds of several
# GB; the suite runs on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
    echo "usage: bash scripts/test-torch.sh TORCH_VERSION TORCHVISION_VERSION [pytest args ...]" >&2
    exit 2
fi
torch_version=$1 vision_version=$2
shift 2
venv=".venv-torch-$torch_version"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "torch==$torch_version" "torchvision==$vision_version"
"${pip[@]}" -e ".[test]" ${TIMM:+"timm==$TIMM"}
installed=$("$venv/bin/python" -c 'import torch, torchvision; print(torch.__version__.split("+")[0], torchvision.__version__.split("+")[0])')
if [ "$installed" != "$torch_version $vision_version" ]; then
    echo "error: installing the package replaced torch $torch_version / torchvision $vision_version by $installed" >&2
    exit 1
fi
bash tests/slurm/cluster.sh install || echo "note: Slurm could not be installed here; tests/test_slurm.py will skip"
echo "under test: torch/torchvision $installed, timm $("$venv/bin/python" -c 'import timm; print(timm.__version__)') ($(date -u +%F))"
exec "$venv/bin/python" -m pytest "$@"
