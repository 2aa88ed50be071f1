"""Test-wide setup: 8 virtual CPU devices and a persistent compilation cache.

XLA reads its flags once, when the backend starts, so they are set here before anything imports jax.
"""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after XLA_FLAGS)

jax.config.update(
    "jax_compilation_cache_dir",
    os.environ.get("RLFJ_TEST_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rl_fusion_jax_tests")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
