"""Engine against the batch Generator and a full recompute: tokens, log-probs, versions, schedules, errors."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_fusion_jax import models
from rl_fusion_jax.config import MeshConfig
from rl_fusion_jax.rollout import slots
from rl_fusion_jax.rollout.decode import GenerateSpec
from rl_fusion_jax.rollout.engine import Engine, EngineConfig, Request
from rl_fusion_jax.rollout.sampling import SamplingParams
from rl_fusion_jax.sharding.mesh import make_mesh
from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
from rl_fusion_jax.testing.reference_generator import Generator
from rl_fusion_jax.testing.tiny import tiny_model_config

CFG = tiny_model_config()
P, N, B = 6, 10, 24
GREEDY, SAMPLED = SamplingParams(0.0), SamplingParams(1.0)
DATA8 = MeshConfig(data=-1)
# A token that 10 of the B greedy and 8 of the B sampled EOS-free responses contain (found once by
# running the Generator without EOS): with it, rows stop at different steps and some never stop. The
# tests assert that spread, so a change of model or prompts that loses it fails loudly.
EOS = 20


@functools.lru_cache(maxsize=None)
def setup(mesh_cfg=DATA8, seed=0):
  mesh = make_mesh(mesh_cfg)
  shardings = param_shardings(models.abstract_params(CFG), models.param_logical_axes(CFG), mesh,
                              TRAIN_RULES)
  params = jax.device_put(models.init_params(CFG, jax.random.key(seed), init_std=0.5), shardings)
  return mesh, shardings, params


def prompts(seed=0):
  rng = np.random.default_rng(seed)
  lens = rng.integers(1, P + 1, size=B).astype(np.int32)
  lens[0], lens[1] = 1, P
  toks = np.zeros((B, P), np.int32)
  for b, n in enumerate(lens):
    toks[b, :n] = rng.integers(3, 60, size=n)
  return toks, lens


def make_requests(toks, lens, forced=None, group_size=1):
  return [Request(b, b // group_size, toks[b, :lens[b]], None if forced is None else int(forced[b]))
          for b in range(len(lens))]


@functools.lru_cache(maxsize=None)
def generator_reference(sampling, eos_id, mesh_cfg=DATA8, seed=0):
  """The batch Generator's output for all B prompts, sample id b on row b, base key = seed."""
  mesh, shardings, params = setup(mesh_cfg)
  gen = Generator(GenerateSpec(CFG, sampling, P, N, eos_id), mesh, shardings)
  toks, lens = prompts()
  out = gen(params, jnp.asarray(toks), jnp.asarray(lens), jnp.arange(B, dtype=jnp.int32),
            jax.random.key(seed), jnp.int32(7))
  return jax.device_get(out)


def make_engine(sampling, eos_id, num_slots=8, chunk_steps=3, mesh_cfg=DATA8, **kw):
  mesh, shardings, _ = setup(mesh_cfg)
  cfg = EngineConfig(GenerateSpec(CFG, sampling, P, N, eos_id), num_slots=num_slots,
                     chunk_steps=chunk_steps, **kw)
  return Engine(cfg, mesh, shardings)


def run_all(engine, params, requests, version=7, target_samples=None):
  """Adds ``requests``, calls run until every one came back; returns the rows sorted by sample id."""
  engine.add(requests)
  results = []
  while engine.num_queued or engine.num_in_flight or engine.num_unreturned:
    results.append(engine.run(params, version, target_samples=target_samples))
  out = {k: np.concatenate([getattr(r.rollout, k) for r in results]) for k in (
      "tokens_bt", "logp_bt", "version_bt", "prompt_len_b", "response_len_b", "finished_b", "sample_id_b")}
  order = np.argsort(out["sample_id_b"])
  return {k: v[order] for k, v in out.items()}, results


def assert_same_as_generator(out, ref):
  np.testing.assert_array_equal(out["sample_id_b"], np.arange(B))
  np.testing.assert_array_equal(out["tokens_bt"], ref.tokens_bt)
  np.testing.assert_array_equal(out["response_len_b"], ref.response_len_b)
  np.testing.assert_array_equal(out["finished_b"], ref.finished_b)
  np.testing.assert_array_equal(out["version_bt"], ref.version_bt)
  np.testing.assert_allclose(out["logp_bt"], ref.logp_bt, atol=2e-5)


@pytest.mark.parametrize("num_slots,chunk_steps,mesh_cfg", [
    (8, 1, DATA8), (16, 64, DATA8), (4, 2, MeshConfig(data=2, fsdp=2, tensor=2))],
    ids=["s8k1", "s16k64", "s4k2_d2f2t2"])
def test_greedy_equals_generator(num_slots, chunk_steps, mesh_cfg):
  ref = generator_reference(GREEDY, EOS, mesh_cfg)
  assert 2 < ref.finished_b.sum() < B - 2       # rows stop early at different steps, others never
  assert len(set(ref.response_len_b[ref.finished_b])) > 2
  engine = make_engine(GREEDY, EOS, num_slots, chunk_steps, mesh_cfg)
  out, _ = run_all(engine, setup(mesh_cfg)[2], make_requests(*prompts()))
  assert_same_as_generator(out, ref)


SCHEDULES = {
    "s8_k1": dict(num_slots=8, chunk_steps=1),
    "s16_k7_static": dict(num_slots=16, chunk_steps=7, refill="static"),
    "s16_k4_rows16": dict(num_slots=16, chunk_steps=4, prefill_rows=16),
    "s8_k2_reversed": dict(num_slots=8, chunk_steps=2, reverse=True),
    "s8_k3_split": dict(num_slots=8, chunk_steps=3, target_samples=5),
    "s16_k2_split_keep_cache": dict(num_slots=16, chunk_steps=2, target_samples=3, keep_cache=True),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_sampled_tokens_do_not_depend_on_schedule(name):
  kw = dict(SCHEDULES[name])
  reverse, target = kw.pop("reverse", False), kw.pop("target_samples", None)
  ref = generator_reference(SAMPLED, EOS)
  assert 2 < ref.finished_b.sum() < B - 2
  requests = make_requests(*prompts())
  engine = make_engine(SAMPLED, EOS, **kw)
  out, results = run_all(engine, setup()[2], requests[::-1] if reverse else requests, target_samples=target)
  assert_same_as_generator(out, ref)
  if target is not None:     # the run really was split, and in-flight samples were re-prefilled
    assert len(results) > 2 and all(len(r.group_id_b) == target for r in results[:-2])
    assert sum(r.stats.get("reprefill_rows", 0) for r in results) > 0 or kw.get("keep_cache")


def test_another_seed_gives_other_tokens():
  ref = generator_reference(SAMPLED, EOS)
  out, _ = run_all(make_engine(SAMPLED, EOS, seed=1), setup()[2], make_requests(*prompts()))
  assert (out["tokens_bt"] != ref.tokens_bt).mean() > 0.3


def test_no_recompiles_and_fetches_per_chunk(monkeypatch):
  # Per chunk one fetch of the small per-slot arrays and counters, plus one of the outbox when samples
  # finished in it (read once the next chunk is dispatched, or at the end of the run).
  fetches = []
  real_get = jax.device_get
  monkeypatch.setattr(jax, "device_get", lambda x: fetches.append(1) or real_get(x))
  toks, lens = prompts()
  forced = np.random.default_rng(4).integers(1, N + 1, size=B)
  for k, target, refill in ((1, 5, "continuous"), (4, None, "static"), (9, 2, "continuous")):
    engine = make_engine(SAMPLED, EOS, num_slots=8, chunk_steps=k, refill=refill)
    fetches.clear()
    _, results = run_all(engine, setup()[2], make_requests(toks, lens, forced), target_samples=target)
    chunks = sum(r.stats.get("decode_chunks", 0) for r in results)
    assert chunks < len(fetches) <= 2 * chunks
  programs = engine.programs
  assert programs.chunk._cache_size() == 1
  assert all(fn._cache_size() <= 1 for fn in programs.prefill.values())


def test_kv_cache_splits_heads_over_tensor():
  # data=4 x tensor=2: the cache's slots split over data and its 2 KV heads over tensor (GENERATE_RULES),
  # so each device holds 1 head of 2 of the 8 slots, 1/8 of the bytes; the tokens stay the Generator's.
  mesh_cfg = MeshConfig(data=4, tensor=2)
  ref = generator_reference(SAMPLED, EOS, mesh_cfg)
  engine = make_engine(SAMPLED, EOS, num_slots=8, chunk_steps=3, mesh_cfg=mesh_cfg, keep_cache=True)
  out, _ = run_all(engine, setup(mesh_cfg)[2], make_requests(*prompts()))
  assert_same_as_generator(out, ref)
  layers, num_slots, heads, width, head_dim = engine._cache["k"].shape
  assert heads == CFG.num_kv_heads == 2
  for x in engine._cache.values():
    shards = x.addressable_shards
    assert {s.data.shape for s in shards} == {(layers, num_slots // 4, heads // 2, width, head_dim)}
    assert len({str(s.index) for s in shards}) == len(shards) == 8      # no two devices hold one piece
    assert {s.data.nbytes for s in shards} == {x.nbytes // 8}
  mesh, shardings, _ = setup(mesh_cfg)
  gen = Generator(GenerateSpec(CFG, SAMPLED, P, N, EOS), mesh, shardings)
  assert gen.cache_sharding == engine.programs.cache_sharding == engine._cache["v"].sharding


def test_kv_heads_that_tensor_does_not_divide_fail_before_compiling():
  cfg = tiny_model_config(hidden_size=24, num_heads=3, num_kv_heads=3)
  mesh = make_mesh(MeshConfig(data=4, tensor=2))
  # Parameters that replicate their heads, so that the cache is the first thing the tensor axis splits.
  rules = tuple((name, None if name.endswith("heads") else axes) for name, axes in TRAIN_RULES)
  shardings = param_shardings(models.abstract_params(cfg), models.param_logical_axes(cfg), mesh, rules)
  with pytest.raises(ValueError, match=r"model.num_kv_heads=3 does not divide over mesh.tensor=2"):
    Engine(EngineConfig(GenerateSpec(cfg, SAMPLED, P, N, EOS), num_slots=8), mesh, shardings)


@pytest.mark.parametrize("narrow", [True, False])
def test_short_prompts_prefill_at_their_own_width(narrow):
  # max_prompt_len 2P, prompts of at most P tokens: with narrow_refills, refills prefill at the narrowest
  # width that holds them (8 here, not 2P); by default at the prompt width 2P, the chunk program holding
  # one forward. Either way the samples are those of the batch Generator at prompt width P.
  spec = GenerateSpec(CFG, SAMPLED, 2 * P, N, EOS)
  assert slots.prefill_widths(2 * P, 2 * P + N) == (8, 2 * P, 2 * P + N)
  mesh, shardings, params = setup()
  engine = Engine(EngineConfig(spec, num_slots=8, chunk_steps=3, narrow_refills=narrow), mesh, shardings)
  out, results = run_all(engine, params, make_requests(*prompts()))
  width = 8 if narrow else 2 * P
  assert engine.programs.new_widths == ((8, 2 * P) if narrow else (2 * P,))
  refills = sum(r.stats["refill_prefills"] for r in results)
  assert refills and sum(r.stats["prefill_tokens"] for r in results) == refills * engine.rows * width
  ref = generator_reference(SAMPLED, EOS)
  assert not out["tokens_bt"][:, P + N:].any() and (out["version_bt"][:, P + N:] == -1).all()
  assert_same_as_generator({k: v[:, :P + N] if v.ndim == 2 else v for k, v in out.items()}, ref)


@pytest.mark.parametrize("shared", [True, False], ids=["grpo_groups", "groups_of_distinct_prompts"])
def test_a_group_shares_its_prompt_forward(shared):
  # Groups of 4 over 4 batch shards (2 x 2 x 2), refills of 8 rows: the refill's forward runs on
  # ceil(7 / 4) + 1 = 3 -> 4 rows, one per distinct (group, prompt), and every slot of a group gets its
  # KV. GRPO groups (one prompt each): 2 prompts per refill, all 8 rows admitted. Groups whose samples
  # have distinct prompts: 4 rows a refill. The samples are the batch Generator's either way.
  mesh_cfg = MeshConfig(data=2, fsdp=2, tensor=2)
  mesh, shardings, params = setup(mesh_cfg)
  toks, lens = prompts()
  if shared:
    toks, lens = np.repeat(toks[::4], 4, axis=0), np.repeat(lens[::4], 4)
  gen = Generator(GenerateSpec(CFG, SAMPLED, P, N, EOS), mesh, shardings)
  ref = jax.device_get(gen(params, jnp.asarray(toks), jnp.asarray(lens), jnp.arange(B, dtype=jnp.int32),
                           jax.random.key(0), jnp.int32(7)))
  assert 2 < ref.finished_b.sum() < B - 2
  engine = make_engine(SAMPLED, EOS, num_slots=16, chunk_steps=3, mesh_cfg=mesh_cfg, prefill_rows=8, group_size=4)
  assert engine.programs.unique_rows == 4
  out, results = run_all(engine, params, make_requests(toks, lens, group_size=4))
  assert_same_as_generator(out, ref)
  refills = sum(r.stats["refill_prefills"] for r in results)
  admitted = sum(r.stats["prefill_rows"] for r in results)
  assert admitted == B and refills == (3 if shared else 6)
  assert sum(r.stats["prefill_tokens"] for r in results) == refills * 4 * P   # 4 rows at width P


def test_refill_widths_are_the_prompt_width_or_every_narrower_one_too():
  widths = slots.prefill_widths(40, 200)
  assert slots.refill_widths(widths, 40) == (40,)
  assert slots.refill_widths(widths, 40, narrow=True) == (8, 16, 32, 40)
  # A prompt holds its last token back: 33 tokens prefill 32 positions.
  assert slots.refill_widths(slots.prefill_widths(33, 64), 33) == (32,)
  with pytest.raises(ValueError, match="narrow_refills"):
    EngineConfig(GenerateSpec(CFG, SAMPLED, P, N, EOS), num_slots=8, narrow_refills="yes")


def test_prefill_width_is_the_smallest_bucket_that_holds_the_prefix():
  widths = slots.prefill_widths(16, 48)
  assert widths == (8, 16, 32, 48)
  assert [slots.prefill_width(widths, n) for n in (0, 4, 8, 9, 15, 16, 17, 47)] == [8, 8, 8, 16, 16, 16, 32, 48]
  assert slots.prefill_widths(6, 16) == (6, 12, 16)          # nothing narrower than MIN_PREFILL_WIDTH
  assert slots.prefill_widths(40, 200) == (8, 16, 32, 40, 80, 160, 200)


def test_bad_input_fails_with_named_field():
  with pytest.raises(ValueError, match="max_new_tokens"):
    GenerateSpec(CFG, SAMPLED, P, 0, 5)
  for top_p in (0.0, 1.5):
    with pytest.raises(ValueError, match="top_p"):
      SamplingParams(1.0, top_p=top_p)
  spec = GenerateSpec(CFG, SAMPLED, P, N, 5)
  with pytest.raises(ValueError, match="group_size"):
    EngineConfig(spec, num_slots=8, group_size=3)
  with pytest.raises(ValueError, match="refill"):
    EngineConfig(spec, num_slots=8, refill="eager")
  with pytest.raises(ValueError, match="num_slots"):
    make_engine(SAMPLED, EOS, num_slots=4)       # 8 batch shards
  with pytest.raises(ValueError, match="forced_len"):
    Request(0, 0, [3], forced_len=0)
  with pytest.raises(ValueError, match="prompt"):
    Request(0, 0, [])
  engine = make_engine(SAMPLED, EOS, group_size=2)
  for bad, field in (([Request(0, 0, [3] * (P + 1))], "max_prompt_len"),
                     ([Request(0, 0, [64])], "vocab_size"),
                     ([Request(0, 0, [3]), Request(0, 1, [3])], "sample_id"),
                     ([Request(i, 0, [3]) for i in range(3)], "group_id")):
    with pytest.raises(ValueError, match=field):
      engine.add(bad)
  assert engine.num_queued == 0                # a rejected add queues nothing
  engine.add([Request(0, 0, [3])])
  with pytest.raises(ValueError, match="sample_id"):
    engine.add([Request(0, 5, [3])])
  with pytest.raises(ValueError, match="target"):
    engine.run(setup()[2], 0, target_samples=1, target_groups=1)
  with pytest.raises(ValueError, match="target_samples"):
    engine.run(setup()[2], 0, target_samples=0)


def test_bookkeeping_is_bounded_by_live_samples():
  """Over many runs the id and group tables hold only samples not yet returned."""
  engine = make_engine(SAMPLED, EOS, group_size=2)
  params = setup()[2]
  for round_ in range(3):
    engine.add([Request(100 * round_ + i, 50 * round_ + i // 2, [3, 4]) for i in range(8)])
    with pytest.raises(ValueError, match="sample_id"):      # a live id is still refused
      engine.add([Request(100 * round_, 99, [3])])
    out = engine.run(params, round_)
    assert len(out.group_id_b) == 8
    assert not engine._ids and not engine._group_added and not engine._group_returned


def test_a_refill_admits_its_rows_without_gathering_them_between_devices():
  """A refill writes its rows into their slots (``slots._admit``) from the replicated requests, with the
  destination slots computed alike on every device: each device writes the rows its own slots take, no
  collective. The rows split over the batch shards, as the refill's forward splits them (the form before),
  are first gathered onto every device. Both leave the slots the same."""
  from rl_fusion_jax.rollout import decode as decode_lib  # pylint: disable=import-outside-toplevel
  from rl_fusion_jax.sharding.mesh import batch_sharding, replicated  # pylint: disable=import-outside-toplevel
  mesh = make_mesh(MeshConfig(data=4, fsdp=2, tensor=1))
  num_slots, seq_len, rows, width = 16, 12, 8, 5   # the refill's rows split over the 8 batch shards
  rng = np.random.default_rng(0)
  state = slots.empty_slots(num_slots, seq_len)
  state = state.replace(done_s=jnp.asarray(rng.random(num_slots) < 0.5),
                        tokens_st=jnp.asarray(rng.integers(1, 9, (num_slots, seq_len)), jnp.int32))
  free = np.flatnonzero(np.asarray(state.done_s))[:rows]
  assert 0 < len(free) < rows
  dest_r = np.full(rows, num_slots, np.int32)      # rows past the free slots: dropped
  dest_r[:len(free)] = free
  requests = (jnp.asarray(rng.integers(1, 9, (rows, width)), jnp.int32),       # prompts, prompt lengths,
              jnp.asarray(rng.integers(1, width + 1, rows), jnp.int32),       # sample ids, forced lengths
              jnp.arange(rows, dtype=jnp.int32) + 100, jnp.zeros((rows,), jnp.int32))
  state_sh = decode_lib.state_shardings(mesh)
  rep, b1, b2 = replicated(mesh), batch_sharding(mesh, 1), batch_sharding(mesh, 2)
  everywhere = jax.jit(slots._admit, in_shardings=(state_sh,) + (rep,) * 5, out_shardings=state_sh)
  split = jax.jit(slots._admit, in_shardings=(state_sh, b1, b2, b1, b1, b1), out_shardings=state_sh)
  collectives = ("all-gather(", "all-reduce(", "all-to-all(", "collective-permute(", "reduce-scatter(")
  count = lambda fn: sum(fn.lower(state, dest_r, *requests).compile().as_text().count(c) for c in collectives)
  assert count(everywhere) == 0
  assert count(split) > 0
  got, want = everywhere(state, dest_r, *requests), split(state, dest_r, *requests)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(got.sample_id_s)[free], np.arange(len(free)) + 100)
