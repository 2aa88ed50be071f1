"""README.md's and docs/*.md's commands parse as written, and the documents' relative links resolve.

Every ``python experiments/<binary>.py ...`` command of README.md and of each docs/*.md page, in its code
blocks and in its inline code, is parsed by that binary's own flags: the binary runs as ``__main__`` in a
process forked for the command, with ``absl.app.run`` replaced by a stand-in that parses the command line
with the flags the binary defined and returns before ``main``. An unknown flag, a bad ``--config.*``
override or a missing required flag fails here; with ``--config`` the parsed ConfigDict must convert to
the typed config (``experiment_from_dict``). Every ``<config>.py:<variant>`` the documents name is parsed
the same way, and so are the ``--config.*`` overrides a code block gives in a comment ("# or on any
config: ..."), on arithmetic.py; every ``--config.<path>`` the documents mention anywhere must be a field
of a shipped config. The binaries are not run (minutes to an hour each); tests/readme_run_test.py (slow
tier) runs them with their steps cut down. Placeholders (DIR, DIR_OUT, RUN_DIR, ...) become a folder
holding a checkpoint's config.json; ``--config=...`` becomes arithmetic.py.

Links: every relative link (and image) of README.md, docs/*.md, BENCHMARKS.md and RESULTS.md must name an
existing file or folder, and a ``#anchor`` must name a heading of the .md file it points into, by GitHub's
anchor rules (``github_anchors``).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import runpy
import shlex
import subprocess
import sys
import urllib.parse

from rl_fusion_jax.models import pretrained

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
# The documents whose commands are checked (README first, then docs/ in name order) ...
COMMAND_DOCS = [README, *DOCS]
# ... and those whose links are.
LINK_DOCS = [*COMMAND_DOCS, ROOT / "BENCHMARKS.md", ROOT / "RESULTS.md"]
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
        value = flags.FLAGS["config"].value
        if isinstance(value, str):   # a plain path flag (benchmark_vs_trl.py): the config file's dict
          path, _, variant = value.partition(":")
          value = runpy.run_path(path)["get_config"](variant)
        config_lib.experiment_from_dict(value)
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


# Configs that need a checkpoint folder from the command line: their variants are parsed with one (DIR,
# replaced by the test's checkpoint like every placeholder).
NEEDS_CHECKPOINT = {"gsm8k_chat": ["--config.model.hf_path=DIR"]}


def readme_variants(text: str) -> list[list[str]]:
  """``--config=experiments/configs/<name>.py:<variant>`` for every ``<name>.py:<variant>`` named."""
  names = {p.stem for p in (ROOT / "experiments" / "configs").glob("*.py")}
  found = sorted({(n, v) for n, v in re.findall(r"\b(\w+)\.py:(\w+(?:,\w+)*)", text) if n in names})
  return [["experiments/grpo_main.py", f"--config=experiments/configs/{n}.py:{v}", "--workdir=/tmp/readme",
           *NEEDS_CHECKPOINT.get(n, [])] for n, v in found]


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


def documents_text() -> str:
  """README.md and docs/*.md, in ``COMMAND_DOCS`` order, as one text."""
  return "\n".join(path.read_text() for path in COMMAND_DOCS)


def documents_commands() -> list[list[str]]:
  """``readme_commands`` of every document of ``COMMAND_DOCS``, in that order."""
  return [c for path in COMMAND_DOCS for c in readme_commands(path.read_text())]


def test_readme_commands_parse(tmp_path):
  text = documents_text()
  commands, variants, fragments = documents_commands(), readme_variants(text), readme_fragments(text)
  binaries = {c[0] for c in commands}
  assert {"experiments/grpo_main.py", "experiments/separated_main.py",
          "experiments/report_main.py"} <= binaries
  assert ["experiments/grpo_main.py", "--config=experiments/configs/arithmetic.py",
          "--workdir=/tmp/rlfj_arithmetic"] in readme_commands(README.read_text())   # Quickstart (a)
  assert len(variants) >= 5 and fragments, (variants, fragments)
  config = json.loads((ROOT / "rl_fusion_jax/testing/hf_fixtures/qwen2_f32/config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
  # Configs whose model.hf_path defaults to a fetched model's folder (smollm2_word_problems.py) read it
  # from a model cache holding that checkpoint config under each model's name.
  cache = tmp_path / "models"
  for name in pretrained.MODELS:
    (cache / name).mkdir(parents=True)
    (cache / name / "config.json").write_text((tmp_path / "config.json").read_text())
  argvs = [_substitute(c, str(tmp_path)) for c in commands + variants + fragments]
  for argv in argvs:
    assert (ROOT / argv[0]).is_file(), argv
  run = subprocess.run([sys.executable, "-c", _DRIVER], input=json.dumps(argvs), cwd=ROOT,
                       capture_output=True, text=True, timeout=300, check=True,
                       env={**os.environ, pretrained.CACHE_ENV: str(cache)})
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
  named = set(re.findall(r"--config\.([\w.]*\w)", documents_text())) - TYPOS
  assert named and not named - known, sorted(named - known)


def test_readme_fits_two_screens():
  # The README is the pitch, the Quickstart, a map, the features, the results and the limits; the rest
  # lives in docs/ (one page per subject).
  assert len(README.read_text().splitlines()) <= 200


# ----------------------------------------------------------------------------------------------------
# Relative links
# ----------------------------------------------------------------------------------------------------
_FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", flags=re.S | re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _prose(text: str) -> str:
  """``text`` without fenced code blocks and inline code spans (what GitHub renders as markdown)."""
  return re.sub(r"`+[^`]*`+", "", _FENCE.sub("", text))


def markdown_links(text: str) -> list[str]:
  """The targets of the inline links and images of ``text``, outside code."""
  return _LINK.findall(_prose(text))


def github_anchor(heading: str) -> str:
  """The anchor GitHub gives a heading's text: the rendered text (code and emphasis markers dropped, a
  link's text kept) lower-cased, every character but letters, digits, ``_``, ``-`` and spaces removed,
  each space replaced by ``-``."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
  text = re.sub(r"[`*]", "", text).strip().lower()
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def github_anchors(text: str) -> set[str]:
  """The anchors of ``text``'s ATX headings (``#`` to ``######``, outside fenced code); a repeated anchor
  gets ``-1``, ``-2``, ... as GitHub numbers them."""
  seen: dict[str, int] = {}
  out = set()
  for line in _FENCE.sub("", text).splitlines():
    m = re.match(r" {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", line)
    if not m:
      continue
    anchor = github_anchor(m.group(1))
    n = seen.get(anchor, 0)
    seen[anchor] = n + 1
    out.add(anchor if n == 0 else f"{anchor}-{n}")
  return out


def broken_links(doc: pathlib.Path) -> list[str]:
  """``doc``'s relative links whose file, or whose ``#anchor`` in a .md file, does not exist."""
  problems = []
  for target in markdown_links(doc.read_text()):
    if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):   # http:, https:, mailto: ...
      continue
    path, _, anchor = target.partition("#")
    dest = (doc.parent / urllib.parse.unquote(path)).resolve() if path else doc
    if not dest.exists():
      problems.append(f"{doc.relative_to(ROOT)}: ({target}): no file {dest}")
    elif anchor and dest.suffix == ".md" and urllib.parse.unquote(anchor) not in github_anchors(dest.read_text()):
      problems.append(f"{doc.relative_to(ROOT)}: ({target}): no heading with anchor #{anchor} in "
                      f"{dest.relative_to(ROOT)}")
  return problems


def test_relative_links_resolve():
  assert DOCS and all(doc.is_file() for doc in LINK_DOCS), LINK_DOCS
  assert sum(len(markdown_links(doc.read_text())) for doc in LINK_DOCS) >= 20
  problems = [p for doc in LINK_DOCS for p in broken_links(doc)]
  assert not problems, "\n".join(problems)


def test_github_anchor_rules():
  assert github_anchor("The loop, per step") == "the-loop-per-step"
  assert github_anchor("Against TRL (tiny-grpo) (`experiments/benchmark_vs_trl.py`)") == (
      "against-trl-tiny-grpo-experimentsbenchmark_vs_trlpy")
  assert github_anchor("Tables 1 and 2, simulated at cluster scale") == "tables-1-and-2-simulated-at-cluster-scale"
  assert github_anchor("A **bold** [link](x.md) -- here") == "a-bold-link----here"
  text = "# T\n\n## Run\n\n```bash\n# not a heading\n```\n\n## Run\n### Run ###\n"
  assert github_anchors(text) == {"t", "run", "run-1", "run-2"}


def test_broken_links_are_reported(tmp_path, monkeypatch):
  monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
  (tmp_path / "a.md").write_text("# A\n\n## Known limits\n")
  doc = tmp_path / "b.md"
  doc.write_text("[ok](a.md#known-limits) [self](#b) [web](https://x.org/y) `[code](missing.md)`\n"
                 "# B\n[gone](missing.md) [bad anchor](a.md#known-limit) ![img](pic.png)\n")
  problems = broken_links(doc)
  assert len(problems) == 3, problems
  assert "missing.md" in problems[0] and "#known-limit " in problems[1] and "pic.png" in problems[2]
