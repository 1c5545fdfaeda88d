#!/usr/bin/env bash
# RESULTS.md (b), the recipe after a fine-tune: for each key dim in KEYS (default: 4 per layer; its budget=0.0625
# cells came from before budgets were removed), `collab-vit convert` weight-only and with the recipe (256
# training images, default effort) into a hub folder, eval.py right after, then the 1-epoch fine-tune of
# configs/fmnist/finetune.yaml on the folder's architecture (`--model local-dir:`). Control: the source fine-tuned the
# same way (CONTROL=0 skips it). ~5 min per fine-tune.
#   SRC=runs/experiments/data_aware/model.safetensors DATA=data PYTHON=.venv/bin/python bash experiments/data_aware_finetune.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
py=${PYTHON:-python}
data=${DATA:-data}
src=${SRC:-runs/experiments/data_aware/model.safetensors}
out=${OUT:-$(dirname "$src")/finetune}
keys=${KEYS:-4}
mkdir -p "$out"
cal=(--calibration-dataset torch/fashion_mnist --calibration-data-dir "$data" --calibration-images 256)
arch=(patch_size=4 embed_dim=64 depth=4 num_heads=4 img_size=28 in_chans=1)
tune() {  # tune NAME MODEL CHECKPOINT [extra train.py flags]
    local name=$1 model=$2 checkpoint=$3
    shift 3
    [ -f "$out/ft_$name/model.safetensors" ] || "$py" train.py -c configs/fmnist/finetune.yaml --checkpoint "$checkpoint" \
        --model "$model" --data-dir "$data" --output "$out/ft_$name" --progress false "$@" > "$out/ft_$name.log" 2>&1
}
for key in $keys; do
    for v in weight recipe; do
        folder="$out/${v}_${key}"
        flags=()
        [ "$v" = recipe ] && flags=("${cal[@]}")
        [ -d "$folder" ] || "$py" -m collab_vit.cli convert --checkpoint "$src" --key-dim "$key" "${flags[@]}" \
            --out "$folder" > "$out/${v}_${key}.log" 2>&1
        "$py" eval.py --checkpoint "$folder" --dataset torch/fashion_mnist --data-dir "$data" --workers 0 \
            --cpu-threads 1 --output "$out/eval_${v}_${key}.json" > "$out/eval_${v}_${key}.log" 2>&1
        tune "${v}_${key}" "local-dir:$folder" "$folder" --model-kwargs img_size=28 in_chans=1
    done
done
[ "${CONTROL:-1}" = 0 ] || tune source deit_tiny_patch16_224 "$src" --model-kwargs "${arch[@]}"
echo "done: $out"
