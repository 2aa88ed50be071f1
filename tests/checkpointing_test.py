"""Checkpointer: fingerprints catch corruption, shapes are named, non-finite trees are never written."""
import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rl_fusion_jax import checkpointing
from rl_fusion_jax.errors import CheckpointError
from rl_fusion_jax.sharding.mesh import make_mesh
from rl_fusion_jax.config import MeshConfig


def _tree(scale=1.0):
  return {"w": jnp.arange(12, dtype=jnp.float32).reshape(4, 3) * scale,
          "b": jnp.ones((4,), jnp.bfloat16), "n": jnp.int32(7)}


def _targets(tree, sharding=None):
  sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return {"params": checkpointing.abstract_like(tree, jax.tree.map(lambda _: sharding, tree))}


def test_fingerprint_by_hand():
  # [1.0, 2.0] float32 bits: 0x3F800000, 0x40000000; weights 1 and 3 -> 0x3F800000 + 3 * 0x40000000.
  prints, finite = checkpointing.fingerprint({"x": jnp.array([1.0, 2.0], jnp.float32)})
  assert prints == {"['x']": (0x3F800000 + 3 * 0x40000000) % 2**32} and finite
  _, finite = checkpointing.fingerprint({"x": jnp.array([1.0, jnp.nan])})
  assert not finite


def test_fingerprint_is_independent_of_sharding():
  mesh = make_mesh(MeshConfig(data=4, fsdp=2))
  x = jnp.arange(64, dtype=jnp.float32).reshape(8, 8) / 7
  sharded = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), None)))
  assert checkpointing.fingerprint({"x": x}) == checkpointing.fingerprint({"x": sharded})


def test_save_restore_round_trip_and_meta(tmp_path):
  ckpt = checkpointing.Checkpointer(str(tmp_path / "ck"), keep=2)
  ckpt.save(1, {"params": _tree()}, {"step": 1})
  ckpt.wait()
  items, meta = ckpt.restore(1, _targets(_tree()))
  assert meta["step"] == 1
  for a, b in zip(jax.tree.leaves(items["params"]), jax.tree.leaves(_tree())):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  ckpt.close()


def test_non_finite_tree_is_never_written(tmp_path):
  ckpt = checkpointing.Checkpointer(str(tmp_path / "ck"))
  bad = _tree()
  bad["w"] = bad["w"].at[1, 2].set(jnp.inf)
  with pytest.raises(ValueError, match="non-finite"):
    ckpt.save(3, {"params": bad}, {"step": 3})
  ckpt.wait()
  assert ckpt.steps() == []


def _data_files(step_dir):
  return [f for f in glob.glob(os.path.join(step_dir, "params", "**", "d", "*"), recursive=True)
          if os.path.isfile(f)]


def test_bit_flip_is_a_checksum_error(tmp_path):
  ckpt = checkpointing.Checkpointer(str(tmp_path / "ck"))
  ckpt.save(1, {"params": _tree()}, {"step": 1})
  ckpt.wait()
  # Flip one bit of the stored payload in every data file: either the decoder or the checksum objects.
  for path in _data_files(ckpt.step_path(1)):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))
  with pytest.raises(CheckpointError, match=str(ckpt.step_path(1))):
    ckpt.restore(1, _targets(_tree()))


def test_checksum_mismatch_is_named(tmp_path):
  ckpt = checkpointing.Checkpointer(str(tmp_path / "ck"))
  ckpt.save(1, {"params": _tree()}, {"step": 1})
  ckpt.wait()
  meta_file = os.path.join(ckpt.step_path(1), "meta", "metadata")
  meta = json.load(open(meta_file))
  meta["checksums"]["params"]["['w']"] += 1     # as if the array had changed under the record
  json.dump(meta, open(meta_file, "w"))
  with pytest.raises(CheckpointError, match=r"checksum mismatch in params \(\['w'\]\)"):
    ckpt.restore(1, _targets(_tree()))


def test_shape_mismatch_names_the_leaf(tmp_path):
  ckpt = checkpointing.Checkpointer(str(tmp_path / "ck"))
  ckpt.save(1, {"params": _tree()}, {"step": 1})
  ckpt.wait()
  other = _tree()
  other["w"] = jnp.zeros((4, 5), jnp.float32)
  with pytest.raises(CheckpointError, match=r"params/w has shape \(4, 3\) float32 in the checkpoint, "
                                            r"\(4, 5\) float32 in this config"):
    ckpt.restore(1, _targets(other))


def test_corrupt_meta_and_missing_item(tmp_path):
  ckpt = checkpointing.Checkpointer(str(tmp_path / "ck"))
  ckpt.save(1, {"params": _tree()}, {"step": 1})
  ckpt.save(2, {"params": _tree(2.0)}, {"step": 2})
  ckpt.wait()
  open(os.path.join(ckpt.step_path(2), "meta", "metadata"), "w").write("{not json")
  with pytest.raises(CheckpointError, match="meta record unreadable"):
    ckpt.read_meta(2)
  import shutil
  shutil.rmtree(os.path.join(ckpt.step_path(1), "params"))
  with pytest.raises(CheckpointError):
    ckpt.restore(1, _targets(_tree()))


def test_move_aside_and_prune(tmp_path):
  ckpt = checkpointing.Checkpointer(str(tmp_path / "ck"), keep=5)
  for s in (1, 2, 3):
    ckpt.save(s, {"params": _tree(s)}, {"step": s})
  ckpt.wait()
  dest = ckpt.move_aside(3, "test reason")
  assert os.path.isdir(dest) and open(dest + ".reason.txt").read() == "test reason\n"
  assert ckpt.steps() == [1, 2]
  ckpt.keep = 1
  assert ckpt.prune() == [1]
  assert ckpt.steps() == [2]
  ckpt.close()


def test_read_only_inspection_creates_nothing(tmp_path):
  ckpt = checkpointing.Checkpointer(str(tmp_path / "none"), create=False)
  assert ckpt.steps() == []
  assert not (tmp_path / "none").exists()
