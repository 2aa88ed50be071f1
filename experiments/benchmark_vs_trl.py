r"""The project's GRPO step against TRL's GRPOTrainer on the same workload, taking turns in one run.

  python experiments/benchmark_vs_trl.py --trl_python=/work/trl_venv/bin/python --rounds=3 --steps=5 \
      --out=/tmp/vs_trl.json
  python experiments/benchmark_vs_trl.py --config=experiments/configs/smollm2_word_problems.py \
      --trl_python=/work/trl_venv/bin/python --rounds=3 --steps=1 --warmup_steps=1

The TRL side runs in its own Python environment (torch, transformers, trl, datasets, accelerate; the
``trl_bench`` extra of setup.py), which --trl_python (default: $TRL_PYTHON) names; the project never
imports torch. Results and the command's output are in BENCHMARKS.md, "Against TRL (tiny-grpo)" and
"GRPO against TRL on SmolLM2-135M-Instruct".

From --config (default tiny_grpo) this binary writes a workload file: the model (a random init as a
Hugging Face config dict with the char tokenizer, or the checkpoint folder of ``model.hf_path`` with its
own tokenizer, e.g. smollm2_word_problems.py), the rollout / loss / optimizer settings, the reward
weights, the prompts the project's loop draws, in its order, with their answers and token counts (chat
prompts also as their messages and the project's ids), and completions with the project's reward for
them. ``trl_tiny_grpo.py --check`` checks the TRL side against those ids and rewards. Then two long-lived
processes take turns (experiments/turns.py): experiments/benchmark_main.py on the config and
experiments/trl_tiny_grpo.py on the workload. Each starts and runs its first and --warmup_steps steps
alone; then for each of --rounds rounds each side runs --steps measured steps while the other waits
(the side that goes first alternates), so both see the same machine. Prints per-round and overall
medians of the step and its phases, the ratio ours / TRL, each side's first step (timed in its process,
compiles or lazy set-up included) with a 24-step run estimated from it (first step + 23 medians), and
float32 matmul rates at the workload's
shapes in JAX (this process: one device, and the rows split over the config's devices) and torch (the
TRL environment), a ceiling to read the phases against. --out writes all of it as JSON, including every
measured step and the 1-minute load average after each round (the machine may be shared).
--matmul_only measures only the matmul rates.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags

import common
import turns

HERE = os.path.dirname(os.path.abspath(__file__))

_CONFIG = flags.DEFINE_string("config", os.path.join(HERE, "configs", "tiny_grpo.py"),
                              "Experiment config file (optionally :variant) of both sides.")
_TRL_PYTHON = flags.DEFINE_string("trl_python", os.environ.get("TRL_PYTHON", ""),
                                  "Python of the environment with torch and trl.")
_TRL_THREADS = flags.DEFINE_integer("trl_threads", 0,
                                    "torch intra-op threads of the TRL side (0: one per CPU).")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds; each side runs --steps measured steps per round.")
_STEPS = flags.DEFINE_integer("steps", 5, "Measured steps per side per round.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 2, "Unmeasured steps per side after its first one.")
_WORKDIR = flags.DEFINE_string("workdir", "", "Folder for the workload file and the sides' logs "
                               "(default: a new temp dir).")
_OUT = flags.DEFINE_string("out", "", "Write every figure as JSON here.")
_OURS_FLAGS = flags.DEFINE_multi_string(
    "ours_flag", [], "Extra flag for the project's side, e.g. --ours_flag=--config.model.dtype=float32 "
    "(repeatable).")
_TRL_BF16 = flags.DEFINE_bool("trl_bf16", False, "TRL side with bf16=True (torch autocast to bfloat16 on "
                              "CPU; float32 weights and optimizer).")
_MATMUL_ONLY = flags.DEFINE_bool("matmul_only", False, "Only measure the matmul rates (JAX and torch).")
_WRITE_WORKLOAD = flags.DEFINE_string("write_workload", "", "Only write the workload file here and exit.")
_CACHE = flags.DEFINE_string("compilation_cache", "~/.cache/rl_fusion_jax/jax_cache",
                             "Persistent XLA compilation cache of the project's side ('' disables).")

OURS_PHASES = ("generate_s", "reward_s", "train_s", "switch_s", "other_s")
TRL_PHASES = ("generate_s", "hf_generate_s", "reward_s", "prepare_s", "update_s", "other_s")


def load_config():
  """The typed experiment config of --config."""
  import runpy  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  path, _, variant = _CONFIG.value.partition(":")
  return config_lib.experiment_from_dict(runpy.run_path(path)["get_config"](variant))


def matmul_shapes(cfg) -> list[list[int]]:
  """[M, K, N] of the main matmuls: the update's MLP and head over all B x (T - 1) positions, and one
  decode step's MLP over B rows."""
  m, r = cfg.model.config, cfg.rollout
  rows = r.batch_size * (r.seq_len - 1)
  return [[rows, m.hidden_size, m.intermediate_size], [rows, m.intermediate_size, m.hidden_size],
          [rows, m.hidden_size, m.vocab_size], [r.batch_size, m.hidden_size, m.intermediate_size]]


# Tasks whose verifier the TRL side reimplements (trl_tiny_grpo.py::make_reward): the reward kind of each.
REWARD_KINDS = {"arithmetic": "integer", "word_problems": "marked_number", "gsm8k": "marked_number"}


def workload(cfg, num_steps: int) -> dict:
  """Everything the TRL side needs to run the config's workload (see the module docstring).

  The model is either a random init (the config's architecture as a Hugging Face config dict, the char
  tokenizer) or the checkpoint folder of ``model.hf_path`` (weights and tokenizer read there by both
  sides); with ``task.prompt_format='chat'`` each prompt is its messages, which the TRL side renders with
  the folder's chat template, and the project's prompt ids, which the TRL side checks its rendering against.
  """
  from rl_fusion_jax import hf_config  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.orchestration import data, setup  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.tokenizer import CharTokenizer  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax import chat  # pylint: disable=g-import-not-at-top
  if cfg.task.name not in REWARD_KINDS:
    raise app.UsageError(f"--config: task {cfg.task.name!r}; the TRL side reimplements the verifiers of "
                         f"{sorted(REWARD_KINDS)} only")
  tokenizer, task, _, _ = setup.tokenizer_and_tasks(cfg)      # the loop's train task and tokenizer
  char = isinstance(tokenizer, CharTokenizer)
  if char == bool(cfg.model.hf_path):
    raise app.UsageError("--config: the TRL side runs the char tokenizer on a random init, or a checkpoint "
                         "folder (model.hf_path) with its own tokenizer")
  problems = [task.problem(i) for i in range(num_steps * cfg.rollout.num_prompts)]
  ids, lengths = data.encode_prompts(tokenizer, problems, cfg.rollout.max_prompt_len)
  rows = []
  for i, (p, n) in enumerate(zip(problems, lengths)):
    row = {"prompt": p.prompt, "answer": p.answer, "prompt_tokens": int(n)}
    if cfg.task.prompt_format == "chat":
      plain = task.task.problem(i)
      row["messages"] = chat.one_turn(plain.prompt.strip(), cfg.task.system_prompt)
      row["prompt_ids"] = [int(t) for t in ids[i, :n]]
    rows.append(row)
  if char:
    model = {"hf_config": hf_config.to_hf_dict(cfg.model.config), "init_std": cfg.model.init_std}
    tok = {"kind": "char", "alphabet": tokenizer.alphabet, "vocab_size": tokenizer.vocab_size,
           "pad_id": tokenizer.pad_id, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}
  else:
    model = {"hf_path": os.path.abspath(cfg.model.hf_path)}
    tok = {"kind": "hf", "path": os.path.abspath(cfg.task.tokenizer or cfg.model.hf_path),
           "pad_id": tokenizer.pad_id, "eos_id": tokenizer.eos_id}
  r, a, o = cfg.rollout, cfg.algo, cfg.optim
  verifier = getattr(task, "task", task)      # a ChatTask scores with the task it wraps
  return {
      "config": _CONFIG.value, "seed": cfg.run.seed, "model": model, "tokenizer": tok,
      "rollout": {k: getattr(r, k) for k in ("num_prompts", "group_size", "max_prompt_len", "max_new_tokens",
                                             "temperature", "top_k", "top_p")},
      "algo": {k: getattr(a, k) for k in ("advantage", "policy_loss", "aggregation", "clip_low", "clip_high",
                                          "kl_coef")},
      "optim": {k: getattr(o, k) for k in ("learning_rate", "b1", "b2", "weight_decay", "grad_clip",
                                           "warmup_steps")},
      "reward": {"kind": REWARD_KINDS[cfg.task.name], "format_reward": verifier.format_reward,
                 "correct_reward": verifier.correct_reward},
      "matmul_shapes": matmul_shapes(cfg), "problems": rows,
      "reward_checks": reward_checks(verifier, problems[:2]),
  }


def reward_checks(task, problems) -> list[dict]:
  """Completions with the project's reward for them (``task.score``), for the TRL side's verifier to
  reproduce (``trl_tiny_grpo.py --check``): right, wrong, unformatted and edge-case answers."""
  out = []
  for p in problems:
    a = p.answer
    for text in (a, f" {a} ", f"-{a}", f"{a}0", "x", f"The sum is {a}.\n#### {a}", f"#### {a}.0",
                 f"####  ${a}", f"#### {a}\n#### 0", "#### 1,000", f"{a}\n####", f"#### {'9' * 70}"):
      out.append({"completion": text, "answer": a, "reward": task.score(p, text).reward})
  return out


def jax_matmul_rates(shapes: list[list[int]], split_rows: bool, repeats: int = 20) -> list[dict]:
  """Median GFLOP/s of a jitted float32 [M, K] x [K, N] matmul per shape: on one device, or with the M
  rows split over every device (the data-parallel layout of the project's step)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  devices = jax.devices() if split_rows else jax.devices()[:1]
  mesh = Mesh(np.array(devices), ("rows",))
  out = []
  for m, k, n in shapes:
    a = jax.device_put(np.random.default_rng(0).standard_normal((m, k), np.float32),
                       NamedSharding(mesh, P("rows", None)))
    b = jax.device_put(np.random.default_rng(1).standard_normal((k, n), np.float32), NamedSharding(mesh, P()))
    seconds = common.median_seconds(jax.jit(jnp.matmul), a, b, repeats=repeats, warmup=3)
    out.append({"shape": [m, k, n], "devices": len(devices),
                "gflop_per_s": round(2 * m * k * n / seconds / 1e9, 1)})
  return out


def torch_matmul_rates(workload_path: str) -> dict:
  """torch's matmul rates at the workload's shapes, from the TRL environment (trl_tiny_grpo.py --matmul)."""
  args = [_TRL_PYTHON.value, os.path.join(HERE, "trl_tiny_grpo.py"), f"--workload={workload_path}",
          "--matmul", f"--threads={_TRL_THREADS.value}"]
  done = subprocess.run(args, capture_output=True, text=True, check=True)
  return summary_line(done.stdout.splitlines())


def matmul_rates(workload_path: str, shapes: list[list[int]]) -> dict:
  """GFLOP/s per shape: JAX on one device, JAX with the rows split over the devices, torch."""
  # After the table: about 2 minutes at SmolLM2-135M's shapes (its lm head among them, 2 cores): say so.
  print(f"measuring matmul GFLOP/s at the workload's {len(shapes)} shapes (torch, then JAX)...", flush=True)
  torch_rates = torch_matmul_rates(workload_path)
  rates = {"jax_1_device": jax_matmul_rates(shapes, False), "jax_rows_split": jax_matmul_rates(shapes, True),
           "torch": torch_rates["matmul"], "torch_threads": torch_rates["threads"]}
  print("matmul GFLOP/s [M, K, N]: JAX one device / JAX rows over the devices / torch: " + "; ".join(
      f"{j['shape']}: {j['gflop_per_s']} / {s['gflop_per_s']} / {t['gflop_per_s']}"
      for j, s, t in zip(rates["jax_1_device"], rates["jax_rows_split"], rates["torch"])))
  return rates


def ours_row(step: dict) -> dict:
  """A project step's seconds split as in the table: switch = both phase switches, other = the rest
  (host scoring is reward_s; batch assembly is inside train_s)."""
  switch = step.get("switch/to_generate/seconds", 0.0) + step.get("switch/to_train/seconds", 0.0)
  row = {k: step[k] for k in ("step_s", "generate_s", "reward_s", "train_s", "response_len_mean")}
  row["switch_s"] = switch
  row["other_s"] = step["step_s"] - step["generate_s"] - step["reward_s"] - step["train_s"] - switch
  return row


def medians(rows: list[dict], keys) -> dict:
  return {k: round(statistics.median(r[k] for r in rows), 4) for k in keys}


def start_sides(workload_path: str, workdir: str) -> dict[str, turns.Child]:
  """Both sides started one after the other, each through its first and warm-up steps alone."""
  total = _ROUNDS.value * _STEPS.value
  shared = [f"--steps={total}", f"--warmup_steps={_WARMUP.value}", f"--turn_steps={_STEPS.value}"]
  ours = [sys.executable, os.path.join(HERE, "benchmark_main.py"), f"--config={_CONFIG.value}",
          f"--compilation_cache={_CACHE.value}"] + list(_OURS_FLAGS.value) + shared
  trl = [_TRL_PYTHON.value, os.path.join(HERE, "trl_tiny_grpo.py"), f"--workload={workload_path}",
         f"--threads={_TRL_THREADS.value}"] + (["--bf16"] if _TRL_BF16.value else []) + shared
  sides = {}
  for name, args in (("ours", ours), ("trl", trl)):
    sides[name] = turns.Child(name, args, os.path.join(workdir, f"{name}.log"))
    sides[name].wait_turn()
    print(f"{name}: started and warmed up (log {sides[name].log_path})", flush=True)
  return sides


def run_rounds(sides: dict[str, turns.Child]) -> list[dict]:
  """Each round: one turn per side, the first side alternating; the measured steps of every turn."""
  rounds = []
  for k in range(_ROUNDS.value):
    order = ["ours", "trl"] if k % 2 == 0 else ["trl", "ours"]
    steps = {name: sides[name].next_turn()["steps"] for name in order}
    steps["ours"] = [ours_row(s) for s in steps["ours"]]
    rnd = {"order": order, "steps": steps, "load_avg_1m": round(os.getloadavg()[0], 2),
           "ours": medians(steps["ours"], ("step_s",) + OURS_PHASES),
           "trl": medians(steps["trl"], ("step_s",) + TRL_PHASES)}
    rnd["ratio"] = round(rnd["ours"]["step_s"] / rnd["trl"]["step_s"], 3)
    print(f"round {k + 1}/{_ROUNDS.value}: ours {rnd['ours']['step_s']:.3f} s, "
          f"TRL {rnd['trl']['step_s']:.3f} s, ratio {rnd['ratio']:.3f} (load {rnd['load_avg_1m']})",
          flush=True)
    rounds.append(rnd)
  return rounds


def summary_line(lines: list[str]) -> dict:
  """The last line of a child's stdout that is a JSON object (the trainer also prints Python dicts)."""
  for line in reversed(lines):
    try:
      value = json.loads(line)
    except ValueError:
      continue
    if isinstance(value, dict):
      return value
  raise RuntimeError(f"no JSON summary line in {lines[-5:]}")


def table(result: dict) -> str:
  """Markdown: per-round and overall medians, each side's phases."""
  out = ["| | ours step | generate | reward | train | switch | other | TRL step | generate (hf generate) "
         "| reward | prepare | update | other | ours / TRL |", "|" + "---|" * 14]
  def line(name, o, t, ratio):
    ours = " | ".join(f"{o[k]:.3f}" for k in ("step_s",) + OURS_PHASES)
    trl = (f"{t['step_s']:.3f} | {t['generate_s']:.3f} ({t['hf_generate_s']:.3f}) | "
           + " | ".join(f"{t[k]:.3f}" for k in ("reward_s", "prepare_s", "update_s", "other_s")))
    return f"| {name} | {ours} | {trl} | {ratio:.3f} |"
  for k, rnd in enumerate(result["rounds"]):
    out.append(line(f"round {k + 1} ({' then '.join(rnd['order'])})", rnd["ours"], rnd["trl"], rnd["ratio"]))
  out.append(line("**all steps (median)**", result["ours"], result["trl"], result["ratio"]))
  return "\n".join(out)


def main(argv):
  del argv
  cfg = load_config()
  # Before JAX starts: the matmul ceilings use the project's device count (the children inherit the flag).
  common.setup_jax(cfg.mesh.cpu_devices, "")
  total = 1 + _WARMUP.value + _ROUNDS.value * _STEPS.value
  if _WRITE_WORKLOAD.value:
    with open(_WRITE_WORKLOAD.value, "w") as f:
      json.dump(workload(cfg, total), f)
    return
  if not _TRL_PYTHON.value:
    raise app.UsageError("--trl_python (or $TRL_PYTHON): the Python of an environment with torch and trl, "
                         "e.g. `python -m venv V && V/bin/pip install torch transformers trl datasets "
                         "accelerate`")
  workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="vs_trl_")
  os.makedirs(workdir, exist_ok=True)
  workload_path = os.path.join(workdir, "workload.json")
  w = workload(cfg, total)
  with open(workload_path, "w") as f:
    json.dump(w, f)
  if _MATMUL_ONLY.value:
    rates = matmul_rates(workload_path, w["matmul_shapes"])
    if _OUT.value:
      with open(_OUT.value, "w") as f:
        json.dump({"matmul_gflop_per_s": rates, "machine": machine()}, f, indent=1, sort_keys=True)
    return
  load_before = os.getloadavg()[0]
  sides = start_sides(workload_path, workdir)
  try:
    rounds = run_rounds(sides)
    finals = {name: summary_line(side.finish()) for name, side in sides.items()}
  finally:
    for side in sides.values():
      side.kill()
  steps = {name: [s for rnd in rounds for s in rnd["steps"][name]] for name in sides}
  result = {"rounds": rounds,
            "ours": medians(steps["ours"], ("step_s",) + OURS_PHASES + ("response_len_mean",)),
            "trl": medians(steps["trl"], ("step_s",) + TRL_PHASES + ("response_len_mean",))}
  result["ratio"] = round(result["ours"]["step_s"] / result["trl"]["step_s"], 3)
  print(table(result))
  import jax  # pylint: disable=g-import-not-at-top
  import flax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  result |= {
      "config": _CONFIG.value, "ours_flags": list(_OURS_FLAGS.value), "trl_bf16": _TRL_BF16.value,
      "rounds_steps_warmup": [_ROUNDS.value, _STEPS.value, _WARMUP.value],
      "machine": machine() | {"load_avg_1m_before": round(load_before, 2)},
      "versions": {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
                   **finals["trl"]["versions"]},
      "trl_setup": finals["trl"]["setup"],
      "first_step_s": {name: finals[name]["first_step_s"] for name in ("ours", "trl")},
      "run_s": run_seconds(result, finals),
      "matmul_gflop_per_s": matmul_rates(workload_path, w["matmul_shapes"]), "workdir": workdir,
  }
  run = result["run_s"]
  print(f"{RUN_STEPS} steps including the first (first step + {RUN_STEPS - 1} x median): ours {run['ours']} s, "
        f"TRL {run['trl']} s, ratio {run['ratio']}")
  print(json.dumps({"ratio_ours_over_trl": result["ratio"], "ours_step_s": result["ours"]["step_s"],
                    "trl_step_s": result["trl"]["step_s"], "run_ratio": run["ratio"]}, sort_keys=True))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=1, sort_keys=True)


# A run of this many steps, the first included (issue 30's whole-run comparison of tiny-grpo).
RUN_STEPS = 24


def run_seconds(result: dict, finals: dict) -> dict:
  """Each side's first step (its compiles or lazy set-up included, timed in the side's process) plus
  ``RUN_STEPS - 1`` of its median measured steps, and ours over TRL's: an estimate of a short run's wall
  time from this rotation's figures."""
  run = {name: round(finals[name]["first_step_s"] + (RUN_STEPS - 1) * result[name]["step_s"], 3)
         for name in ("ours", "trl")}
  return run | {"ratio": round(run["ours"] / run["trl"], 3)}


def machine() -> dict:
  """CPU model, family and vector extensions (``common.machine_record``), and count."""
  record = common.machine_record()
  return {"cpu": record["cpu_model"], "cpu_family": record["cpu_family"], "cpu_features": record["cpu_features"],
          "cpus": os.cpu_count()}


if __name__ == "__main__":
  app.run(main)
