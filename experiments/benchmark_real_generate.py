r"""This project's generation engine on a real checkpoint, against transformers' `generate` in turns.

  python experiments/benchmark_real_generate.py --hf_path=DIR [--ref_python=/work/venv_ref/bin/python]

The engine (one device, ``--batch`` slots, one chunk of up to 32 decode steps at a time) decodes
``--batch`` one-turn chats rendered by DIR's chat template ("What is a + b? Answer with a number.", the
same as experiments/hf_generate_reference.py), each for exactly ``--new_tokens`` new tokens (forced
length), sampling at temperature 1. For each setting (dtype, ``scan_unroll``) it runs once to compile,
then ``--repeats`` times; one JSON line per setting with the median seconds, tokens/s and ms per decode
step. With ``--ref_python`` (a Python with torch and transformers, ``$RLFJ_REF_PYTHON``), transformers'
``generate`` runs next, in its own process (experiments/hf_generate_reference.py), on the same folder,
batch and length.

``--cast_once_ab``: each setting also runs with ``kv_cache.CAST_ONCE`` off (no ``models.decoding_params``:
the decode chunk's layers in a ``lax.scan``, each decode step slicing every kernel out of its stack and each
refill casting it again under 'bf16_matmul', as before), the two
engines taking turns in each repeat (each going first in every other repeat); the JSON lines then carry
``cast_once`` and whether both sampled the same tokens.
"""
import json
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags

import common

_HF_PATH = flags.DEFINE_string("hf_path", os.path.expanduser("~/.cache/rl_fusion_jax/models/smollm2-135m-instruct"),
                               "A Hugging Face folder with a chat template.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences decoded at once (engine slots).")
_NEW = flags.DEFINE_integer("new_tokens", 96, "New tokens per sequence.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per setting.")
_SETTINGS = flags.DEFINE_list("settings", ["float32:1", "float32:0", "bf16_matmul:1"],
                              "dtype:scan_unroll[:param_dtype] to time (param_dtype: the weights the engine "
                              "decodes from, as a generation copy would hold them; default the folder's).")
_CAST_ONCE_AB = flags.DEFINE_bool("cast_once_ab", False, "For each setting, also an engine built with "
                                   "kv_cache.CAST_ONCE off (no models.decoding_params), the two taking turns in "
                                   "each repeat.")
_REF_PYTHON = flags.DEFINE_string("ref_python", os.environ.get("RLFJ_REF_PYTHON", ""),
                                  "A Python with torch and transformers: also time transformers' generate.")


def main(argv):
  del argv
  import dataclasses

  import jax
  import numpy as np

  from rl_fusion_jax import models, shared_programs
  from rl_fusion_jax.config import MeshConfig
  from rl_fusion_jax.models import hf_io, kv_cache
  from rl_fusion_jax.rollout.decode import GenerateSpec
  from rl_fusion_jax.rollout.engine import Engine, EngineConfig, Request
  from rl_fusion_jax.rollout.sampling import SamplingParams
  from rl_fusion_jax.sharding.mesh import make_mesh
  from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
  from rl_fusion_jax.tokenizer import HFTokenizer

  cfg0, host = hf_io.load_hf(_HF_PATH.value)
  tokenizer = HFTokenizer.from_file(_HF_PATH.value)
  chats = [[{"role": "user", "content": f"What is {17 + i} + {25 + i}? Answer with a number."}]
           for i in range(_BATCH.value)]
  prompts = [np.asarray(tokenizer.encode_chat(c), np.int32) for c in chats]
  b, n = _BATCH.value, _NEW.value
  mesh = make_mesh(MeshConfig(data=-1), jax.devices()[:1])
  for setting in _SETTINGS.value:
    dtype, unroll, *rest = setting.split(":")
    param_dtype = rest[0] if rest else cfg0.param_dtype
    cfg = dataclasses.replace(cfg0, dtype=dtype, scan_unroll=int(unroll), param_dtype=param_dtype)
    shardings = param_shardings(models.abstract_params(cfg), models.param_logical_axes(cfg), mesh, TRAIN_RULES)
    params = jax.device_put(jax.tree.map(lambda x, d=param_dtype: np.asarray(x).astype(d), host), shardings)
    spec = GenerateSpec(cfg, SamplingParams(1.0), max(map(len, prompts)), n, -1)
    variants = (True, False) if _CAST_ONCE_AB.value else (True,)
    engines, times, tokens = {}, {v: [] for v in variants}, {}
    for rep in range(_REPEATS.value + 1):
      for cast_once in (variants if rep % 2 == 0 else variants[::-1]):   # who goes first alternates
        if rep == 0:   # each engine's programs traced with the flag as it is then
          kv_cache.CAST_ONCE = cast_once
          shared_programs.clear()
          engines[cast_once] = Engine(EngineConfig(spec, num_slots=b, chunk_steps=32, group_size=b), mesh,
                                      shardings)
        engine = engines[cast_once]
        engine.add([Request(rep * b + i, rep, p, n) for i, p in enumerate(prompts)])
        t0 = time.perf_counter()
        out = engine.run(params, 0).rollout
        times[cast_once].append(time.perf_counter() - t0)
        if rep == 0:
          tokens[cast_once] = np.asarray(out.tokens_bt)[np.argsort(out.sample_id_b)]
          kv_cache.CAST_ONCE = True
    for cast_once in variants:
      s = statistics.median(times[cast_once][1:])
      line = {"who": "rl_fusion_jax", "dtype": dtype, "scan_unroll": int(unroll), "param_dtype": param_dtype,
              "batch": b, "new_tokens": n, "first_s": round(times[cast_once][0], 1), "seconds": round(s, 3),
              "tokens_per_s": round(b * n / s, 1), "ms_per_step": round(1000 * s / n, 1)}
      if _CAST_ONCE_AB.value:
        line.update(cast_once=cast_once, same_tokens=bool(np.array_equal(tokens[True], tokens[False])))
      print(json.dumps(line), flush=True)
  if _REF_PYTHON.value:
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_generate_reference.py")
    subprocess.run([_REF_PYTHON.value, script, f"--hf_path={_HF_PATH.value}", f"--batch={b}",
                    f"--new_tokens={n}", f"--repeats={_REPEATS.value}"], check=True, stdout=sys.stdout)


if __name__ == "__main__":
  app.run(main)
