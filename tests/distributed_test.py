"""The multi-process pieces that need no second process: settings, ownership, metric reduction, splits.

The runs across processes are in tests/multihost_run_test.py (marker ``multihost``).
"""
import dataclasses

import numpy as np
import pytest

from rl_fusion_jax import distributed
from rl_fusion_jax.distributed import DistributedConfig
from rl_fusion_jax.orchestration import processes
from rl_fusion_jax.orchestration.processes import Share
from rl_fusion_jax.errors import ConfigError
from rl_fusion_jax.fusion.deployment import split_devices
from rl_fusion_jax.queue.distqueue import DistQueue, FieldSpec


@pytest.fixture
def no_env(monkeypatch):
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID",
               "SLURM_NTASKS", "OMPI_MCA_orte_hnp_uri", "TPU_WORKER_HOSTNAMES"):
    monkeypatch.delenv(name, raising=False)
  return monkeypatch


def test_settings_come_from_flags_then_environment(no_env):
  assert not DistributedConfig.from_flags().wanted          # nothing set: one process, no runtime
  no_env.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  no_env.setenv("JAX_NUM_PROCESSES", "4")
  no_env.setenv("JAX_PROCESS_ID", "3")
  cfg = DistributedConfig.from_flags()
  assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id, cfg.wanted) == ("10.0.0.1:1234", 4, 3, True)
  cfg = DistributedConfig.from_flags("h:1", 2, 0)            # flags win
  assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id) == ("h:1", 2, 0)
  no_env.setenv("JAX_PROCESS_ID", "three")
  with pytest.raises(ConfigError, match="JAX_PROCESS_ID='three' is not an integer"):
    DistributedConfig.from_flags()


def test_one_process_joins_the_runtime_only_with_a_coordinator(no_env):
  assert not DistributedConfig(num_processes=1).wanted
  assert DistributedConfig("127.0.0.1:1", 1, 0).wanted      # the same collectives as a multi-process run
  no_env.setenv("SLURM_JOB_ID", "7")
  no_env.setenv("SLURM_NTASKS", "2")
  assert DistributedConfig().wanted                          # the scheduler's settings, JAX detects them
  no_env.setenv("SLURM_NTASKS", "1")
  assert not DistributedConfig().wanted


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_processes=2, process_id=2), "--process_id=2 is not below --num_processes=2"),
    (dict(num_processes=-1), "--num_processes=-1"),
    (dict(process_id=-3), "--process_id=-3"),
    (dict(coordinator_address="localhost"), "expected host:port"),
    (dict(timeout_s=0), "--distributed_timeout_s"),
])
def test_bad_settings_name_the_flag(kwargs, message):
  with pytest.raises(ConfigError, match=message):
    DistributedConfig(**kwargs)


def test_missing_settings_are_named_before_anything_starts(no_env):
  with pytest.raises(ConfigError, match=r"needs --coordinator_address \(or JAX_COORDINATOR_ADDRESS\)"):
    distributed.initialize(DistributedConfig(num_processes=2, process_id=0))


def test_every_sample_has_exactly_one_owner():
  ids = np.arange(37) + 5                                    # 5..41
  owners = np.stack([Share(p, 3).owns(ids) for p in range(3)])
  assert (owners.sum(axis=0) == 1).all()
  assert Share().owns(ids).all()
  assert [int(o.sum()) for o in owners] == [12, 12, 13]     # 6..39, 7..40, 5..41 in steps of 3


def test_run_metrics_sum_queue_counters_average_shares_and_take_the_slowest_time():
  records = [{"loss": 0.5, "queue/bytes_read_tokens": 100.0, "queue/token_rows_bytes": 8.0,
              "verify/early_frac": 1.0, "train_s": 2.0, "switch/to_train/seconds": 0.1, "nan": float("nan"),
              "queue/link_bytes/host_to_device_this_host": 700.0},
             {"loss": 0.5, "queue/bytes_read_tokens": 60.0, "queue/token_rows_bytes": 4.0,
              "verify/early_frac": 0.5, "train_s": 3.0, "switch/to_train/seconds": 0.3, "nan": float("nan"),
              "queue/link_bytes/host_to_device_this_host": 900.0}]
  out, differing = processes.combine(records)
  assert out["queue/bytes_read_tokens"] == 160.0 and out["queue/token_rows_bytes"] == 12.0
  # What each host put itself: the busiest host's, and the sum over the hosts.
  assert out["queue/link_bytes/host_to_device_this_host"] == 900.0
  assert out["queue/link_bytes/host_to_device_hosts_sum"] == 1600.0
  assert out["verify/early_frac"] == 0.75
  assert out["train_s"] == 3.0 and out["switch/to_train/seconds"] == 0.3
  assert out["loss"] == 0.5 and differing == []
  records[1]["loss"] = 0.25
  out, differing = processes.combine(records)
  assert out["loss"] == 0.5 and differing == ["loss"]


def test_one_process_passes_everything_through():
  arrays = [np.arange(4.0), np.array([True, False, True, False])]
  got = processes.gather_rows("t", Share(), np.arange(4), arrays)
  assert all(np.array_equal(a, b) for a, b in zip(arrays, got))
  assert processes.reduce_metrics(1, {"a": 1.0}) == {"a": 1.0}
  distributed.check_same_config({"a": 1})                  # one process: nothing to compare
  assert distributed.on_writer("x", lambda: 3) == 3


def test_config_hash_changes_with_any_field():
  a = {"run": {"seed": 0, "steps": 3}, "model": {"dtype": "float32"}}
  b = {"model": {"dtype": "float32"}, "run": {"steps": 3, "seed": 0}}
  assert distributed.config_hash(a) == distributed.config_hash(b)
  assert distributed.config_hash(a) != distributed.config_hash({**a, "run": {"seed": 1, "steps": 3}})


@dataclasses.dataclass(frozen=True)
class _Device:
  id: int
  process_index: int


def test_sub_meshes_take_a_share_of_every_process():
  devices = [_Device(i, i // 4) for i in range(8)]            # 2 processes x 4 devices
  first, rest = split_devices(devices, 4, "config.fusion.rollout_device_fraction")
  assert [d.id for d in first] == [0, 1, 4, 5] and [d.id for d in rest] == [2, 3, 6, 7]
  first, rest = split_devices(devices, 4, "f", per_process=False)   # one process per side
  assert [d.id for d in first] == [0, 1, 2, 3]
  with pytest.raises(ValueError, match="config.fusion.aux_devices: 1 of 8 devices do not split evenly"):
    split_devices(devices, 1, "config.fusion.aux_devices")
  one = [_Device(i, 0) for i in range(4)]
  assert [d.id for d in split_devices(one, 1, "f")[0]] == [0]


def test_uncounted_queue_reads_leave_the_byte_counters():
  """A replica's copy of rows another process fed: consumed (freed), not counted as this process's."""
  queue = DistQueue([FieldSpec("tokens", np.int32, True), FieldSpec("n", np.int32, False)], capacity=4)
  queue.register_consumer("train", ["tokens", "n"])
  queue.put(np.arange(4), tokens=[np.arange(k + 1) for k in range(4)], n=np.arange(4))
  queue.read("train", [0, 1])
  counted = queue.stats()
  batch = queue.read("train", [2, 3], counted=False)
  assert batch.tokens["tokens"].lengths.tolist() == [3, 4]
  after = queue.stats()
  assert after["bytes_read_tokens"] == counted["bytes_read_tokens"] == 3 * 4
  assert after["depth"] == 0 and after["evicted"] == 4
