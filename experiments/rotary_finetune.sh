#!/usr/bin/env bash
# RESULTS.md, "Rotary models", after the 1-epoch fine-tune (configs/fmnist/finetune.yaml) of the models
# experiments/rotary_post_hoc.py kept with --save K: for each K in KEYS, select (its state dict in the weight folder's
# architecture), weight and recipe (their hub folders); the top-1 on the 10k test set after the epoch is in
# $RUNS/ft_<variant>_k<K>/log.jsonl.
# Control: the source (SRC) fine-tuned the same way (CONTROL=0 skips it).
#   RUNS=runs/rotary_post_hoc SRC=runs/sources/rope_long-s0/model.safetensors DATA=data KEYS="16" \
#       PYTHON=.venv/bin/python bash experiments/rotary_finetune.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
py=${PYTHON:-python}
runs=${RUNS:-runs/rotary_post_hoc}
for key in ${KEYS:-16}; do
    for v in select weight recipe; do
        checkpoint="$runs/${v}_k$key"
        [ "$v" = select ] && checkpoint="$runs/select_k$key.pth"
        [ -f "$runs/ft_${v}_k$key/model.safetensors" ] || "$py" train.py -c configs/fmnist/finetune.yaml \
            --model "local-dir:$runs/weight_k$key" --checkpoint "$checkpoint" --model-kwargs img_size=28 in_chans=1 \
            --data-dir "${DATA:-data}" --output "$runs/ft_${v}_k$key" --progress false > "$runs/ft_${v}_k$key.log" 2>&1
        echo "$v k$key: $(tail -1 "$runs/ft_${v}_k$key/log.jsonl")"
    done
done
if [ "${CONTROL:-1}" != 0 ]; then
    [ -f "$runs/ft_source/model.safetensors" ] || "$py" train.py -c configs/fmnist/finetune.yaml \
        --model vit_small_patch16_rope_224 --checkpoint "${SRC:-runs/sources/rope_long-s0/model.safetensors}" \
        --model-kwargs patch_size=4 embed_dim=64 depth=4 num_heads=4 img_size=28 in_chans=1 \
        --data-dir "${DATA:-data}" --output "$runs/ft_source" --progress false > "$runs/ft_source.log" 2>&1
    echo "source: $(tail -1 "$runs/ft_source/log.jsonl")"
fi
