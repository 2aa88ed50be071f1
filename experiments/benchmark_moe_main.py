r"""MoE forward / backward throughput against a dense model of equal active parameters, on one device.

  python experiments/benchmark_moe_main.py [--hidden=256 --layers=4 --experts=8 --top_k=2 \
      --expert_hidden=256 --batch=16 --seq=128 --repeats=5]

The MoE model routes each token to top_k of `experts` SwiGLU experts of hidden `expert_hidden`; the dense
model has one SwiGLU MLP of hidden top_k * expert_hidden, so both run the same multiply-adds per token in
their MLPs (the MoE adds its router, D x E per token). Both share every other shape (float32, unrolled
layers). For each model and MoE implementation (`ModelConfig.moe_impl`: blocked, ragged_dot; and the
capacity-factor variant at 1.25) it times, after a warm-up call, the jitted forward (hidden states) and
forward + backward (gradient of the summed log-probs plus the load-balance loss) on a [batch, seq] batch,
and prints one JSON line each: median seconds over --repeats and tokens/s, and the MoE/dense ratio.
"""
import dataclasses
import json
import statistics
import time

from absl import app, flags

_HIDDEN = flags.DEFINE_integer("hidden", 256, "Model dim.")
_LAYERS = flags.DEFINE_integer("layers", 4, "Layers (all sparse in the MoE model).")
_EXPERTS = flags.DEFINE_integer("experts", 8, "Experts per sparse layer.")
_TOP_K = flags.DEFINE_integer("top_k", 2, "Experts per token.")
_EXPERT_HIDDEN = flags.DEFINE_integer("expert_hidden", 256, "Hidden size of one expert.")
_BATCH = flags.DEFINE_integer("batch", 16, "Rows per batch.")
_SEQ = flags.DEFINE_integer("seq", 128, "Tokens per row.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per program (median reported).")


def _median_seconds(fn, *args) -> float:
  import jax  # pylint: disable=g-import-not-at-top
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(_REPEATS.value):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def measure(name: str, cfg) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.models import decoder  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.train.logprobs import token_logprobs  # pylint: disable=g-import-not-at-top
  params = decoder.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (_BATCH.value, _SEQ.value), 0, cfg.vocab_size)

  def loss(p, t):
    logp, aux = token_logprobs(cfg, p, t, with_aux=True)
    return jnp.sum(logp) + (aux["load_balance_loss"] if aux else 0.0)

  forward = jax.jit(lambda p, t: decoder.hidden(cfg, p, t))
  backward = jax.jit(jax.grad(loss))
  tokens_per_batch = _BATCH.value * _SEQ.value
  fwd, bwd = _median_seconds(forward, params, tokens), _median_seconds(backward, params, tokens)
  return {"model": name, "forward_s": round(fwd, 4), "forward_tokens_per_s": round(tokens_per_batch / fwd),
          "fwd_bwd_s": round(bwd, 4), "fwd_bwd_tokens_per_s": round(tokens_per_batch / bwd),
          "params": decoder.num_params(params)}


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.models.config import ModelConfig  # pylint: disable=g-import-not-at-top
  base = dict(vocab_size=4096, hidden_size=_HIDDEN.value, num_layers=_LAYERS.value, num_heads=4, num_kv_heads=2,
              max_position_embeddings=max(2048, _SEQ.value), scan_unroll=_LAYERS.value, logits_chunk=1 << 20)
  dense = ModelConfig(**base, intermediate_size=_TOP_K.value * _EXPERT_HIDDEN.value, model_type="qwen3",
                      qk_norm=True)
  moe = ModelConfig(**base, intermediate_size=_TOP_K.value * _EXPERT_HIDDEN.value, model_type="qwen3_moe",
                    qk_norm=True, num_experts=_EXPERTS.value, num_experts_per_tok=_TOP_K.value,
                    moe_intermediate_size=_EXPERT_HIDDEN.value, norm_topk_prob=True)
  print(json.dumps({"backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
                    "batch": _BATCH.value, "seq": _SEQ.value}), flush=True)
  ref = measure("dense", dense)
  print(json.dumps(ref), flush=True)
  for name, over in (("moe_blocked", dict(moe_impl="blocked")), ("moe_ragged_dot", dict(moe_impl="ragged_dot")),
                     ("moe_capacity_1.25", dict(moe_impl="blocked", moe_capacity_factor=1.25))):
    row = measure(name, dataclasses.replace(moe, **over))
    row["fwd_bwd_vs_dense"] = round(ref["fwd_bwd_s"] / row["fwd_bwd_s"], 3)
    row["forward_vs_dense"] = round(ref["forward_s"] / row["forward_s"], 3)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  app.run(main)
