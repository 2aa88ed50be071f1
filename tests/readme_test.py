"""README.md's commands parse as written.

Every ``python experiments/<binary>.py ...`` command of README.md, in its code blocks and in its inline
code, is parsed by that binary's own flags: the binary runs as ``__main__`` in a process forked for the
command, with ``absl.app.run`` replaced by a stand-in that parses the command line with the flags the
binary defined and returns before ``main``. An unknown flag, a bad ``--config.*`` override or a missing
required flag fails here; with ``--config`` the parsed ConfigDict must convert to the typed config
(``experiment_from_dict``). Every
``<config>.py:<variant>`` the README names is parsed the same way, and so are the ``--config.*`` overrides
a code block gives in a comment ("# or on any config: ..."), on arithmetic.py; every ``--config.<path>`` the
README mentions anywhere must be a field of a shipped config. The binaries are not run (minutes to an
hour each); tests/pulse_test.py runs grpo_main.py for 2 steps. Placeholders (DIR, DIR_OUT, RUN_DIR, ...)
become a folder holding a checkpoint's config.json; ``--config=...`` becomes arithmetic.py.
"""
from __future__ import annotations

import json
import pathlib
import re
import runpy
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PLACEHOLDER = re.compile(r"\b(?:RUN_DIR|DIR\w*)\b")

# Runs in a fresh interpreter: imports what every command needs once (JAX, through the algorithm
# registry), then forks a child per command, so that each binary defines its flags on a fresh absl FLAGS.
_DRIVER = r"""
import json, os, runpy, sys, traceback
from absl import app, flags
from rl_fusion_jax import config as config_lib
from rl_fusion_jax.algorithms import registry  # noqa: F401  (imported once, before the forks)
sys.path.insert(0, "experiments")


class Parsed(Exception):
  pass


def parse_only(main, argv=None, flags_parser=None, **kwargs):
  flags.FLAGS(sys.argv)
  raise Parsed


app.run = parse_only
results = []
for argv in json.load(sys.stdin):
  read, write = os.pipe()
  if os.fork() == 0:
    os.close(read)
    try:
      sys.argv = list(argv)
      try:
        runpy.run_path(argv[0], run_name="__main__")
        raise RuntimeError("the binary did not call absl.app.run")
      except Parsed:
        pass
      if "config" in flags.FLAGS and flags.FLAGS["config"].value is not None:
        config_lib.experiment_from_dict(flags.FLAGS["config"].value)
      message = "ok"
    except BaseException as e:  # pylint: disable=broad-except
      message = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
    os.write(write, message.encode())
    os._exit(0)
  os.close(write)
  with os.fdopen(read) as f:
    results.append(f.read())
  os.wait()
print(json.dumps(results))
"""


def _split_commands(text: str) -> list[list[str]]:
  """The ``python experiments/...`` commands of shell text (continuation lines joined, comments, ``&&``
  chains, environment assignments and launchers such as srun dropped) as argv lists."""
  out = []
  for line in re.sub(r"\\\n", " ", text).splitlines():
    if not re.search(r"python3? experiments/", line.partition("#")[0]):
      continue
    words = shlex.split(line, comments=True)
    while words:
      command = words[:words.index("&&")] if "&&" in words else words
      words = words[len(command) + 1:]
      starts = [i for i, w in enumerate(command[:-1]) if w in ("python", "python3")
                and command[i + 1].startswith("experiments/")]
      if starts:
        out.append(command[starts[0] + 1:])
  return out


def readme_commands(text: str) -> list[list[str]]:
  blocks = re.findall(r"```[\w-]*\n(.*?)```", text, flags=re.S)
  commands = [c for block in blocks for c in _split_commands(block)]
  prose = re.sub(r"```.*?```", "", text, flags=re.S)
  for span in re.findall(r"`([^`]+)`", prose):
    span = re.sub(r"\[[^\]]*\]", "", " ".join(span.split()))   # "[--workdir=DIR2 ...]": optional, left out
    if span.startswith("python experiments/"):
      commands += _split_commands(span)
  return commands


def readme_variants(text: str) -> list[list[str]]:
  """``--config=experiments/configs/<name>.py:<variant>`` for every ``<name>.py:<variant>`` named."""
  names = {p.stem for p in (ROOT / "experiments" / "configs").glob("*.py")}
  found = sorted({(n, v) for n, v in re.findall(r"\b(\w+)\.py:(\w+(?:,\w+)*)", text) if n in names})
  return [["experiments/grpo_main.py", f"--config=experiments/configs/{n}.py:{v}", "--workdir=/tmp/readme"]
          for n, v in found]


# Values the README writes as <placeholder> in override fragments.
FRAGMENT_VALUES = {"<outstanding samples>": "256"}   # arithmetic.py:stalesync's 32 groups x 8 samples


def readme_fragments(text: str) -> list[list[str]]:
  """grpo_main.py on arithmetic.py with the overrides of each code-block comment that gives some."""
  out = []
  for block in re.findall(r"```[\w-]*\n(.*?)```", text, flags=re.S):
    for line in re.sub(r"\\\n", " ", block).splitlines():
      comment = line.partition("#")[2]
      overrides = re.findall(r"--config\.[\w.]+=(?:<[^>]*>|\S+)", comment)
      if overrides:
        values = [re.sub(r"<[^>]*>", lambda m: FRAGMENT_VALUES[m.group(0)], o) for o in overrides]
        out.append(["experiments/grpo_main.py", "--config=experiments/configs/arithmetic.py",
                    "--workdir=/tmp/readme", *values])
  return out


def _substitute(argv: list[str], ckpt: str) -> list[str]:
  out = []
  for arg in argv:
    if arg == "--config=...":     # "any config" in the README's srun line
      arg = "--config=experiments/configs/arithmetic.py"
    out.append(PLACEHOLDER.sub(ckpt, arg))
  return out


def test_readme_commands_parse(tmp_path):
  text = README.read_text()
  commands, variants, fragments = readme_commands(text), readme_variants(text), readme_fragments(text)
  binaries = {c[0] for c in commands}
  assert {"experiments/grpo_main.py", "experiments/separated_main.py",
          "experiments/report_main.py"} <= binaries
  assert len(variants) >= 5 and fragments, (variants, fragments)
  config = json.loads((ROOT / "rl_fusion_jax/testing/hf_fixtures/qwen2_f32/config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
  argvs = [_substitute(c, str(tmp_path)) for c in commands + variants + fragments]
  for argv in argvs:
    assert (ROOT / argv[0]).is_file(), argv
  run = subprocess.run([sys.executable, "-c", _DRIVER], input=json.dumps(argvs), cwd=ROOT,
                       capture_output=True, text=True, timeout=300, check=True)
  results = json.loads(run.stdout.splitlines()[-1])
  failed = {" ".join(a): r for a, r in zip(argvs, results) if r != "ok"}
  assert not failed, "\n\n".join(f"{cmd}\n  {r}" for cmd, r in failed.items())


# The README's example of a mistyped override (and the error it prints).
TYPOS = {"rollout.temprature"}


def _fields(node, prefix=""):
  for key in node.keys():
    yield f"{prefix}{key}"
    if hasattr(node[key], "keys"):
      yield from _fields(node[key], f"{prefix}{key}.")


def test_every_config_path_the_readme_names_exists():
  known = set()
  for path in (ROOT / "experiments" / "configs").glob("*.py"):
    known |= set(_fields(runpy.run_path(str(path))["get_config"]()))
  named = set(re.findall(r"--config\.([\w.]*\w)", README.read_text())) - TYPOS
  assert named and not named - known, sorted(named - known)
