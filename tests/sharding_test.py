"""Mesh construction and the logical-axis rule tables on 8 virtual CPU devices."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from rl_fusion_jax.config import MeshConfig
from rl_fusion_jax.sharding.mesh import make_mesh
from rl_fusion_jax.sharding.rules import (GENERATE_RULES, TRAIN_RULES, cache_sharding, logical_to_spec,
                                          param_shardings)
from rl_fusion_jax.testing.tiny import tiny_model_config


def test_mesh_resolves_minus_one():
  mesh = make_mesh(MeshConfig(data=-1, fsdp=2, tensor=2))
  assert dict(mesh.shape) == {"stage": 1, "data": 2, "fsdp": 2, "tensor": 2}
  assert mesh.size == jax.device_count() == 8


@pytest.mark.parametrize("cfg", [MeshConfig(data=3), MeshConfig(data=2, fsdp=2, tensor=1),
                                 MeshConfig(data=-1, fsdp=3)])
def test_mesh_that_does_not_divide_devices_fails(cfg):
  with pytest.raises(ValueError, match="config.mesh"):
    make_mesh(cfg)


def test_mesh_config_rejects_bad_sizes():
  with pytest.raises(ValueError, match="mesh.fsdp"):
    MeshConfig(fsdp=0)
  with pytest.raises(ValueError, match="at most one axis"):
    MeshConfig(data=-1, fsdp=-1)


def test_rule_tables_side_by_side():
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  axes = ("embed", "q_heads", "head_dim")
  assert logical_to_spec(axes, TRAIN_RULES, mesh) == P("fsdp", "tensor", None)
  assert logical_to_spec(axes, GENERATE_RULES, mesh) == P(None, "tensor", None)
  assert logical_to_spec(("norm",), TRAIN_RULES, mesh) == P(None)


def test_mesh_axis_used_once_per_array():
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  rules = (("a", "tensor"), ("b", "tensor"))
  assert logical_to_spec(("a", "b"), rules, mesh) == P("tensor", None)


def test_unknown_axis_errors():
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  with pytest.raises(ValueError, match="'experts' has no rule"):
    logical_to_spec(("experts",), TRAIN_RULES, mesh)
  with pytest.raises(ValueError, match="mesh axis 'model'"):
    logical_to_spec(("embed",), (("embed", "model"),), mesh)


def test_param_shardings_and_divisibility():
  mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
  abstract = {"w": jax.ShapeDtypeStruct((8, 6), np.float32), "n": jax.ShapeDtypeStruct((8,), np.float32)}
  axes = {"w": ("embed", "mlp"), "n": ("norm",)}
  sh = param_shardings(abstract, axes, mesh, TRAIN_RULES)
  assert sh["w"].spec == P("fsdp", "tensor") and sh["n"].spec == P(None)
  bad = {"w": jax.ShapeDtypeStruct((6, 6), np.float32), "n": abstract["n"]}
  with pytest.raises(ValueError, match=r"\['w'\] dimension 0 \(size 6"):
    param_shardings(bad, axes, mesh, TRAIN_RULES)


@pytest.mark.parametrize("rules", [TRAIN_RULES, GENERATE_RULES], ids=["train", "generate"])
def test_kv_cache_rows_over_batch_axes_heads_over_tensor(rules):
  # [L, B, K, S, H]: every device holds its own rows and its own half of the KV heads (no replicas).
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  assert cache_sharding(tiny_model_config(), mesh, rules).spec == P(None, ("data", "fsdp"), "tensor",
                                                                     None, None)


def test_kv_heads_that_tensor_does_not_divide_fail_naming_both_fields():
  mesh = make_mesh(MeshConfig(data=4, tensor=2))
  cfg = tiny_model_config(num_heads=3, num_kv_heads=3, hidden_size=24)
  with pytest.raises(ValueError, match=r"model.num_kv_heads=3 does not divide over mesh.tensor=2"):
    cache_sharding(cfg, mesh, GENERATE_RULES)
