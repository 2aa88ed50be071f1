"""experiments/report_main.py --quick: every part of the ablation report runs and RESULTS.md is written."""
import json
import os
import subprocess
import sys

from rl_fusion_jax.testing import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.expanduser("~/.cache/rl_fusion_jax_tests")


def test_quick_report_regenerates_every_section(tmp_path):
  results = tmp_path / "RESULTS.md"
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "report_main.py"), f"--workdir={tmp_path / 'w'}",
         f"--results={results}", "--quick", f"--compilation_cache={CACHE}"]
  env = launch.child_env()   # the binaries pick one device per core
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  text = results.read_text()
  for heading in ("## Table 1, measured on this machine", "## The simulator, validated against the measured runs",
                  "#### Held out: fitted on one schedule's runs", "#### In-sample: fitted on all runs",
                  "#### Separated deployment: held-out error", "#### Simulated Table 1", "#### Simulated Table 2",
                  "#### What moves Table 2", "#### Cluster inputs and their sources", "## Learning under staleness",
                  "**Quick report**"):
    assert heading in text, heading
  # The simulator's section leads with the held-out validation; in-sample errors come after, labelled.
  section = text[text.index("## The simulator, validated"):text.index("## Tables 1 and 2, simulated")]
  assert section.index("**Held out (cross-schedule)**") < section.index("**In-sample**")
  assert section.index("#### Held out") < section.index("#### In-sample")
  assert "The reference system is" in section and "What it cannot show:" in section
  for variant in ("separated_sync", "separated_stalesync", "colocated_sync", "colocated_stalesync"):
    assert f"| longtail | {variant} |" in text
  figures = tmp_path / "results"
  pngs = sorted(p.name for p in figures.iterdir())
  assert "table1.png" in pngs and "staleness_samples.png" in pngs and "staleness_wallclock.png" in pngs
  assert sum(p.startswith("timeline_longtail_") for p in pngs) == 4
  assert all((figures / p).stat().st_size > 1000 for p in pngs)
  # The staleness arms trained what they say: equal samples, s = 1 arms stale, sync not.
  stale = json.loads((tmp_path / "w" / "staleness" / "staleness.json").read_text())["results"]["grpo"]
  assert stale["sync"][0]["token_staleness_mean"] == 0.0
  assert 0 < stale["s1_corrected"][0]["token_staleness_mean"] <= 1
  assert [p["samples"] for p in stale["sync"][0]["points"]] == [p["samples"] for p in stale["s1_uncorrected"][0]["points"]]
