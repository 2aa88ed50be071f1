"""Engine state for a bounded-staleness scheduler: finish_groups, per-group oldest versions, checkpointing."""
import functools
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_fusion_jax import models
from rl_fusion_jax.config import MeshConfig
from rl_fusion_jax.rollout import engine as engine_lib, slots
from rl_fusion_jax.rollout.decode import GenerateSpec
from rl_fusion_jax.rollout.engine import Engine, EngineConfig, Request
from rl_fusion_jax.rollout.sampling import SamplingParams
from rl_fusion_jax.sharding.mesh import make_mesh
from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
from rl_fusion_jax.testing.tiny import tiny_model_config

CFG = tiny_model_config()
P, N, EOS = 6, 10, 20
SPEC = GenerateSpec(CFG, SamplingParams(1.0), P, N, EOS)
# 5 groups of 2 on 8 slots: 2 queued at the start. Group 0 ends first (run 1 stops there), sample 2 with
# it, so group 1 is unreturned at the save point; None: EOS or max_new_tokens ends the sample.
FORCED = (2, 2, 2, None, 9, 6, 5, None, None, 3)
FIELDS = ("tokens_bt", "logp_bt", "version_bt", "prompt_len_b", "response_len_b", "finished_b", "sample_id_b")


@functools.lru_cache(maxsize=None)
def setup(mesh_cfg=MeshConfig(data=-1)):
  mesh = make_mesh(mesh_cfg)
  shardings = param_shardings(models.abstract_params(CFG), models.param_logical_axes(CFG), mesh,
                              TRAIN_RULES)
  return mesh, shardings


@functools.lru_cache(maxsize=None)
def params(seed):
  return jax.device_put(models.init_params(CFG, jax.random.key(seed), init_std=0.5), setup()[1])


def make_engine(spec=SPEC, mesh_cfg=MeshConfig(data=-1), **kw):
  kw = {"num_slots": 8, "chunk_steps": 2, "group_size": 2, **kw}
  return Engine(EngineConfig(spec, **kw), *setup(mesh_cfg))


def requests(forced, first_id=0):
  """Samples first_id, first_id + 1, ... in groups of 2 with ``forced`` lengths; prompts of 1..P tokens."""
  rng = np.random.default_rng(first_id)
  prompts = [rng.integers(3, 60, size=rng.integers(1, P + 1)) for _ in forced]
  return [Request(first_id + i, (first_id + i) // 2, p, f) for i, (p, f) in enumerate(zip(prompts, forced))]


def first_run():
  """Engine after run 1 (version 0, one group back): samples queued, in flight and unreturned."""
  engine = make_engine()
  engine.add(requests(FORCED))
  out = engine.run(params(0), 0, target_groups=1)
  assert engine.num_queued and engine.num_in_flight > 4 and engine.num_unreturned
  return engine, out


def later_runs(engine):
  return [engine.run(params(1), 1, target_groups=2), engine.run(params(2), 2)]


def npz_round_trip(state):
  for key, value in state.items():      # host values only: numpy arrays and JSON-able scalars
    assert isinstance(value, (np.ndarray, int, float, bool)) and not isinstance(value, jax.Array), key
  buf = io.BytesIO()
  np.savez(buf, **state)
  buf.seek(0)
  with np.load(buf, allow_pickle=False) as loaded:
    return dict(loaded)


def test_restored_engine_continues_exactly():
  engine_a, _ = first_run()
  state = engine_a.state_dict()
  saved_in_flight = set(state["flight.sample_id_s"].tolist())
  versions_at_save = engine_a.group_min_versions()
  outs_a = later_runs(engine_a)

  engine_b = make_engine()
  engine_b.load_state_dict(npz_round_trip(state))
  assert engine_b.group_min_versions() == versions_at_save
  restored = engine_b.state_dict()      # loading and saving again changes nothing
  assert restored.keys() == state.keys()
  for key in state:
    np.testing.assert_array_equal(restored[key], state[key], err_msg=key)
  outs_b = later_runs(engine_b)

  for out_a, out_b in zip(outs_a, outs_b):
    for name in FIELDS:
      np.testing.assert_array_equal(getattr(out_b.rollout, name), getattr(out_a.rollout, name), err_msg=name)
    np.testing.assert_array_equal(out_b.group_id_b, out_a.group_id_b)
    assert out_b.stats["decode_steps"] == out_a.stats["decode_steps"]
  assert outs_b[0].stats["reprefill_rows"] > 0 and not (engine_b.num_queued or engine_b.num_in_flight)
  carried = 0     # samples in flight at the save point that hold tokens of more than one version
  for ro in (o.rollout for o in outs_a):
    for b, sample_id in enumerate(ro.sample_id_b):
      start, n = int(ro.prompt_len_b[b]), int(ro.response_len_b[b])
      carried += sample_id in saved_in_flight and len(set(ro.version_bt[b, start:start + n])) > 1
  assert carried >= 1


def test_rows_another_process_holds_are_filled_before_a_save():
  """``local_rows``: a finished row whose response another process holds is blank here (prompt and lengths
  only). Its oldest version still comes from the control numbers (``RunResult.min_version_b``,
  ``group_min_versions``), ``state_dict`` refuses while it is blank, and ``hold_finished`` fills it. The
  engine side in one process: rows are blanked here by hand, and ``fill`` hands back the real ones (the
  exchange that fills them between processes, ``processes.fill_rows``, is multihost_test's)."""
  engine, first = first_run()
  assert engine.num_unreturned >= 1
  state, versions = engine.state_dict(), engine.group_min_versions()
  done = sorted(engine._finished, key=lambda f: f.order)
  real = engine_lib._stack([f.row for f in done], SPEC.seq_len)
  blanked = []
  for f in done[::2]:
    p, n = int(f.row["prompt_len_s"]), int(f.row["response_len_s"])
    f.row = {**f.row, "tokens_st": f.row["tokens_st"].copy(), "logp_st": f.row["logp_st"].copy(),
             "version_st": f.row["version_st"].copy()}
    f.row["tokens_st"][p:p + n], f.row["logp_st"][p:p + n], f.row["version_st"][p:p + n] = 0, 0.0, -1
    f.held = False
    blanked.append(int(f.row["sample_id_s"]))
  for f in done:        # read by process: what every process decides hold_finished on
    f.by_process = True
  assert engine.group_min_versions() == versions
  with pytest.raises(RuntimeError, match="hold_finished"):
    engine.state_dict()
  newer = lambda rollout: real.replace(version_bt=np.where(real.version_bt >= 0, real.version_bt + 1, -1))
  with pytest.raises(AssertionError, match="control numbers"):
    engine.hold_finished(newer)
  for f in done[::2]:
    f.held = False
  for f in done:
    f.by_process = True
  seen = []
  assert engine.hold_finished(lambda rollout: seen.append(rollout.sample_id_b.tolist()) or real) == len(blanked)
  assert seen == [[int(f.row["sample_id_s"]) for f in done]]
  filled = engine.state_dict()
  for key in state:
    np.testing.assert_array_equal(filled[key], state[key], err_msg=key)
  assert engine.hold_finished(lambda rollout: pytest.fail("every process holds every row")) == 0
  # A process holding every row still takes part in the exchange while another may not (a collective):
  # the decision follows what every process knows alike (rows read by process), not what it holds.
  for f in done:
    f.by_process = True
  assert engine.hold_finished(lambda rollout: seen.append(rollout.sample_id_b.tolist()) or real) == 0
  assert len(seen) == 2

  # The oldest version of each returned sample, as its row's versions say, also for samples carried over
  # a version change (tokens of versions 0 and 1).
  outs = [first] + later_runs(engine)
  for out in outs:
    ro = out.rollout
    by_row = [int(ro.version_bt[b, p:p + n].min()) if n else -1
              for b, (p, n) in enumerate(zip(ro.prompt_len_b, ro.response_len_b))]
    assert out.min_version_b.tolist() == by_row
  ro = outs[1].rollout
  assert any({0, 1} <= set(ro.version_bt[b, p:p + n].tolist())
             for b, (p, n) in enumerate(zip(ro.prompt_len_b, ro.response_len_b)))


def test_load_checks_config_and_freshness():
  engine, _ = first_run()
  state = npz_round_trip(engine.state_dict())
  for kw, field in ((dict(seed=1), "seed"), (dict(group_size=1), "group_size"),
                    (dict(spec=GenerateSpec(CFG, SamplingParams(1.0), P, N + 2, EOS)), "seq_len"),
                    (dict(spec=GenerateSpec(CFG, SamplingParams(0.5), P, N, EOS)), "temperature")):
    with pytest.raises(ValueError, match=field):
      make_engine(**kw).load_state_dict(state)
  with pytest.raises(ValueError, match="num_slots"):    # 4 slots over 4 batch shards < the in-flight samples
    make_engine(mesh_cfg=MeshConfig(data=2, fsdp=2, tensor=2), num_slots=4).load_state_dict(state)
  with pytest.raises(ValueError, match="fresh"):
    engine.load_state_dict(state)
  other = make_engine(chunk_steps=5)    # scheduling fields may differ
  other.load_state_dict(state)
  assert other.group_ids() == engine.group_ids() and other.num_in_flight == engine.num_in_flight


def versions_of(out):
  """Per returned group, the oldest version among its generated tokens."""
  ro, oldest = out.rollout, {}
  for b, g in enumerate(out.group_id_b.tolist()):
    start, n = int(ro.prompt_len_b[b]), int(ro.response_len_b[b])
    oldest[g] = min(oldest.get(g, 1 << 30), int(ro.version_bt[b, start:start + n].min()))
  return oldest


def test_finish_groups_waits_and_returns_every_complete_group():
  # Forced lengths (EOS ignored) make the schedule exact; chunk_steps=3, queue empty after each refill.
  engine = make_engine(chunk_steps=3)
  engine.add(requests((2, 2, 2, 3, 8, 8, 10, 10)))     # groups 0..3
  # All 8 start in one refill (rows of 8 over the 8 devices). Plain target: the chunk ends at step 2,
  # where group 0 (2, 2) completes; sample 2 finished with it, sample 3 (3) has 2 tokens.
  first = engine.run(params(0), 5, target_groups=1)
  assert first.group_id_b.tolist() == [0, 0] and first.stats["decode_steps"] == 2
  assert engine.group_min_versions() == {1: 5, 2: 5, 3: 5}
  engine.add(requests((10, 10), first_id=8))            # group 4, queued: no token yet
  assert engine.group_ids() == [1, 2, 3, 4] and engine.group_min_versions()[4] is None

  with pytest.raises(ValueError, match=r"\[7, 9\]"):
    engine.run(params(1), 7, target_groups=1, finish_groups=[7, 2, 9])
  for kw in (dict(finish_groups=[2]), dict(target_samples=1, finish_groups=[2])):
    with pytest.raises(ValueError, match="finish_groups needs target_groups"):
      engine.run(params(1), 7, **kw)

  # Group 4 fills two free slots; group 1 completes at step 1 (sample 3's third token), and the run
  # waits for group 2 (8 - 2 = 6 more steps: chunks of 3 and 3, ending right there) and returns both,
  # in completion order.
  second = engine.run(params(1), 7, target_groups=1, finish_groups={2})
  assert second.group_id_b.tolist() == [1, 1, 2, 2] and second.rollout.sample_id_b.tolist() == [2, 3, 4, 5]
  assert second.stats["decode_steps"] == 6 and second.stats["decode_chunks"] == 2
  # The per-chunk sums the simulator's fit reads: two chunks of 3 steps each, the refill in the first.
  assert second.stats["chunk_steps_sq"] == 3 * 3 + 3 * 3 and second.stats["chunk_s"] > 0
  assert second.stats["chunk_steps_x_s"] == pytest.approx(3 * second.stats["chunk_s"])
  assert second.stats["chunk_steps_x_refills"] == 3 * second.stats["refill_prefills"] > 0
  assert versions_of(second) == {1: 5, 2: 5}
  np.testing.assert_array_equal(second.rollout.version_bt[2:, :P + 8].max(axis=1), 7)
  assert engine.group_min_versions() == {3: 5, 4: 7} and engine.num_in_flight == 4

  # An empty finish set: two complete groups, then every complete group comes back (group 3 needs 10 - 8
  # = 2 more steps, group 4 10 - 6 = 4).
  third = engine.run(params(2), 9, target_groups=2, finish_groups=())
  assert third.group_id_b.tolist() == [3, 3, 4, 4] and third.stats["decode_steps"] == 4
  assert versions_of(third) == {3: 5, 4: 7} and engine.group_min_versions() == {}

  engine.add([Request(20, 9, [3])])                    # 1 of group_size=2 samples: can never complete
  with pytest.raises(ValueError, match="never complete"):
    engine.run(params(2), 9, target_groups=1, finish_groups=[9])


def test_a_chunk_fetches_flags_and_finished_rows_not_the_slot_state(monkeypatch):
  # Per chunk the host reads [S] flags, lengths and sample ids, the finished samples' ids and batch shards
  # [O] (O = S + the S uploaded requests), each shard's row and column counts [R] and scalar counters; the
  # finished samples only as blocks [1, W, size] of one shard's bytes of their packed numbers and responses,
  # never a [S, T] field nor a padded [O, 3T + 4] row. The oldest version of each in-flight sample, kept on
  # the host, equals the one in the slot state.
  fetched = []
  real_get = jax.device_get
  monkeypatch.setattr(jax, "device_get", lambda x: fetched.append(jax.tree.leaves(x)) or real_get(x))
  mesh_cfg = MeshConfig(data=2, fsdp=2, tensor=2)     # 4 batch shards of 2 slots
  engine = make_engine(mesh_cfg=mesh_cfg)
  engine.add(requests(FORCED))
  stats = [engine.run(jax.device_put(params(version), setup(mesh_cfg)[1]), version, target_groups=1).stats
           for version in (0, 1)]
  seq_len = SPEC.seq_len
  width = slots.wire_format(SPEC.model.vocab_size, SPEC.seq_len)[2]
  blocks = [(1, width, size) for size in slots.PACK_BLOCKS]
  shapes = [tuple(x.shape) for leaves in fetched for x in leaves]
  assert (1, width, slots.PACK_BLOCKS[-1]) in shapes
  assert all(s in ((), (4,), (8,), (16,), *blocks) for s in shapes), shapes
  # The bytes counted are the bytes fetched, against padded rows of the same samples (3 x T + 4 int32).
  fetched_rows = sum(x.nbytes for leaves in fetched for x in leaves if x.shape in blocks)
  assert sum(st["link_bytes/engine_to_host"] for st in stats) == fetched_rows
  finished = sum(st["returned"] for st in stats) + engine.num_unreturned
  assert sum(st["link_bytes/engine_to_host_padded"] for st in stats) == finished * (3 * seq_len + 4) * 4
  monkeypatch.setattr(jax, "device_get", real_get)
  host = jax.device_get(engine._state)
  for s, request in enumerate(engine._occupant):
    if request is not None:
      start, length = int(host.prompt_len_s[s]), int(host.response_len_s[s])
      oldest = int(host.version_st[s, start:start + length].min()) if length else None
      assert engine._min_version_s[s] == oldest and length == engine._response_len_s[s]
      assert request.sample_id == host.sample_id_s[s]
  assert engine.num_in_flight and {1, 0} & set(engine._min_version_s)
  # Rows packed on the device (what a chunk hands over) unpack to exactly the slot state's rows, dtypes
  # included; the blocks cover [0, n) with fewer than the small block's size beyond it.
  for n in (1, 63, 64, 1023, 1024, 1100, 2100):
    starts = slots.block_starts(n)
    assert starts[0][0] == 0 and all(a + m == b for (a, m), (b, _) in zip(starts, starts[1:]))
    assert n <= starts[-1][0] + starts[-1][1] < n + slots.PACK_BLOCKS[-1]
  live = [s for s, r in enumerate(engine._occupant) if r is not None]
  outbox = slots.pack_rows(host)[np.asarray(live)]
  vocab = SPEC.model.vocab_size
  flat, columns = jax.device_get(slots.pack_finished(outbox, len(live), SPEC.max_new_tokens, jnp.int32(1), vocab))
  k = len(live)
  assert flat.dtype == np.uint8 and flat.shape[0] == width
  assert columns == k + host.response_len_s[live].sum() and not flat[:, columns:].any()
  unpacked = slots.unpack_finished(flat[:, :columns], k, 1, vocab, seq_len)
  rows = engine_lib._unpack_rows(*unpacked, [engine._occupant[s] for s in live], seq_len)
  for s, row in zip(live, rows):
    for name, value in row.items():
      np.testing.assert_array_equal(value, getattr(host, name)[s], err_msg=name)
      assert np.asarray(value).dtype == getattr(host, name).dtype, name


_COLLECTIVE = re.compile(r"= (\(?[^=]*?\)?) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
                         r"(-start)?\(")


def test_finished_rows_stay_on_the_shard_that_generated_them(monkeypatch):
  # The chunk program moves no finished row between devices: every collective in it carries flags,
  # counters, sample ids or completion orders, never a [.., 3T + 4] slot row nor packed bytes. Each shard's
  # packed buffer, read from its own devices, holds exactly the rows of the samples that finished there.
  mesh_cfg = MeshConfig(data=2, fsdp=2, tensor=2)     # 4 batch shards of 2 slots, each on 2 devices
  engine = make_engine(mesh_cfg=mesh_cfg)
  abstract, outs = [], []
  real = engine.programs.chunk
  spec_of = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x

  def chunk(*args):
    abstract.append(jax.tree.map(spec_of, args))
    out = real(*args)
    outs.append(out[2:8])    # packed bytes [R, W, C], sample ids, shards, lengths [O], rows [R], columns [R]
    return out

  monkeypatch.setattr(engine.programs, "chunk", chunk)
  engine.add(requests(FORCED))
  result = engine.run(jax.device_put(params(0), setup(mesh_cfg)[1]), 0, target_groups=1)
  monkeypatch.undo()
  hlo = real.lower(*abstract[0]).compile().as_text()
  collectives = [m.group(1) for m in _COLLECTIVE.finditer(hlo)]
  assert collectives, "the chunk program has no collective at all: the pattern no longer matches XLA's text"
  row = 3 * SPEC.seq_len + 4
  assert not [c for c in collectives if re.search(rf"[,\[]{row}\]", c) or "u8[" in c], collectives

  rows = [jax.tree.map(lambda x: x[i], result.rollout) for i in range(len(result.group_id_b))]
  rows += [engine_lib._stack([f.row], SPEC.seq_len) for f in engine._finished]
  rows = {int(r.sample_id_b.reshape(-1)[0]): jax.tree.map(lambda x: np.asarray(x).reshape(-1), r) for r in rows}
  seen = {}
  for c, (flat, out_ids, out_shard, out_len, out_n, columns) in enumerate(outs):
    assert flat.sharding.spec[0] == ("data", "fsdp") and flat.shape[0] == 4
    finished = int(np.sum(out_n))
    for shard in flat.addressable_shards:    # 8 devices: each shard's bytes on its 2 tensor devices
      r = shard.index[0].start
      k, n = int(out_n[r]), int(columns[r])
      ids = [int(i) for i, s in zip(np.asarray(out_ids)[:finished], np.asarray(out_shard)[:finished]) if s == r]
      assert len(ids) == k
      meta, tokens, _, _ = slots.unpack_finished(np.asarray(shard.data)[0][:, :n], k, 0, SPEC.model.vocab_size,
                                                 SPEC.seq_len)
      want = [rows[i] for i in ids]
      np.testing.assert_array_equal(meta[:, 2], [w.response_len_b[0] for w in want])
      # What every host is told of each finished sample: 2 x response length + finished flag.
      codes = [int(x) for x, s in zip(np.asarray(out_len)[:finished], np.asarray(out_shard)[:finished]) if s == r]
      assert codes == [2 * int(w.response_len_b[0]) + int(w.finished_b[0]) for w in want]
      np.testing.assert_array_equal(tokens, np.concatenate(
          [w.tokens_bt[w.prompt_len_b[0]:w.prompt_len_b[0] + w.response_len_b[0]] for w in want] or [[]]))
      seen[(c, r)] = ids
  # Every finished sample came from exactly one shard, and more than one shard finished samples.
  ids = [i for part in seen.values() for i in part]
  assert sorted(ids) == sorted(rows) and sum(bool(part) for part in seen.values()) > 1


@pytest.mark.parametrize("vocab_size,seq_len", [(100, 40), (2 ** 16 + 7, 300)])
def test_packed_bytes_round_trip(vocab_size, seq_len):
  # Outbox rows (3T + 4 int32: tokens, log-prob bits, versions, finished, prompt / response length, id)
  # -> pack_finished's bytes -> unpack_finished: every response token's id, log-prob bits and version and
  # every row's numbers come back exactly, in the widths wire_format gives.
  rng = np.random.default_rng(0)
  rows, version = 5, 9
  prompt = rng.integers(1, seq_len // 2, rows)
  response = np.minimum(rng.integers(0, seq_len // 2, rows), seq_len - prompt)
  t = np.arange(seq_len)[None]
  inside = (t >= prompt[:, None]) & (t < (prompt + response)[:, None])
  tokens = np.where(inside, rng.integers(0, vocab_size, (rows, seq_len)), 0).astype(np.int32)
  logp = np.where(inside, -rng.exponential(3.0, (rows, seq_len)), 0).astype(np.float32)
  versions = np.where(inside, rng.integers(version - 3, version + 1, (rows, seq_len)), -1).astype(np.int32)
  meta = np.stack([rng.integers(0, 2, rows), prompt, response, np.arange(rows)], 1).astype(np.int32)
  outbox = np.concatenate([tokens, logp.view(np.int32), versions, meta], axis=1)
  flat, columns = jax.device_get(slots.pack_finished(jnp.asarray(outbox), rows, seq_len, jnp.int32(version),
                                                     vocab_size))
  token_bytes, length_bytes, width = slots.wire_format(vocab_size, seq_len)
  assert (token_bytes, length_bytes) == ((1, 1) if vocab_size == 100 else (3, 2)) and flat.shape[0] == width
  assert columns == rows + response.sum()
  meta_k3, tok, lp, ver = slots.unpack_finished(flat[:, :columns], rows, version, vocab_size, seq_len)
  np.testing.assert_array_equal(meta_k3, meta[:, :3])
  np.testing.assert_array_equal(tok, tokens[inside])
  np.testing.assert_array_equal(lp.view(np.int32), logp[inside].view(np.int32))
  np.testing.assert_array_equal(ver, versions[inside])
