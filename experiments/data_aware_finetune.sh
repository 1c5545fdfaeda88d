#!/usr/bin/env bash
# RESULTS.md (b), data-aware conversion: key dim 4 by `collab-vit convert` (weight-only; the recipe with 256 training
# images, --effort fast: closed forms only, and the default: the better one refined), eval.py right after, then the
# 1-epoch fine-tune of
# configs/fmnist/finetune.yaml; control: the source fine-tuned the same way. ~10 min on 2 busy cores.
#   DATA=data PYTHON=.venv/bin/python bash experiments/data_aware_finetune.sh
#   SRC=runs/experiments/data_aware_e15/model.safetensors bash experiments/data_aware_finetune.sh   # another source
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
py=${PYTHON:-python}
data=${DATA:-data}
src=${SRC:-runs/experiments/data_aware/model.safetensors}
out=$(dirname "$src")/finetune
mkdir -p "$out"
cal=(--calibration-dataset torch/fashion_mnist --calibration-data-dir "$data" --calibration-images 256)
arch=(patch_size=4 embed_dim=64 depth=4 num_heads=4 img_size=28 in_chans=1)
"$py" -m collab_vit.cli convert --checkpoint "$src" --key-dim 4 --out "$out/weight.safetensors" > "$out/weight.log" 2>&1
"$py" -m collab_vit.cli convert --checkpoint "$src" --key-dim 4 "${cal[@]}" --effort fast \
    --out "$out/data.safetensors" > "$out/data.log" 2>&1
"$py" -m collab_vit.cli convert --checkpoint "$src" --key-dim 4 "${cal[@]}" --out "$out/refine.safetensors" \
    > "$out/refine.log" 2>&1
for v in weight data refine; do
    "$py" eval.py --checkpoint "$out/$v.safetensors" --dataset torch/fashion_mnist --data-dir "$data" --workers 0 \
        --cpu-threads 1 --output "$out/eval_$v.json" > "$out/eval_$v.log" 2>&1
    "$py" train.py -c configs/fmnist/finetune.yaml --checkpoint "$out/$v.safetensors" --model collab_deit_tiny_patch16_224 \
        --model-kwargs "${arch[@]}" key_dim=4 --data-dir "$data" --output "$out/ft_$v" --progress false > "$out/ft_$v.log" 2>&1
done
"$py" train.py -c configs/fmnist/finetune.yaml --checkpoint "$src" --model deit_tiny_patch16_224 \
    --model-kwargs "${arch[@]}" --data-dir "$data" --output "$out/ft_source" --progress false > "$out/ft_source.log" 2>&1
echo "done: $out"
