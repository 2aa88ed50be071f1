r"""Token sampling over a vocabulary: ``rollout.sampling`` against the jax functions it replaces.

  python experiments/benchmark_sampling.py --rows=32 --vocab=49152

On random logits [rows, vocab] (float32, std 3), one device, the machine's default XLA flags, prints one
JSON line per operation with the median milliseconds of --repeats jitted calls, and whether the two forms
gave the same tokens: the Gumbel-max draw (``sampling.categorical`` against
``jax.vmap(jax.random.categorical)``, the same keys), the greedy argmax (``sampling.first_argmax`` against
``jnp.argmax``), and the Gumbel noise alone (``jax.random.gumbel``, what any exact draw computes).
"""
import json

from absl import app, flags

import common

_ROWS = flags.DEFINE_integer("rows", 32, "Rows (sequences decoded at once).")
_VOCAB = flags.DEFINE_integer("vocab", 49152, "Vocabulary size (SmolLM2's by default).")
_REPEATS = flags.DEFINE_integer("repeats", 50, "Timed calls per form.")


def _median_ms(fn, *args) -> float:
  return 1000 * common.median_seconds(fn, *args, repeats=_REPEATS.value)


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from rl_fusion_jax.rollout import sampling  # pylint: disable=g-import-not-at-top

  b, v = _ROWS.value, _VOCAB.value
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((b, v)).astype(np.float32) * 3)
  keys = sampling.sample_keys(jax.random.key(0), jnp.arange(b), jnp.zeros((b,), jnp.int32))
  forms = {
      "draw": (jax.jit(sampling.categorical), jax.jit(jax.vmap(jax.random.categorical)), (keys, logits)),
      "greedy": (jax.jit(sampling.first_argmax), jax.jit(lambda x: jnp.argmax(x, axis=-1)), (logits,)),
  }
  for name, (ours, theirs, args) in forms.items():
    same = bool(np.array_equal(np.asarray(ours(*args)), np.asarray(theirs(*args))))
    print(json.dumps({"op": name, "rows": b, "vocab": v, "ours_ms": round(_median_ms(ours, *args), 3),
                      "jax_ms": round(_median_ms(theirs, *args), 3), "same_tokens": same}), flush=True)
  noise = jax.jit(jax.vmap(lambda k: jax.random.gumbel(k, (v,))))
  print(json.dumps({"op": "gumbel_noise_alone", "rows": b, "vocab": v, "ms": round(_median_ms(noise, keys), 3)}),
        flush=True)


if __name__ == "__main__":
  app.run(main)
