"""Tables 1 and 2 at cluster scale and the sensitivity sweep, from ``cluster.py``'s inputs (no JAX).

  * Table 1 (one supernode): the four schedules (separated / colocated x sync / StaleSync s = 1), each
    replayed by ``schedules.simulate`` with ``cluster.costs``;
  * Table 2 (1, 2 and 4 supernodes, weak scaling): colocated sync and StaleSync, the one-supernode replay's
    step plus what grows with the supernodes (``cluster.scaled``: tail barrier, all-reduce, weight
    publication, DistQueue traffic, stragglers), and as a check of the barrier the engine replayed at N
    supernodes (which holds the tail of more draws but none of the cross-supernode terms);
  * the sweep: Table 2's linearity for each value of the inputs that change it, and the terms that cannot
    (their seconds against the step's).
``quick``: ``cluster.QUICK_WORK``, fewer replayed steps and one value per swept input (a check that the code
runs, not a result).
"""
from __future__ import annotations

import dataclasses
import functools

from rl_fusion_jax.sim import cluster, schedules

VARIANTS = {   # name -> (mode, s, f)
    "separated_sync": ("separated", 0, 1.0),
    "separated_stalesync": ("separated", 1, 1.0),
    "colocated_sync": ("colocated", 0, 1.0),
    "colocated_stalesync": ("colocated", 1, 0.5),
}
SCALED = ("colocated_sync", "colocated_stalesync")
NODES = (1, 2, 4)
# The reference system's reported figures (the RL Fusion / StaleSync / DistQueue design this project
# implements): throughput against its separated baseline, and tokens/s on 1 and 4 supernodes.
REFERENCE = {"fusion_vs_separated": 1.785, "fusion_stalesync_vs_separated": 2.5,
             "linearity_4_nodes_sync": 85 / (25 * 4), "linearity_4_nodes_stalesync": 127 / (35 * 4)}


def _steps(quick: bool) -> tuple[int, int]:
  return (1, 3) if quick else (2, 6)


@functools.lru_cache(maxsize=None)
def _replay(c: cluster.Cluster, variant: str, quick: bool) -> dict:
  mode, s, f = VARIANTS[variant]
  warm, steps = _steps(quick)
  res = schedules.simulate(cluster.workload(c), cluster.schedule(c, mode, s, f), cluster.costs(c, mode),
                           warm + steps)
  lo, hi = res.window(warm)
  mean = lambda key: sum(getattr(r, key) for r in res.steps[warm:]) / steps
  return {"tokens_per_s": res.tokens_per_s(warm), "step_s": (hi - lo) / steps, "idle": res.idle_frac(warm),
          "decode_steps": sum(r.counts.decode_steps for r in res.steps[warm:]) / steps,
          "generate_s": mean("generate_s"), "train_s": mean("train_s"), "staleness": mean("staleness_mean"),
          "tokens": mean("train_tokens")}


def replay(c: cluster.Cluster, variant: str, quick: bool) -> dict:
  """One schedule replayed on ``c.nodes`` supernodes (the scaling inputs play no part: cached without)."""
  return _replay(dataclasses.replace(c, scaling=cluster.ScalingInputs()), variant, quick)


def table1(c: cluster.Cluster, quick: bool) -> dict:
  return {v: replay(c, v, quick) for v in VARIANTS}


def table2(c: cluster.Cluster, quick: bool, check: bool = True) -> dict:
  """Per scaled schedule: ``cluster.Scaled`` per supernode count, and the replay at each count."""
  out = {}
  for v in SCALED:
    base = replay(dataclasses.replace(c, nodes=1), v, quick)
    rows = {n: cluster.scaled(c, base["step_s"], base["tokens"], VARIANTS[v][1], n) for n in NODES}
    out[v] = {"scaled": rows, "linearity": {n: linearity(rows, n) for n in NODES},
              "replay_linearity": ({n: replay(dataclasses.replace(c, nodes=n), v, quick)["tokens_per_s"]
                                    / (n * base["tokens_per_s"]) for n in NODES} if check else {}),
              "longest": {n: cluster.longest(c, n) for n in NODES}}
  return out


def linearity(rows: dict, n: int) -> float:
  return rows[n].tokens_per_s / (n * rows[1].tokens_per_s)


def ratios(t1: dict, t2: dict) -> dict:
  base = t1["separated_sync"]["tokens_per_s"]
  return {"fusion_vs_separated": t1["colocated_sync"]["tokens_per_s"] / base,
          "fusion_stalesync_vs_separated": t1["colocated_stalesync"]["tokens_per_s"] / base,
          "separated_stalesync_vs_separated": t1["separated_stalesync"]["tokens_per_s"] / base,
          "linearity_4_nodes_sync": t2["colocated_sync"]["linearity"][4],
          "linearity_4_nodes_stalesync": t2["colocated_stalesync"]["linearity"][4]}


# ------------------------------------------------------------------------------------------------ sweep


def _set(path: str):
  """A function (cluster, value) -> cluster with the field at ``path`` ('tp', 'work.sigma') replaced."""
  def apply(c, value):
    if "." not in path:
      return dataclasses.replace(c, **{path: value})
    part, field = path.split(".")
    return dataclasses.replace(c, **{part: dataclasses.replace(getattr(c, part), **{field: value})})
  return apply


def _cap(c, factor):
  return _set("work.max_len")(c, int(c.work.max_len * factor))


def _slots(c, fraction):
  per_replica = c.work.samples_per_node / (c.hw.devices_per_node // c.tp)
  return dataclasses.replace(c, slots_per_replica=max(1, round(fraction * per_replica)))


# (input, values, apply, value label, also under an uncapped tail): the inputs that move Table 2's linearity.
# The split, the replica width and the slots act through the tail barrier, which is 0 when the cap binds
# at every scale (the default workload truncates ~1% of its samples): those rows are repeated under
# UNCAPPED_TAIL, where it does not.
SWEEP = (
    ("response-length sigma", (0.4, 0.9, 1.3), _set("work.sigma"), "{:g}", False),
    ("response-length cap x default", (0.5, 1.0, 2.0), _cap, "x{:g}", False),
    ("rollout / training split: passes over each batch", (1, 2, 4), _set("train_passes"), "{}", True),
    ("replica width (devices per generation replica)", (4, 8, 16), _set("tp"), "{}", True),
    ("slots per replica / samples per replica", (0.25, 0.5, 1.5), _slots, "{:g}", True),
    ("stragglers: P(a device is slow in a step), slowdown 0.5", (0.0, 1e-4, 1e-3), _set("scaling.straggler_prob"),
     "{:g}", False),
)
UNCAPPED_TAIL = ("sigma 0.4", _set("work.sigma"), 0.4)


def sweep(c: cluster.Cluster, quick: bool) -> list[dict]:
  """One row per input, value and tail of ``SWEEP`` (``quick``: each input's first value only)."""
  rows = []
  label, apply_tail, sigma = UNCAPPED_TAIL
  for name, values, apply, fmt, both in SWEEP:
    for tail, base in (("default", c),) + (((label, apply_tail(c, sigma)),) if both else ()):
      for value in values[:1] if quick else values:
        rows.append({"input": name, "value": fmt.format(value), "tail": tail, **_sweep_row(apply(base, value), quick)})
  return rows


def _sweep_row(c: cluster.Cluster, quick: bool) -> dict:
  t2 = table2(c, quick, check=False)
  sync = t2["colocated_sync"]["scaled"]
  base = replay(dataclasses.replace(c, nodes=1), "colocated_sync", quick)
  return {"generate_share": base["generate_s"] / base["step_s"], "longest_1": t2["colocated_sync"]["longest"][1],
          "longest_4": t2["colocated_sync"]["longest"][4],
          **{f"linearity_{n}_{k}": t2[v]["linearity"][n] for n in (2, 4)
             for v, k in zip(SCALED, ("sync", "stalesync"))},
          "stalesync_vs_sync_4": t2["colocated_stalesync"]["scaled"][4].tokens_per_s / sync[4].tokens_per_s}


def fixed_terms(c: cluster.Cluster) -> list[dict]:
  """The inputs that cannot move Table 2 here: their seconds per step on 4 supernodes, both settings."""
  q = lambda **kw: cluster.queue_traffic(dataclasses.replace(c, scaling=dataclasses.replace(c.scaling, **kw)), 4)
  fsdp = dataclasses.replace(c, scaling=dataclasses.replace(c.scaling, fsdp_across_nodes=True))
  slow = dataclasses.replace(c, hw=dataclasses.replace(c.hw, inter_bw=c.hw.inter_bw / 4))
  return [
      {"term": "DistQueue reads, packed, one per group", "seconds": q(packed=True, hierarchical=True)["seconds"]},
      {"term": "DistQueue reads, padded, one per device", "seconds": q(packed=False, hierarchical=False)["seconds"]},
      {"term": "weight publication, hybrid sharding", "seconds": cluster.publish_s(c, 4)},
      {"term": "weight publication, FSDP over every device", "seconds": cluster.publish_s(fsdp, 4)},
      {"term": "gradient all-reduce across supernodes", "seconds": cluster.allreduce_s(c, 4)},
      {"term": "gradient all-reduce, inter-supernode bandwidth / 4", "seconds": cluster.allreduce_s(slow, 4)}]


# --------------------------------------------------------------------------------------------- markdown


def markdown(c: cluster.Cluster, t1: dict, t2: dict, sw: list[dict], quick: bool) -> str:
  r = ratios(t1, t2)
  base = t1["separated_sync"]["tokens_per_s"]
  lines = [f"#### Simulated Table 1: one supernode ({c.hw.devices_per_node} devices)"
           + (" (quick workload)" if quick else ""), "",
           "| variant | trained tok/s | x separated sync | step | generate | train | decode steps / step | "
           "idle per lane | token staleness |", "|" + "---|" * 9]
  for v, x in t1.items():
    idle = ", ".join(f"{g} {f:.0%}" for g, f in x["idle"].items())
    lines.append(f"| {v} | {x['tokens_per_s']:,.0f} | {x['tokens_per_s'] / base:.2f} | {x['step_s']:.0f} s | "
                 f"{x['generate_s']:.0f} s | {x['train_s']:.0f} s | {x['decode_steps']:,.0f} | {idle} | "
                 f"{x['staleness']:.2f} |")
  lines += ["", f"Reference system: RL Fusion x{REFERENCE['fusion_vs_separated']:.3f}, RL Fusion + StaleSync "
            f"x{REFERENCE['fusion_stalesync_vs_separated']:.1f}; simulated x{r['fusion_vs_separated']:.2f} and "
            f"x{r['fusion_stalesync_vs_separated']:.2f}.", ""]
  lines += table2_markdown(c, t2) + [""] + sweep_markdown(c, sw) + [""]
  lines += ["#### Cluster inputs and their sources", "", "| input | value | source |", "|---|---|---|"]
  lines += [f"| {n} | {v} | {d} |" for n, v, d in cluster.input_table()]
  return "\n".join(lines)


def table2_markdown(c: cluster.Cluster, t2: dict) -> list[str]:
  lines = ["#### Simulated Table 2: 1, 2 and 4 supernodes (weak scaling, colocated)", "",
           "| schedule | supernodes | trained tok/s | linearity | step | one-supernode step | tail barrier | "
           "all-reduce | weight publication | DistQueue | straggler factor | expected longest response | "
           "engine replayed at N supernodes: linearity |", "|" + "---|" * 13]
  ms = lambda x: f"{1e3 * x:,.1f} ms"
  for v, x in t2.items():
    for n, s in x["scaled"].items():
      check = x["replay_linearity"].get(n)
      lines.append(f"| {v} | {n} | {s.tokens_per_s:,.0f} | {x['linearity'][n]:.1%} | {s.step_s:.1f} s | "
                   f"{s.base_s:.1f} s | {s.barrier_s:.2f} s | {ms(s.allreduce_s)} | {ms(s.publish_s)} | "
                   f"{ms(s.queue_s)} | {s.straggler:.3f} | {x['longest'][n]:,.0f} | "
                   f"{'-' if check is None else f'{check:.1%}'} |")
  sync, stale = (t2[v]["linearity"][4] for v in SCALED)
  lines += ["", f"Predicted linearity on 4 supernodes: sync {sync:.1%}, StaleSync {stale:.1%} (reference system: "
            f"{REFERENCE['linearity_4_nodes_sync']:.0%} and {REFERENCE['linearity_4_nodes_stalesync']:.0%}). The "
            "last column replays the engine and schedule on N supernodes (more draws, none of the "
            "cross-supernode terms): it checks the tail barrier, whose expected value the table uses."]
  return lines


def sweep_markdown(c: cluster.Cluster, sw: list[dict]) -> list[str]:
  lines = ["#### What moves Table 2: linearity per input value (the others at their defaults)", "",
           "| input | value | length distribution | generate share of the sync step | expected longest, 1 / 4 "
           "supernodes | sync linearity at 2 / 4 | StaleSync linearity at 2 / 4 | StaleSync / sync at 4 |",
           "|" + "---|" * 8]
  for r in sw:
    lines.append(f"| {r['input']} | {r['value']} | {r['tail']} | {r['generate_share']:.0%} | {r['longest_1']:,.0f} / "
                 f"{r['longest_4']:,.0f} | {r['linearity_2_sync']:.1%} / {r['linearity_4_sync']:.1%} | "
                 f"{r['linearity_2_stalesync']:.1%} / {r['linearity_4_stalesync']:.1%} | "
                 f"x{r['stalesync_vs_sync_4']:.2f} |")
  lines += ["", "What cannot move it here: seconds per step on 4 supernodes, against a step of tens to hundreds "
            "of seconds.", "", "| term | per step |", "|---|---|"]
  lines += [f"| {r['term']} | {1e3 * r['seconds']:.3g} ms |" for r in fixed_terms(c)]
  return lines


# ------------------------------------------------------------------------------------------- validation


def _pct(x) -> str:
  return "-" if x is None else f"{x:+.1%}"


def validation_markdown(v: dict, tolerance: float) -> str:
  """``fit.validate_manifest``'s checks: the held-out (cross-schedule) predictions first, per run and the
  largest per workload, deployment and schedule, then the in-sample fit, labelled as such."""
  from rl_fusion_jax.sim import fit  # pylint: disable=g-import-not-at-top
  worst = fit.worst_held_out(v)
  lines = ["#### Held out: fitted on one schedule's runs, predicting the other's (cross-schedule)", "",
           "| workload | deployment | predicted | fitted on | runs | largest step-time error | largest tok/s error |"
           " within " + f"{tolerance:.0%} (step time) | repeats' floor | paired by repeat: largest step-time error |",
           "|" + "---|" * 10]
  for w in worst:
    paired = w.get("max_paired_step_error")
    lines.append(f"| {w['workload']} | {w['mode']} | {w['predicted']} | {w['fitted_on']} | {w['runs']} | "
                 f"{w['max_step_error']:.1%} | {w['max_tokens_error']:.1%} | "
                 f"{'yes' if w['max_step_error'] <= tolerance else 'NO'} | {w['repeat_floor']:.1%} | "
                 f"{'-' if paired is None else f'{paired:.1%}'} |")
  lines += ["", "The repeats' floor: the smallest largest step-time error that any one value per variant could "
            "have against that variant's repeats, (max - min) / (max + min) of their measured step times (the "
            "largest over the group's variants). Where a variant's repeats make the same counts, a model that "
            "predicts from counts gives them one value and cannot beat this floor; the floor says nothing of how "
            "close this model comes. Paired by repeat: the costs fitted on the other schedule's run of the same "
            "repeat only (made in the same interleaved round, minutes apart: a drift of the machine's speed "
            "between rounds reaches both, one within a round need not); still held out."]
  lines += ["", "| workload | variant | repeat | fitted on | step measured / predicted | error | tok/s measured / "
            "predicted | error | idle measured / predicted | paired by repeat: step predicted, error |",
            "|" + "---|" * 10]
  for c in v["checks"]:
    x, p = c["held_out"], c.get("held_out_paired")
    if x:
      lines.append(f"| {c['workload']} | {c['variant']} | {c['repeat']} | {c['fitted_on']} | "
                   f"{c['measured_step_s']:.3f} / {x['simulated_step_s']:.3f} s | {_pct(x['step_error'])} | "
                   f"{c['measured_tokens_per_s']:,.0f} / {x['simulated_tokens_per_s']:,.0f} | "
                   f"{_pct(x['tokens_error'])} | {_idle(c, x)} | "
                   + ("-" if not p else f"{p['simulated_step_s']:.3f} s, {_pct(p['step_error'])}") + " |")
  lines += ["", "#### In-sample: fitted on all runs of the workload and deployment, this one included", "",
            "In-sample errors say how well the cost model can describe these runs, not how well it predicts.", "",
            "| workload | variant | repeat | step measured / simulated | error | tok/s measured / simulated | "
            "error | decode steps measured / simulated | idle measured / simulated |", "|" + "---|" * 9]
  for c in v["checks"]:
    x = c["in_sample"]
    lines.append(f"| {c['workload']} | {c['variant']} | {c['repeat']} | {c['measured_step_s']:.3f} / "
                 f"{x['simulated_step_s']:.3f} s | {_pct(x['step_error'])} | {c['measured_tokens_per_s']:,.0f} / "
                 f"{x['simulated_tokens_per_s']:,.0f} | {_pct(x['tokens_error'])} | "
                 f"{c['measured_decode_steps']:.0f} / {x['simulated_decode_steps']:.0f} | {_idle(c, x)} |")
  return "\n".join(lines)


def _idle(c: dict, x: dict) -> str:
  sim = x["simulated_idle"]
  return "; ".join(f"{g} {c['measured_idle'][g]:.0%} / {sim.get(g if g in sim else 'all', 0):.0%}"
                   for g in c["measured_idle"])


def sharing_markdown(rows: list[dict]) -> str:
  """The separated deployment's held-out errors under other thread counts of ``costs.Sharing``."""
  lines = ["#### Separated deployment: held-out error against the processor-sharing thread counts", "",
           "| threads: generation / update / push | largest held-out step-time error per workload and predicted "
           "schedule |", "|---|---|"]
  for r in rows:
    lines.append(f"| {r['threads']}{' (used)' if r['used'] else ''} | " + ", ".join(
        f"{w['workload']} {w['predicted']} {w['max_step_error']:.1%}" for w in r["worst"]) + " |")
  return "\n".join(lines)
