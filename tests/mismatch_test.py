"""Sampler/trainer agreement: the behaviour log-probs the engine records against the trainer's log-probs
under the same parameters (``mismatch/*``, synchronous step, before the update), per precision."""
import pytest

from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax.orchestration import loop
from rl_fusion_jax.testing.experiments import tiny

# The bound per model.dtype on the largest |difference| (random init, so log-probs of ~ -log(vocab)).
# Measured on a 2-core AMD EPYC: float32 4.8e-7 (1 ulp), bf16_matmul 4.8e-7, bfloat16 1.9e-4. Not 0: the
# decode step's products run on [slots, D] rows and the trainer's on [rows x T, D], and XLA:CPU picks its
# kernels by shape (a [1, 128] x [128, 384] product differs from the same row inside [48, 128] x [128, 384]
# by ~1e-5), so the two agree to rounding, not to the bit. The bounds leave room for other CPUs' kernels.
BOUNDS = {"float32": 1e-5, "bf16_matmul": 1e-4, "bfloat16": 1e-2}


@pytest.mark.parametrize("dtype", sorted(BOUNDS))
def test_behaviour_logprobs_match_the_trainers_to_the_precisions_bound(tmp_path, dtype):
  loop.run(tiny(**{"rollout.num_prompts": 8, "run.steps": 1, "warmup.steps": 0, "model.dtype": dtype}),
           str(tmp_path / "run"))
  row = [r for r in metrics_lib.read_metrics(str(tmp_path / "run")) if "loss" in r][0]
  assert row["mismatch/tokens_frac"] == 1.0          # synchronous: every token is of the current version
  assert 0 <= row["mismatch/logp_abs_mean"] <= row["mismatch/logp_abs_max"] <= BOUNDS[dtype]
  assert abs(row["mismatch/kl"]) <= BOUNDS[dtype] ** 2 * 10
