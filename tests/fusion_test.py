"""Deployment modes on 8 devices: the same metrics in every mode, no recompiles, switch metrics, timeline;
every parameter move of a deployment (publish, aux fetch / release / placement) through reshard; the
transfer guard around the update."""
import gc
import os

import jax
import numpy as np
import pytest

from rl_fusion_jax import config as config_lib
from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax import models
from rl_fusion_jax.fusion.deployment import make_deployment
from rl_fusion_jax.models import reward_model
from rl_fusion_jax.orchestration import loop, phases
from rl_fusion_jax.sharding import memory
from rl_fusion_jax.testing.experiments import rl_step_traces
from rl_fusion_jax.timeline import load_timeline, summarize, timeline_path
from rl_fusion_jax.train import state as state_lib
from rl_fusion_jax.train import step as step_lib
from rl_fusion_jax.types import TrainBatch

MODES = ("colocated", "full", "separated", "hybrid")


def cfg(mode, **over):
  c = dict(
      model=dict(model_type="qwen2", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4,
                 num_kv_heads=2, intermediate_size=64, qkv_bias=True, tie_word_embeddings=False,
                 max_position_embeddings=32, scan_unroll=2),   # unrolled: see testing/experiments.py
      mesh=dict(data=-1, fsdp=2, tensor=1),
      fusion=dict(mode=mode, bucket_bytes=32768, memory_every=2),
      task=dict(name="arithmetic", kwargs=dict(max_digits=2), eval_problems=8),
      rollout=dict(num_prompts=4, group_size=2, max_prompt_len=8, max_new_tokens=4, num_slots=8,
                   chunk_steps=2),
      algo=dict(kl_coef=0.05),
      optim=dict(learning_rate=1e-3),
      warmup=dict(steps=2, batch_size=8),
      run=dict(steps=4, checkpoint_every=0, progress_every_s=0.0))
  if mode == "hybrid":
    c["fusion"]["aux_devices"] = 4   # the actor on 4 devices (data 2 x fsdp 2), reference on the other 4
  for k, v in over.items():
    section, name = k.split(".")
    c[section][name] = v
  return config_lib.experiment_from_dict(c)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """One 4-step run per mode; also counts the jaxpr traces of every RL step."""
  out = {}
  with rl_step_traces() as per_step:
    for mode in MODES:
      workdir = str(tmp_path_factory.mktemp(mode))
      summary = loop.run(cfg(mode), workdir)
      out[mode] = (workdir, summary, [r for r in metrics_lib.read_metrics(workdir) if "loss" in r])
  out["traces"] = per_step
  return out


@pytest.mark.parametrize("mode", ["full", "separated", "hybrid"])
def test_modes_give_the_same_metrics(runs, mode):
  _, base_summary, base = runs["colocated"]
  _, summary, rows = runs[mode]
  assert summary["accuracy_before"] == base_summary["accuracy_before"]
  assert summary["accuracy_after"] == base_summary["accuracy_after"]
  assert [r["step"] for r in rows] == [r["step"] for r in base] == [1, 2, 3, 4]
  assert len(rows) == len(base) == 4
  # The policy equals the reference and every advantage is 0 (the tiny model scores nothing), so the only
  # gradient is the KL's, which is exactly 0 where the reference and update forwards round alike and a
  # rounding-level ~1e-5 where they do not; Adam turns either sign of noise into a full-size step. full
  # runs colocated's programs on colocated's mesh (only the reference's residency differs), so it must
  # match on every step. separated trains on 4 of the 8 devices and hybrid scores the reference on its own
  # 4-device mesh: their programs reduce in another order, so they are compared on the first step (same
  # params, reference, batch: KL, loss and grad_norm agree to rounding) and later steps only exist.
  steps = base if mode == "full" else base[:1]
  abs_tol = 1e-6 if mode == "full" else 1e-4
  for a, b in zip(steps, rows):
    for key in ("reward", "accuracy", "response_len_mean", "loss", "grad_norm", "entropy", "kl",
                "kl_seq"):
      assert b[key] == pytest.approx(a[key], rel=1e-4, abs=abs_tol), (mode, a["step"], key)


def test_colocated_switch_metrics(runs):
  _, _, rows = runs["colocated"]
  for r in rows:
    assert r["switch/to_generate/params_bytes"] > 0         # fsdp=2: the layouts really differ
    assert r["switch/to_generate/offload_bytes"] > 0        # optimizer state went to the host
    assert r["switch/to_train/offload_bytes"] == r["switch/to_generate/offload_bytes"]
    assert r["switch/to_generate/buckets"] > 1
  # fusion.memory_every=2: live memory sampled on every other switch of each direction only.
  sampled = ["switch/to_generate/peak_bytes_max" in r for r in rows]
  assert any(sampled) and not all(sampled), sampled
  assert all(r["switch/to_generate/peak_bytes_max"] > 0 for r in rows if "switch/to_generate/peak_bytes_max" in r)
  _, _, sep = runs["separated"]
  assert all(r["sync/bytes"] > 0 for r in sep) and "switch/to_generate/params_bytes" not in sep[0]


def test_aux_and_sync_moves_land_in_the_metrics(runs):
  # full: the reference is fetched and released every step, reported like a switch; colocated: no moves.
  nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(models.abstract_params(cfg("full").model.config)))
  _, _, full = runs["full"]
  for r in full:
    assert r["aux/reference/fetch/bytes"] == r["aux/reference/release/bytes"] == nbytes
    assert r["aux/reference/fetch/buckets"] >= 1 and r["aux/reference/fetch/seconds"] >= 0
  sampled = ["aux/reference/fetch/peak_extra_bytes_max" in r for r in full]   # fusion.memory_every=2
  assert any(sampled) and not all(sampled), sampled
  _, _, co = runs["colocated"]
  assert not any(k.startswith(("aux/", "sync/")) for r in co for k in r)
  _, _, sep = runs["separated"]
  assert all(r["sync/bytes"] == nbytes and r["sync/buckets"] >= 1 for r in sep)


def test_timeline_groups(runs):
  for mode, groups in (("colocated", {"all"}), ("separated", {"rollout", "train"})):
    data = load_timeline(timeline_path(runs[mode][0]))
    assert set(data.groups) == groups
    names = {i.name for i in data.intervals}
    assert {"generate", "train", "reward"} <= names
    assert set(summarize(data)) == groups
  sep = load_timeline(timeline_path(runs["separated"][0]))
  assert set(sep.groups["rollout"]).isdisjoint(sep.groups["train"])
  assert {i.group for i in sep.intervals if i.name == "generate"} == {"rollout"}
  assert {i.group for i in sep.intervals if i.name == "train"} == {"train"}


def test_hybrid_scores_the_reference_on_its_own_group_while_generating(runs):
  data = load_timeline(timeline_path(runs["hybrid"][0]))
  assert set(data.groups) == {"all", "aux"}
  assert len(data.groups["aux"]) == 4 and set(data.groups["aux"]).isdisjoint(data.groups["all"])
  assert {i.group for i in data.intervals if i.name in ("generate", "train")} == {"all"}
  # The reference stage scores each chunk's finished samples on the aux group as they finish: every
  # step has such intervals, and some start before that step's generation ends (the aux lane overlaps
  # generate); the train phase then only gathers them (every sample was scored early).
  ref = [i for i in data.intervals if i.name == "reference"]
  generate = {i.step: i for i in data.intervals if i.name == "generate"}
  assert {i.group for i in ref} == {"aux"} and {i.step for i in ref} == {0, 1, 2, 3}
  for step, gen in generate.items():
    assert any(i.step == step and i.start < gen.end for i in ref), step
  _, _, rows = runs["hybrid"]
  assert all(r["aux_stage/early_frac"] == 1.0 for r in rows)
  assert all(r["switch/to_generate/params_bytes"] > 0 for r in rows)   # the actor is still fused


def test_hybrid_scores_packed_rows_as_padded_ones(runs, tmp_path):
  # optim.pack_rows in hybrid: the packed rows are copied to the aux group's devices and the reference
  # scores them there; the first step equals the padded hybrid run's (same params, reference and batch).
  workdir = str(tmp_path / "packed")
  loop.run(cfg("hybrid", **{"optim.pack_rows": True, "run.steps": 1}), workdir)
  packed = [r for r in metrics_lib.read_metrics(workdir) if "loss" in r][0]
  padded = runs["hybrid"][2][0]
  assert "pack/rows" in packed and "pack/rows" not in padded
  for key in ("reward", "loss", "grad_norm", "kl", "kl_seq", "entropy"):
    assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-4), key
  ref = [i for i in load_timeline(timeline_path(workdir)).intervals if i.name == "reference"]
  assert {i.group for i in ref} == {"aux"} and packed["aux_stage/early_frac"] == 1.0


def test_bad_hybrid_config(tmp_path):
  with pytest.raises(ValueError, match="fusion.aux_devices"):
    loop.run(cfg("hybrid", **{"fusion.aux_devices": 8}), str(tmp_path / "w"))
  with pytest.raises(ValueError, match="fusion.aux_devices"):
    loop.run(cfg("hybrid", **{"fusion.aux_devices": 3}), str(tmp_path / "w"))   # 8 rows over 3 devices
  assert not os.path.exists(tmp_path / "w")


def test_no_traces_after_the_first_steps(runs):
  """Steps 3 and 4 trace nothing new in any mode: every program was compiled in steps 1 and 2."""
  seen = runs["traces"]
  # The first run builds every program it needs (the later ones may share them: shared_programs).
  assert seen[(MODES[0], 0)] > 0, "the listener saw no traces at all: the check would be vacuous"
  for mode in MODES:
    assert [seen[(mode, s)] for s in (2, 3)] == [0, 0], (mode, seen)


@pytest.mark.parametrize("over,match", [
    ({"fusion.mode": "fused"}, "fusion.mode"),
    ({"fusion.bucket_bytes": 0}, "fusion.bucket_bytes"),
    ({"fusion.memory_every": -1}, "fusion.memory_every"),
    ({"fusion.rollout_device_fraction": 0.01}, "rollout_device_fraction"),
    ({"fusion.generate_rules": [["embed", "model"]]}, "mesh axis 'model'"),
])
def test_bad_fusion_config(tmp_path, over, match):
  with pytest.raises(ValueError, match=match):
    loop.run(cfg("separated" if "fraction" in str(over) else "colocated", **over), str(tmp_path / "w"))
  assert not os.path.exists(tmp_path / "w")


# --- every parameter move through reshard: publish, aux models --------------------------------------

BUCKET = 8192


def _bucket_bound(tree) -> int:
  """What one bucket can add on a device: BUCKET, or the largest single shard of ``tree`` (a leaf larger
  than a bucket travels alone)."""
  return max(BUCKET, max(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards))


def _deployment(mode):
  c = cfg(mode, **{"fusion.bucket_bytes": BUCKET, "fusion.memory_every": 1})
  m = c.model.config
  return c, make_deployment(c, models.abstract_params(m), models.param_logical_axes(m),
                            state_lib.make_optimizer(c.optim))


def _nbytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_publish_sends_bucket_by_bucket_without_a_whole_tree_copy(monkeypatch):
  c, d = _deployment("separated")
  params = jax.device_put(models.init_params(c.model.config, jax.random.key(0)), d.train_param_shardings)
  expected = jax.device_get(params)
  first = d.publish(params)
  old = d.rollout_params
  samples = []                # every live-bytes sample the publish takes (one per bucket, and the ends)
  real_sample = memory.MemoryTracker.sample
  monkeypatch.setattr(memory.MemoryTracker, "sample", lambda self: samples.append(real_sample(self)) or samples[-1])
  gc.collect()
  train_before = memory.per_device(memory.live_bytes(), "device")
  m = d.publish(params)       # the previous copy is freed first, then the new one built bucket by bucket
  assert len(samples) >= m["sync/buckets"] + 2
  for live in samples:        # the training devices never hold more than before: no copy of the tree there
    assert all(memory.per_device(live, "device")[i] <= train_before[i] for i in d.groups["train"])
  dest = max(memory.per_device(memory.live_bytes(jax.tree.leaves(d.rollout_params))).values())
  bucket = _bucket_bound(d.rollout_params)
  assert m["sync/bytes"] == first["sync/bytes"] == _nbytes(params)
  assert m["sync/buckets"] > 1 and m["sync/largest_bucket_bytes"] <= bucket
  # Peak over the start, on any device: the destination plus at most one bucket (no copy of the tree).
  assert 0 < m["sync/peak_extra_bytes_max"] <= dest + bucket
  assert m["sync/transient_bytes_max"] <= bucket
  assert all(x.is_deleted() for x in jax.tree.leaves(old))
  train_after = memory.per_device(memory.live_bytes(), "device")
  assert all(train_after[i] == train_before[i] for i in d.groups["train"])   # training side: unchanged
  for e, x, y in zip(jax.tree.leaves(expected), jax.tree.leaves(params), jax.tree.leaves(d.rollout_params)):
    assert np.array_equal(e, np.asarray(x)) and np.array_equal(e, np.asarray(y))
    assert {dev.id for dev in y.devices()} <= set(d.groups["rollout"])


def test_full_fetch_and_release_report_bucketed_moves():
  c, d = _deployment("full")
  m_cfg = c.model.config
  host = jax.device_get(models.init_params(m_cfg, jax.random.key(1)))
  resting = d.place_aux(host, d.aux_param_shardings(models.abstract_params(m_cfg),
                                                    models.param_logical_axes(m_cfg)))
  assert all(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(resting))
  fetched, m = d.fetch_aux(resting, "reference")
  nbytes = _nbytes(host)
  assert all(x.sharding.memory_kind == "device" for x in jax.tree.leaves(fetched))
  assert m["aux/reference/fetch/bytes"] == nbytes
  assert m["aux/reference/fetch/buckets"] > 1
  assert m["aux/reference/fetch/largest_bucket_bytes"] <= _bucket_bound(fetched)
  assert m["aux/reference/fetch/peak_extra_bytes_max"] > 0 and m["aux/reference/fetch/seconds"] >= 0
  out = jax.tree.map(lambda x: x + 1, fetched)
  r = d.release_aux(fetched, used_by=out, name="reference")
  assert r["aux/reference/release/bytes"] == nbytes and r["aux/reference/release/buckets"] == 0
  assert all(x.is_deleted() for x in jax.tree.leaves(fetched))
  assert not any(x.is_deleted() for x in jax.tree.leaves(resting))
  for e, x in zip(jax.tree.leaves(host), jax.tree.leaves(out)):
    assert np.array_equal(e + 1, np.asarray(x))
  # colocated: the resident params themselves, nothing moves and nothing is reported
  _, co = _deployment("colocated")
  on_device = co.place_aux(host, d.aux_param_shardings(models.abstract_params(m_cfg),
                                                       models.param_logical_axes(m_cfg)))
  assert co.fetch_aux(on_device, "reference") == (on_device, {}) and co.release_aux(on_device) == {}


def test_full_places_the_reward_model_straight_in_host_memory(monkeypatch):
  c, d = _deployment("full")
  rm_cfg = models.ModelConfig(vocab_size=96, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                              intermediate_size=32, qkv_bias=True, max_position_embeddings=32)
  host = jax.device_get(reward_model.init_reward_params(rm_cfg, jax.random.key(3), init_std=0.5))
  shardings = d.aux_param_shardings(reward_model.abstract_reward_params(rm_cfg),
                                    reward_model.reward_logical_axes(rm_cfg))
  kinds = []
  real_put = jax.device_put
  monkeypatch.setattr(jax, "device_put", lambda x, dst=None, **kw: (
      kinds.extend(s.memory_kind for s in jax.tree.leaves(dst)), real_put(x, dst, **kw))[1])
  gc.collect()
  before = memory.live_bytes()
  resting = d.place_aux(host, shardings)
  after = memory.live_bytes()
  assert all(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(resting))
  assert kinds and set(kinds) == {"pinned_host"}           # every put went to host memory, none via device
  assert memory.per_device(after, "device") == memory.per_device(before, "device")
  host_added = {i: n - memory.per_device(before, "pinned_host").get(i, 0)
                for i, n in memory.per_device(after, "pinned_host").items()}
  assert sum(host_added.values()) == sum(memory.per_device(memory.live_bytes(jax.tree.leaves(resting))).values())


# --- the transfer guard around the update ------------------------------------------------------------


def test_guarded_update_rejects_a_host_batch():
  c, d = _deployment("colocated")
  m_cfg, mesh = c.model.config, d.train_mesh
  tx = state_lib.make_optimizer(c.optim)
  shardings = state_lib.state_shardings(tx, models.abstract_params(m_cfg), d.train_param_shardings, mesh)
  train_step = step_lib.make_rl_step(m_cfg, c.algo, 1.0, tx, 1, mesh, 4, shardings)
  params = jax.device_put(models.init_params(m_cfg, jax.random.key(2)), d.train_param_shardings)
  rows, width = 8, 16
  rng = np.random.default_rng(0)
  host_batch = TrainBatch(
      tokens_bt=rng.integers(1, 96, (rows, width)).astype(np.int32),
      mask_bt=np.ones((rows, width), np.float32), advantages_bt=rng.standard_normal((rows, width)).astype(np.float32),
      behaviour_logp_bt=np.full((rows, width), -1.0, np.float32), ref_logp_bt=np.zeros((rows, width), np.float32),
      version_bt=np.zeros((rows, width), np.int32))
  state = state_lib.create_train_state(params, tx, shardings)
  with pytest.raises(Exception, match="[Dd]isallowed host-to-device transfer"):
    phases.guarded_update(train_step, state, host_batch)
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))   # it failed before donating the state
  device_batch = jax.device_put(host_batch, step_lib.batch_shardings(mesh))   # explicit: allowed
  state, metrics = phases.guarded_update(train_step, state, device_batch)
  assert np.isfinite(float(metrics["loss"])) and int(state.step) == 1


@pytest.mark.parametrize("mode", ["colocated", pytest.param("separated", marks=pytest.mark.slow)])
def test_bfloat16_generation_copy_changes_nothing_but_memory(tmp_path, monkeypatch, mode):
  # model.dtype='bfloat16' over float32 params: generation runs on a bfloat16 copy of the weights (made in
  # the switch, or sent to the rollout mesh in bfloat16) while the float32 masters wait on the host. The
  # model casts every weight to bfloat16 before use, so the run must equal one that generates from the
  # float32 masters themselves (generation_dtype forced to the param dtype), metric for metric.
  over = {"model.dtype": "bfloat16", "run.steps": 2}
  summary = loop.run(cfg(mode, **over), str(tmp_path / "copy"))
  rows = [r for r in metrics_lib.read_metrics(str(tmp_path / "copy")) if "loss" in r]
  monkeypatch.setattr(models.ModelConfig, "generation_dtype", property(lambda self: self.weight_dtype))
  base_summary = loop.run(cfg(mode, **over), str(tmp_path / "masters"))
  base = [r for r in metrics_lib.read_metrics(str(tmp_path / "masters")) if "loss" in r]
  assert summary["accuracy_after"] == base_summary["accuracy_after"] and len(rows) == len(base) == 2
  for a, b in zip(base, rows):
    for key in ("reward", "response_len_mean", "loss", "grad_norm", "entropy", "kl"):
      assert a[key] == b[key], key
    if mode == "colocated":
      # Every param gets a bfloat16 copy (2 B a value; without the copy only the params whose layout
      # changes move, 4 B a value), and the float32 masters (4 B a value) join the optimizer on the host.
      copy_bytes = b["switch/to_generate/params_bytes"]
      assert a["switch/to_generate/params_bytes"] / 2 <= copy_bytes < a["switch/to_generate/params_bytes"]
      assert b["switch/to_generate/offload_bytes"] - a["switch/to_generate/offload_bytes"] == 2 * copy_bytes
    else:
      assert b["sync/bytes"] == a["sync/bytes"]     # bytes of the float32 sources sent, as before
