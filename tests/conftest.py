"""Test-wide setup: 8 virtual CPU devices and a persistent compilation cache.

XLA reads its flags once, when the backend starts, so they are set here before anything imports jax.
"""
import os

# 8 virtual devices share 2 cores, so one device's part of a collective can wait for CPU time behind the
# others' work (XLA warns after 20 s: "This thread has been waiting ... may be stuck"; seen under load,
# resolving). XLA:CPU aborts the whole process when a wait passes its terminate timeout (40 s by
# default): 600 s keeps a slow rendezvous a slow test. (A real deadlock, as seen in loop runs with a rolled
# layer scan, rl_fusion_jax/testing/experiments.py, then costs 600 s before the same abort.)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_cpu_collective_call_terminate_timeout_seconds=600").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after XLA_FLAGS)

jax.config.update(
    "jax_compilation_cache_dir",
    os.environ.get("RLFJ_TEST_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rl_fusion_jax_tests")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
