"""The ablation report (experiments/report_main.py) and the data it is computed from.

The quick report runs every part and is re-rendered from the data it writes (--from_results); the other
tests run nothing: the committed Table 1 regenerates from results/runs/ exactly as RESULTS.md prints it,
RESULTS.md leads with the simulator's held-out validation and says what each table can and cannot show,
Table 1 leaves compile-contaminated windows out, compiles and machines are read from the runs' records.
"""
import datetime
import json
import os
import re
import subprocess
import sys

from rl_fusion_jax.testing import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(ROOT, "experiments")
RESULTS_MD = os.path.join(ROOT, "RESULTS.md")
CACHE = launch.TEST_CACHE


def _binary(name: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
  done = subprocess.run([sys.executable, os.path.join(EXPERIMENTS, name), *args], capture_output=True, text=True,
                        timeout=timeout, env=launch.child_env())
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return done


def _call(module: str, code: str, cwd: str = ROOT):
  """Runs CODE in a fresh interpreter with experiments/MODULE imported as ``m`` (each binary defines its own
  absl flags, so they are not imported into this process); returns what CODE leaves in ``out``."""
  script = (f"import json, sys\nsys.path.insert(0, {EXPERIMENTS!r})\nimport {module} as m\nout = None\n{code}\n"
            "print('OUT=' + json.dumps(out))")
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=cwd)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return json.loads(done.stdout.split("OUT=")[-1])


def _section(text: str, start: str, end: str | None = None) -> str:
  i = text.index(start)
  return text[i:text.index(end, i)] if end else text[i:]


def _notes_follow_headings(text: str) -> None:
  """Every '#### ' table heading is followed by its '*Can show*' ... '*Cannot show*' note."""
  lines = text.splitlines()
  headings = [i for i, line in enumerate(lines) if line.startswith("#### ")]
  assert headings
  for i in headings:
    following = next(line for line in lines[i + 1:] if line.strip())
    assert following.startswith("*Can show*") and "*Cannot show*" in following, lines[i]


def test_quick_report_regenerates_every_section_and_renders_again_from_its_data(tmp_path):
  results = tmp_path / "RESULTS.md"
  _binary("report_main.py", f"--workdir={tmp_path / 'w'}", f"--results={results}", "--quick",
          f"--compilation_cache={CACHE}")
  text = results.read_text()
  for heading in ("## In short", "## Where every figure comes from", "## Table 1, measured",
                  "## The simulator, validated against the measured runs",
                  "#### Held out: fitted on one schedule's runs", "#### In-sample: fitted on all runs",
                  "#### Separated deployment: held-out error", "#### Simulated Table 1", "#### Simulated Table 2",
                  "#### What moves Table 2", "#### Cluster inputs and their sources", "## Learning under staleness",
                  "**Quick report**"):
    assert heading in text, heading
  # The report leads with the simulator's held-out validation; in-sample errors come after, labelled.
  short = _section(text, "## In short", "## Where every figure")
  assert short.index("**The simulator, held out**") < short.index("**In-sample**") < short.index("**Table 1")
  section = _section(text, "## The simulator, validated", "## Tables 1 and 2, simulated")
  assert section.index("**Held out (cross-schedule)") < section.index("**In-sample**")
  assert section.index("#### Held out") < section.index("#### In-sample")
  assert "The reference system is" in section and "What it cannot show:" in section
  _notes_follow_headings(_section(text, "## The simulator, validated", "## Learning under staleness"))
  for variant in ("separated_sync", "separated_stalesync", "colocated_sync", "colocated_stalesync"):
    assert f"| longtail | {variant} |" in text
  # The machine is the one recorded with the runs (made just now, here), not "not recorded".
  figures = tmp_path / "results"
  records = [json.loads(p.read_text()) for p in figures.glob("runs/*/machine.json")]
  assert len(records) == 4 and all(r["cpu_count"] == os.cpu_count() for r in records)
  table1_row = next(line for line in text.splitlines() if line.startswith("| measured Table 1 |"))
  assert f"{os.cpu_count()} CPU cores" in table1_row and records[0]["cpu_model"] in table1_row
  # The CPU's family and vector extensions (Linux): machines of one model name differ in them.
  if sys.platform == "linux":
    assert f"family {records[0]['cpu_family']}" in table1_row
    assert all(name in table1_row for name in records[0]["cpu_features"])
  assert "not recorded" not in table1_row
  # The quick runs measure their first steps, compiles and all: every run is marked, its compiles logged.
  ablation = json.loads((tmp_path / "w" / "ablation" / "ablation.json").read_text())
  for row in ablation["rows"]["longtail"].values():
    assert row["all_contaminated"] and row["contaminated_runs"] == [True]
    assert row["compile_window_s_runs"][0] > 0
  assert "| longtail | colocated_sync |" in text and "†" in _section(text, "## Table 1, measured", "## The simulator")
  pngs = sorted(p.name for p in figures.iterdir() if p.is_file())
  assert "table1.png" in pngs and "staleness_samples.png" in pngs and "staleness_wallclock.png" in pngs
  assert sum(p.startswith("timeline_longtail_") for p in pngs) == 4
  assert all((figures / p).stat().st_size > 1000 for p in pngs)
  # The staleness arms trained what they say: equal samples, s = 1 arms stale, sync not.
  stale = json.loads((tmp_path / "w" / "staleness" / "staleness.json").read_text())["results"]["grpo"]
  assert stale["sync"][0]["token_staleness_mean"] == 0.0
  assert 0 < stale["s1_corrected"][0]["token_staleness_mean"] <= 1
  assert [p["samples"] for p in stale["sync"][0]["points"]] == [p["samples"] for p in stale["s1_uncorrected"][0]["points"]]
  # Rendered again from the data it wrote next to the figures (nothing run): the same tables.
  again = tmp_path / "RESULTS_again.md"
  _binary("report_main.py", f"--workdir={tmp_path / 'r'}", f"--results={again}", f"--figures={figures}",
          "--from_results", f"--sim_from={tmp_path / 'w' / 'sim'}")
  for part, table in (("ablation", "table1.md"), ("staleness", "staleness.md")):
    assert (tmp_path / "r" / part / table).read_text() == (tmp_path / "w" / part / table).read_text(), table
  assert "## Learning under staleness" in again.read_text() and "Absent" not in again.read_text()


def test_committed_table1_regenerates_from_results_runs(tmp_path):
  # RESULTS.md's Table 1 is what ablation_main.py computes from the committed runs, nothing else.
  _binary("ablation_main.py", f"--from_runs={os.path.join(ROOT, 'results', 'runs', 'ablation.json')}",
          f"--workdir={tmp_path}", timeout=300)
  table = (tmp_path / "table1.md").read_text().strip()
  assert table in open(RESULTS_MD).read()
  # The machine comes from the runs' own records (or says "not recorded"), the date from their timelines.
  ablation = json.loads((tmp_path / "ablation.json").read_text())
  assert ablation["made_unix_time"]
  row = next(line for line in open(RESULTS_MD) if line.startswith("| measured Table 1 |"))
  made = datetime.datetime.fromtimestamp(ablation["made_unix_time"][0], datetime.timezone.utc)
  assert f"{made:%Y-%m-%d %H:%M}" in row
  recorded = [m for m in ablation["machines"] if m]
  if recorded:
    assert all(f"({m['cpu_model']})" in row and m["commit"][:9] in row for m in recorded)
  else:
    assert "not recorded" in row


def test_results_md_leads_with_held_out_and_says_what_each_table_shows():
  text = open(RESULTS_MD).read()
  short = _section(text, "## In short", "## Where every figure")
  first = next(line for line in short.splitlines() if line.startswith("* "))
  assert first.startswith("* **The simulator, held out**"), first
  # Every in-sample figure is labelled: each percentage after "In-sample" in the lead is in its sentence.
  assert re.search(r"\*\*In-sample\*\* \(the compared run among those fitted", first)
  assert text.index("**Held out (cross-schedule)") < text.index("**In-sample** (fitted on all runs")
  _notes_follow_headings(_section(text, "## The simulator, validated", "## Learning under staleness"))
  table1 = _section(text, "## Table 1, measured", "## The simulator")
  assert "*Can show*" in table1 and "*Cannot show*" in table1 and "compile" in table1
  # The staleness table is there only with its committed data; otherwise the section says so.
  staleness = _section(text, "## Learning under staleness")
  export = os.path.join(ROOT, "results", "staleness", "export.json")
  if os.path.isfile(export):
    assert "| algorithm | arm |" in staleness and "results/staleness/export.json" in staleness
  else:
    assert "**Absent until its runs are made.**" in staleness and "| algorithm | arm |" not in staleness
    assert "python experiments/staleness_main.py" in staleness


def test_table1_leaves_compile_contaminated_runs_out():
  # Two arithmetic variants in the shape of the runs behind an earlier RESULTS.md, where a compile fell
  # into both windows of colocated_stalesync (x1.13 against the baseline; x1.74 without the compile).
  code = r"""
def run(tok, steady, compile_steps, window_s=None):
  return {"trained_tokens_per_s": tok, "trained_tokens_per_s_steady": steady, "compile_steps": compile_steps,
          "compile_window_s": window_s, "wall_s": 2.0, "compile_contaminated": compile_steps > 0 or (window_s or 0) > 0.02,
          "machine": None, "made_unix_time": 1.0, "step_s": 1.0, "generate_s": 0.1, "train_s": 0.1,
          "phase_s": {"all": {"train": 0.1}}, "idle_frac": {"all": 0.05}, "decode_steps": 4, "staleness_mean": 0.0,
          "compile_excess_s": 0.0}
base = [run(3986, 3986, 0), run(3483, 3483, 0)]
stale = [run(3269, 6000, 1), run(5208, 6978, 1)]
mixed = [run(5000, 5000, 0, 0.0), run(2000, 2100, 0, 0.5), run(6000, 6000, 0, 0.01)]
rows = {"arithmetic": {"separated_sync": m.combine(base), "colocated_stalesync": m.combine(stale),
                       "colocated_sync": m.combine(mixed)}}
out = {"rows": rows, "table": m.table(rows)}
"""
  out = _call("ablation_main", code)
  rows, table = out["rows"]["arithmetic"], out["table"]
  # A row with a clean run: medians over the clean runs only (the 0.5 s compile of 2 s left out).
  assert rows["colocated_sync"]["trained_tokens_per_s"] == 5500 and rows["colocated_sync"]["runs_used"] == 2
  assert "5,500 (5,000, 2,000†, 6,000) | 1.47 |" in table
  # A row with none: kept, marked in the table itself, its ratio also without the compile.
  assert rows["colocated_stalesync"]["all_contaminated"]
  assert "4,238 † (3,269†, 5,208†) | 1.13 † (steady 1.74) |" in table
  assert "1 / not logged (each run)" in table and "0 / 0.50 s" in table


def test_cpu_interference_by_hand_and_the_monitor_counts_the_whole_process_tree():
  # By hand: 2 cores; between the samples at t = 0 and t = 2 (those that bracket the window [0.5, 1.5])
  # the CPUs were busy 3.0 s, 2.0 s of it the run's own processes, and 0.1 s was stolen: other processes
  # 1.0 s, a quarter of the 4 CPU seconds; steal 2.5%. A window the samples do not bracket: None.
  code = r"""
rows = [[0.0, 10.0, 1.0, 0.0], [1.0, 11.5, 1.1, 1.0], [2.0, 13.0, 1.1, 2.0]]
out = {"in": m.cpu_interference(rows, 2, 0.5, 1.5), "whole": m.cpu_interference(rows, 2, 0.0, 2.0),
       "before": m.cpu_interference(rows, 2, -1.0, 1.0), "after": m.cpu_interference(rows, 2, 1.0, 2.5)}
# A run whose process starts a child that burns CPU, waits for it, then burns CPU itself: the monitor's
# last row holds both (the reaped child through the parent's cutime), and stops once the run has exited.
import subprocess, sys, time
burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"
child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys\n"
                          f"subprocess.run([sys.executable, '-c', {burn!r}])\n" + burn])
monitor = m.CpuMonitor(child.pid, period=0.05)
child.wait()
time.sleep(0.2)
rows = monitor.stop()
out["run_cpu"] = rows[-1][3]
out["times_ascend"] = all(a[0] < b[0] for a, b in zip(rows, rows[1:]))
out["n"] = len(rows)
"""
  out = _call("common", code)
  assert out["in"] == out["whole"] == {"other_cpu_s": 1.0, "steal_s": 0.1, "span_s": 2.0, "other_share": 0.25,
                                       "steal_share": 0.025}
  assert out["before"] is None and out["after"] is None
  assert out["run_cpu"] >= 1.1 and out["times_ascend"] and out["n"] >= 3


def test_a_disturbed_run_is_set_aside_and_made_again_at_most_remeasure_times(tmp_path):
  # A fake run maker and measurement: the first two attempts of run A are disturbed, the third not; run B is
  # disturbed every time. With 2 re-measurements A keeps its third attempt (2 set aside), B its third
  # (disturbed still); with 0, B is made once and kept.
  code = rf"""
import json, os
root = {str(tmp_path)!r}
def case(name, disturbed, attempts):
  workdir = os.path.join(root, name)
  made = []
  def make():
    os.makedirs(workdir)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump({{"attempt": len(made)}}, f)
    made.append(1)
  def measure():
    with open(os.path.join(workdir, "summary.json")) as f:
      k = json.load(f)["attempt"]
    return {{"attempt": k, "disturbed": disturbed(k), "interference": {{"other_share": 0.0, "steal_share": 0.05}}}}
  got = m.measure_until_undisturbed(workdir, make, measure, attempts)
  return {{"got": got, "made": len(made), "aside": sorted(d for d in os.listdir(root) if d.startswith(name + "."))}}
out = {{"a": case("a", lambda k: k < 2, 2), "b": case("b", lambda k: True, 2), "c": case("c", lambda k: True, 0)}}
"""
  out = _call("ablation_main", code)
  a, b, c = out["a"], out["b"], out["c"]
  assert (a["got"]["attempt"], a["got"]["remeasured"], a["got"]["disturbed"], a["made"]) == (2, 2, False, 3)
  assert a["aside"] == ["a.disturbed1", "a.disturbed2"]
  assert (b["got"]["attempt"], b["got"]["remeasured"], b["got"]["disturbed"], b["made"]) == (2, 2, True, 3)
  assert (c["got"]["remeasured"], c["made"], c["aside"]) == (0, 1, [])
  # The report names the runs made again and those kept disturbed, at the manifest's limit.
  code = r"""
x = lambda other, steal: {"other_share": other, "steal_share": steal}
rows = {"longtail": {"colocated_sync": {"interference_runs": [x(0.0, 0.004), x(0.001, 0.002)],
                                        "remeasured_runs": [0, 2], "disturbed_runs": [False, False]},
                     "separated_sync": {"interference_runs": [x(0.01, 0.02)], "remeasured_runs": [1],
                                        "disturbed_runs": [True]}}}
out = m.interference_findings(rows, 0.01)
"""
  (line,) = _call("report_main", code)
  assert "at most 3.0% of the machine's CPU seconds (longtail separated_sync repeat 0" in line
  assert ("2 runs had over 1% taken in their window and were made again (`ablation_main.py --max_interference`): "
          "longtail colocated_sync repeat 1 (2 attempts set aside), longtail separated_sync repeat 0 (1 attempt "
          "set aside).") in line
  assert "Still over 1% after the last attempt, kept: longtail separated_sync repeat 0." in line


def test_steps_per_workload_in_the_manifest_and_a_bad_workload_steps_entry_is_refused(tmp_path):
  # A manifest may give the measured steps per workload: the committed one (16 steps each) written that way
  # loads the same windows as written with one count.
  from rl_fusion_jax.sim import fit  # pylint: disable=g-import-not-at-top
  committed = os.path.join(ROOT, "results", "runs", "ablation.json")
  with open(committed) as f:
    manifest = json.load(f)
  assert manifest["steps"] == 16
  here = os.path.dirname(committed)
  manifest["steps"] = {w: 16 for w in manifest["workdirs"]}
  manifest["workdirs"] = {w: {v: [os.path.join(here, d) for d in ds] for v, ds in by.items()}
                          for w, by in manifest["workdirs"].items()}
  per_workload = tmp_path / "ablation.json"
  per_workload.write_text(json.dumps(manifest))
  window = lambda runs: {w: [(v, i, r.window()) for v, i, r in rs] for w, rs in runs.items()}
  assert window(fit.load_manifest(str(per_workload))) == window(fit.load_manifest(committed))
  manifest["steps"]["arithmetic"] = 8     # fewer steps: an earlier end of the window
  per_workload.write_text(json.dumps(manifest))
  short, full = fit.load_manifest(str(per_workload)), fit.load_manifest(committed)
  assert short["arithmetic"][0][2].window()[1] < full["arithmetic"][0][2].window()[1]
  assert short["longtail"][0][2].window() == full["longtail"][0][2].window()
  # --workload_steps names a workload of the run and a positive count, checked before anything runs.
  for bad in ("countdown:8", "arithmetic:0", "arithmetic"):
    done = subprocess.run([sys.executable, os.path.join(EXPERIMENTS, "ablation_main.py"),
                           f"--workdir={tmp_path / 'w'}", f"--workload_steps={bad}"],
                          capture_output=True, text=True, timeout=120, env=launch.child_env())
    assert done.returncode == 1 and "--workload_steps" in done.stderr and repr(bad) in done.stderr, done.stderr[-2000:]
  assert not (tmp_path / "w").exists()


def test_compile_events_are_placed_on_the_run_timeline(tmp_path):
  # A colocated run: its timeline starts at the session's unix time. A separated run: the merged timeline
  # starts at the earlier side's first phase; the training side's own timeline is aligned on the last update.
  unix = 1796250000.25
  stamp = lambda t: datetime.datetime.fromtimestamp(t).strftime("%m%d %H:%M:%S.%f")
  log = tmp_path / "run.log"
  log.write_text(
      f"I{stamp(unix + 1.0)} 1 common.py:127] JAX on cpu\n"
      f"W{stamp(unix + 12.0)} 1 dispatch.py:204] Finished tracing packed_rl_step for jit in 0.5 sec\n"
      f"W{stamp(unix + 15.0)} 2 dispatch.py:204] Finished XLA compilation of jit(packed_rl_step) in 2.5 sec\n"
      f"W{stamp(unix + 15.2)} 2 pxla.py:712] Compiling jit(x) with global shapes and types (f32[3],).\n")
  colo = tmp_path / "colo"
  colo.mkdir()
  phase = lambda name, group, step, a, b: json.dumps({"kind": "phase", "name": name, "group": group, "step": step,
                                                      "start": a, "end": b})
  (colo / "timeline.jsonl").write_text("\n".join([
      json.dumps({"kind": "session", "start": 0.0, "unix_time": unix}),
      json.dumps({"kind": "group", "name": "all", "devices": [0]}), phase("train", "all", 0, 10.0, 16.0)]) + "\n")
  sep = tmp_path / "sep"
  sep.mkdir()
  (sep / "timeline.jsonl").write_text("\n".join([   # merged: written at the end, its origin 3 s after ...
      json.dumps({"kind": "session", "start": 0.0, "unix_time": unix + 99.0}),
      json.dumps({"kind": "group", "name": "train", "devices": [1]}), phase("train", "train", 0, 7.0, 13.0)]) + "\n")
  (sep / "timeline_train.jsonl").write_text("\n".join([   # ... the training side's session start
      json.dumps({"kind": "session", "start": 0.0, "unix_time": unix - 3.0}),
      json.dumps({"kind": "group", "name": "train", "devices": [1]}), phase("train", "train", 0, 13.0, 19.0)]) + "\n")
  code = f"""
out = {{}}
for name in ("colo", "sep"):
  d = {str(tmp_path)!r} + "/" + name
  offset = m.timeline_unix_offset(d)
  events = m.compile_events({str(log)!r}, offset)
  out[name] = {{"offset": offset, "events": events, "covered": m._covered([(a, b) for a, b, *_ in events], 12.0, 14.0)}}
"""
  out = _call("ablation_main", code)
  assert out["colo"]["offset"] == unix and out["sep"]["offset"] == unix + 3.0
  assert out["colo"]["events"] == [[11.5, 12.0, "trace", "packed_rl_step for jit"],
                                   [12.5, 15.0, "compile", "jit(packed_rl_step)"]]
  assert [e[:2] for e in out["sep"]["events"]] == [[8.5, 9.0], [9.5, 12.0]]
  assert abs(out["colo"]["covered"] - 1.5) < 1e-6    # [12.5, 14] of the window [12, 14]


def test_staleness_export_reads_back_as_the_runs(tmp_path):
  # What report_main commits (staleness/export.json) gives staleness_main's figures exactly as the run folders.
  run = tmp_path / "grpo_s1_corrected_seed0"
  run.mkdir()
  rows = [{"step": 0, "eval/accuracy": 0.25}]
  for step in range(1, 5):
    rows.append({"step": step, "step_s": 0.3 + step / 7, "train_samples": 128, "is_weight_std": 0.01 * step,
                 "stalesync/trained_token_staleness_mean": 0.5, "stalesync/staleness_max": 1.0, "reward": 0.1,
                 "loss": 1.0})
    if step % 2 == 0:
      rows.append({"step": step, "eval/accuracy": 0.25 + step / 512})
  (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (run / "machine.json").write_text(json.dumps({"cpu_model": "X", "cpu_count": 2}))
  code = f"""
e = json.loads(json.dumps(m.export_run({str(run)!r})))
out = {{"same": m.summarize_rows(m.rows_from_export(e)) == m.read_run({str(run)!r}), "export": e}}
"""
  out = _call("staleness_main", code)
  assert out["same"]
  assert "loss" not in out["export"]["columns"] and out["export"]["machine"]["cpu_model"] == "X"
  assert out["export"]["columns"]["eval/accuracy"] == [0.25, None, 0.25 + 2 / 512, None, 0.25 + 4 / 512]


def test_staleness_tables_time_to_accuracy_and_second_half_by_hand():
  # Two runs of one seed, figures worked out by hand: sync ends at 0.55 and first reached it at 5 of its
  # 10 RL seconds (0.50); the StaleSync arm first met 0.55 at 3 s (0.30). Second-half mean: evaluations
  # after the run's midpoint (step 20 of 20 only). Median steps from the runs' own fields.
  code = """
def run(acc, secs, step_s, gen):
  return {"seed": 0, "points": [{"step": k, "samples": 128 * k, "seconds": t, "accuracy": a}
                                for k, a, t in zip((0, 10, 20), acc, secs)],
          "rl_seconds": secs[-1], "token_staleness_mean": 0.0, "is_weight_std": 0.0,
          "median_step_s": step_s, "median_generate_s": gen, "median_train_s": 0.25}
res = {"grpo": {"sync": [run([0.5, 0.6, 0.55], [0.0, 5.0, 10.0], 0.5, 0.25)],
                "s2_corrected": [run([0.5, 0.56, 0.6], [0.0, 3.0, 6.0], 0.3, 0.05)]}}
out = {"tta": m.time_to_sync_accuracy(res), "table": m.table(res)}
"""
  out = _call("staleness_main", code)
  # Last two columns: the whole budget's RL seconds over sync's (6 / 10 for the StaleSync arm).
  assert "| grpo | sync | 0.50 | 0.50 | 1/1 | 1.00 | 1.00 |" in out["tta"]
  assert "| grpo | s2_corrected | 0.30 | 0.30 | 1/1 | 0.60 | 0.60 |" in out["tta"]
  sync_row = next(line for line in out["table"].splitlines() if line.startswith("| grpo | sync |"))
  stale_row = next(line for line in out["table"].splitlines() if line.startswith("| grpo | s2_corrected |"))
  assert "| 0.550 | 0.500 |" in sync_row and "0.500 (0.250, 0.250)" in sync_row
  assert "| 0.600 | 0.500 |" in stale_row and "0.300 (0.050, 0.250)" in stale_row


def test_staleness_in_short_line_gives_median_step_whole_budget_and_time_to_goal_by_hand():
  # One seed: sync's median step 0.5 s, the StaleSync arm's 0.3 s (x0.60); the arm's whole budget took 7 of
  # sync's 10 RL seconds (x0.70, given); it reached sync's final accuracy at 0.30 of sync's RL seconds.
  code = """
stale = {"results": {"grpo": {"sync": [{"median_step_s": 0.5}], "s2_corrected": [{"median_step_s": 0.3}]}},
         "time_to_sync": {"grpo": {"sync": [0.5], "s2_corrected": [0.3]}},
         "rl_seconds_to_sync": {"grpo": {"sync": [1.0], "s2_corrected": [0.7]}}}
out = m.steps_short(stale)
"""
  out = _call("report_main", code)
  assert out == ("sync itself 0.50 (1/1 seeds); s2_corrected: median step x0.60 sync's, RL seconds of the whole "
                 "budget x0.70 sync's, to sync's final accuracy in 0.30 (1/1 seeds) of sync's RL seconds")


def test_committed_staleness_tables_regenerate_from_their_exports(tmp_path):
  # RESULTS.md's staleness tables (the main job's study and, where committed, the arithmetic_steps studies)
  # are what staleness_main.py renders from the committed exports.
  exports = [os.path.join(ROOT, "results", d, "export.json")
             for d in ("staleness", "staleness_steps", "staleness_steps_long")]
  text = open(RESULTS_MD).read()
  for i, export in enumerate(e for e in exports if os.path.isfile(e)):
    _binary("staleness_main.py", f"--from_export={export}", f"--workdir={tmp_path / str(i)}", timeout=300)
    table = (tmp_path / str(i) / "staleness.md").read_text().strip()
    assert table and table in text, export
