"""Deployment modes on 8 devices: the same metrics in every mode, no recompiles, switch metrics, timeline."""
import os

import jax
import pytest

from rl_fusion_jax import config as config_lib
from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax.orchestration import loop, phases
from rl_fusion_jax.timeline import load_timeline, summarize, timeline_path

MODES = ("colocated", "full", "separated", "hybrid")


def cfg(mode, **over):
  c = dict(
      model=dict(model_type="qwen2", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4,
                 num_kv_heads=2, intermediate_size=64, qkv_bias=True, tie_word_embeddings=False,
                 max_position_embeddings=32),
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
  traces = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kw: traces.append(event) if "trace" in event else None)
  original = phases.rl_step
  per_step = {}

  def counting(setup, programs, state, ref, step, *args):
    before = len(traces)
    out = original(setup, programs, state, ref, step, *args)
    per_step[(programs.deployment.mode, step)] = len(traces) - before
    return out

  out = {}
  phases.rl_step = counting
  try:
    for mode in MODES:
      workdir = str(tmp_path_factory.mktemp(mode))
      summary = loop.run(cfg(mode), workdir)
      out[mode] = (workdir, summary, [r for r in metrics_lib.read_metrics(workdir) if "loss" in r])
  finally:
    phases.rl_step = original
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
  # hybrid computes the reference log-probs on another mesh (replicated over 4 devices, not fsdp over
  # 8): rounding-level differences give a KL gradient of ~1e-5 where colocated has exactly 0 (policy ==
  # reference, zero advantages), and Adam turns that into a full-size step. So hybrid is compared on its
  # first step only (reference, KL, loss and update from the same params); later steps diverge.
  abs_tol = 1e-4 if mode == "hybrid" else 1e-6
  for a, b in zip(base[:1] if mode == "hybrid" else base, rows):
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


def test_hybrid_scores_the_reference_on_its_own_group(runs):
  data = load_timeline(timeline_path(runs["hybrid"][0]))
  assert set(data.groups) == {"all", "aux"}
  assert len(data.groups["aux"]) == 4 and set(data.groups["aux"]).isdisjoint(data.groups["all"])
  ref = [i for i in data.intervals if i.name == "reference"]
  assert len(ref) == 4 and {i.group for i in ref} == {"aux"}      # one per step, on the aux group
  assert {i.group for i in data.intervals if i.name in ("generate", "train")} == {"all"}
  _, _, rows = runs["hybrid"]
  assert all(r["switch/to_generate/params_bytes"] > 0 for r in rows)   # the actor is still fused


def test_bad_hybrid_config(tmp_path):
  with pytest.raises(ValueError, match="fusion.aux_devices"):
    loop.run(cfg("hybrid", **{"fusion.aux_devices": 8}), str(tmp_path / "w"))
  with pytest.raises(ValueError, match="fusion.aux_devices"):
    loop.run(cfg("hybrid", **{"fusion.aux_devices": 3}), str(tmp_path / "w"))   # 8 rows over 3 devices
  assert not os.path.exists(tmp_path / "w")


def test_no_traces_after_the_first_steps(runs):
  """Steps 3 and 4 trace nothing new in any mode: every program was compiled in steps 1 and 2."""
  seen = runs["traces"]
  for mode in MODES:
    assert seen[(mode, 0)] > 0, "the listener saw no traces at all: the check would be vacuous"
    assert [seen[(mode, s)] for s in (2, 3)] == [0, 0], (mode, seen)


@pytest.mark.parametrize("over,match", [
    ({"fusion.mode": "fused"}, "fusion.mode"),
    ({"fusion.bucket_bytes": 0}, "fusion.bucket_bytes"),
    ({"fusion.memory_every": -1}, "fusion.memory_every"),
    ({"fusion.rollout_fraction": 0.01}, "rollout_fraction"),
    ({"fusion.generate_rules": [["embed", "model"]]}, "mesh axis 'model'"),
])
def test_bad_fusion_config(tmp_path, over, match):
  with pytest.raises(ValueError, match=match):
    loop.run(cfg("separated" if "fraction" in str(over) else "colocated", **over), str(tmp_path / "w"))
  assert not os.path.exists(tmp_path / "w")
