#!/usr/bin/env bash
# The GPU checks of the RL Fusion and generation-engine issues, as one prepared script for a lent GPU
# machine (one H200; its image has jax with CUDA, flax, optax, orbax, chex, absl, safetensors, tokenizers,
# but not ml-collections: carry its wheel in .whl/ as the device README says). Run from the repo root:
#
#   bash experiments/gpu_checks.sh 2>&1 | tee $OUT/gpu_checks.log
#
# Prints JSON lines: the phase switch of a Qwen2-0.5B-shaped model with and without optimizer offload
# (seconds, bytes, peak device memory from the allocator), decode tokens/s against the HBM roofline, and
# the tiny-grpo step time, and a GRPO step at Qwen2.5-1.5B shapes (random init, float32 master weights,
# bfloat16 compute, remat full, chunked log-probs): step time, train MFU against the H200's bfloat16 peak,
# and 1.5B decode tokens/s against the HBM roofline; MoE forward / backward tokens/s against a dense model
# of equal active parameters (ragged_dot, the non-CPU default, and the blocked and capacity variants).
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
for offload in true false; do
  python3 experiments/benchmark_switch_main.py --model=0.5b --mesh=1,1,1 --cpu_devices=1 --bucket_mb=64 \
    --offload_optimizer=$offload --repeats=3
done
python3 experiments/benchmark_generate_main.py --preset=0.5b --dtype=bfloat16 --slots=256 --samples=1024 \
  --max_new_tokens=512 --median_len=64 --chunk=64 --prefill_rows=64 --repeats=1
python3 experiments/benchmark_main.py --config=experiments/configs/tiny_grpo.py --steps=10
python3 experiments/benchmark_main.py --config=experiments/configs/tiny_grpo.py --steps=5 --peak_tflops=989 \
  --config.model.vocab_size=151936 --config.model.hidden_size=1536 --config.model.num_layers=28 \
  --config.model.num_heads=12 --config.model.num_kv_heads=2 --config.model.intermediate_size=8960 \
  --config.model.tie_word_embeddings=True --config.model.dtype=bfloat16 --config.model.remat=full \
  --config.model.scan_unroll=1 --config.model.logits_chunk=1024
python3 experiments/benchmark_generate_main.py --preset=1.5b --dtype=bfloat16 --slots=256 --samples=1024 \
  --max_new_tokens=512 --median_len=64 --chunk=64 --prefill_rows=64 --repeats=1
python3 experiments/benchmark_moe_main.py --hidden=1024 --layers=8 --experts=16 --top_k=2 --expert_hidden=1024 \
  --batch=32 --seq=512 --repeats=5
