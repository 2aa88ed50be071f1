"""Start-up shared by the experiment binaries: CPU device count, compilation cache, typed config.

``setup_jax`` must run before anything touches a JAX backend: XLA reads its flags once.
"""
from __future__ import annotations

import logging as std_logging
import os

from absl import logging


class _DropLibraryInfo(std_logging.Filter):
  """Keeps INFO lines of this project; libraries (orbax logs every save step) only from WARNING up."""

  def filter(self, record):
    return record.levelno >= std_logging.WARNING or "/site-packages/" not in record.pathname


def quiet_libraries() -> None:
  for handler in std_logging.getLogger().handlers + [logging.get_absl_handler()]:
    handler.addFilter(_DropLibraryInfo())


def setup_jax(cpu_devices: int, cache_dir: str) -> None:
  """One virtual CPU device per core by default (more only add overhead on CPU); persistent cache."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    count = cpu_devices or os.cpu_count() or 1
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
  quiet_libraries()
  import jax  # pylint: disable=g-import-not-at-top
  if cache_dir:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  logging.info("JAX %s on %s: %d devices", jax.__version__, jax.devices()[0].platform, jax.device_count())
