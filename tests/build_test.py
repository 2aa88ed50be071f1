"""Keeps the top-level BUILD in step with the source tree.

Pure Python: needs neither jax nor Bazel. BUILD is written in the subset of Starlark that is also Python,
so it is read by executing it with stand-in rule functions that record each target. The checks:

  (a) every rl_fusion_jax/**/*.py and experiments/*.py is in some target's srcs, every tests/*_test.py
      is run by some py_test, and every package data file (rl_fusion_jax/testing/**,
      experiments/configs/*.py) is in some target's srcs or data;
  (b) every file a target names (srcs, data, main) exists, and every glob pattern matches something;
  (c) every first-party import in a target's sources is provided by the target itself or a direct dep
      (under Bazel a module missing from the runfiles fails to import), and every label is defined;
  (d) every py_test runs a test file of its srcs through tests/bazel_pytest_main.py, and has as data each
      experiment binary whose file name (say grpo_main.py) its source quotes: it runs or loads it by path;
  (e) the graph of targets (labels in deps, srcs and data) has no cycle: Bazel refuses to analyse one, and
      since deps follow imports, a cycle here is a cycle among the modules (tests/import_graph_test.py).

A failure lists the offending paths; for unlisted files it also prints a target to paste into BUILD.
`python tests/build_test.py >> BUILD` appends those targets (then move them to their section, and add
`data` that the checker cannot see, such as a binary a test runs).
"""
from __future__ import annotations

import ast
import dataclasses
import os
import pathlib
import sys
from collections.abc import Iterable, Iterator, Mapping

import pytest

# Not resolve(): under Bazel this file is a link in the runfiles tree, and the tree to check is that one.
ROOT = pathlib.Path(os.path.abspath(__file__)).parent.parent
PACKAGE = "rl_fusion_jax"
PYTEST_MAIN = "tests/bazel_pytest_main.py"
# Files that must be named in some target, besides the modules: package data shipped with the code.
DATA_DIRS = ("rl_fusion_jax/testing", "experiments/configs")
_SKIP_DIRS = {"__pycache__", ".pytest_cache", ".hypothesis"}
_STARLARK_FORBIDDEN = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom,
                       ast.While, ast.Try, ast.With, ast.Lambda)


# ---------------------------------------------------------------------------------------------------
# Reading BUILD.


@dataclasses.dataclass(frozen=True)
class Target:
  """One rule call in BUILD; file lists hold paths relative to the root, labels as ":name"."""
  rule: str
  name: str
  srcs: tuple[str, ...] = ()
  data: tuple[str, ...] = ()
  deps: tuple[str, ...] = ()
  main: str | None = None
  args: tuple[str, ...] = ()


@dataclasses.dataclass
class Build:
  targets: dict[str, Target]
  empty_globs: list[str]
  errors: list[str]


def _as_tuple(value, field: str, name: str) -> tuple[str, ...]:
  if value is None:
    return ()
  if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
    raise ValueError(f"BUILD target {name!r}: {field} must be a list of strings, got {value!r}")
  return tuple(value)


def _glob(root: pathlib.Path, empty: list[str], include, exclude=(), **_) -> list[str]:
  """Bazel's glob over files (not folders) of the one package at the root."""
  def expand(patterns):
    # Bazel's trailing "**" matches files at any depth; pathlib's matches only folders.
    patterns = [pat + "/*" if pat == "**" or pat.endswith("/**") else pat for pat in patterns]
    return {p.relative_to(root).as_posix() for pat in patterns for p in root.glob(pat) if p.is_file()}
  excluded = expand(exclude)
  found = expand(include) - excluded
  empty.extend(pat for pat in include if not expand([pat]) - excluded)
  return sorted(found)


def read_build(root: pathlib.Path) -> Build:
  """Executes root/BUILD with stand-in rules; raises ValueError on anything outside the Starlark subset."""
  path = root / "BUILD"
  if not path.is_file():
    raise ValueError(f"{path}: no BUILD file")
  tree = ast.parse(path.read_text(), filename=str(path))
  for node in ast.walk(tree):
    if isinstance(node, _STARLARK_FORBIDDEN):
      raise ValueError(f"{path}:{node.lineno}: {type(node).__name__} is not allowed in a BUILD file")
  build = Build(targets={}, empty_globs=[], errors=[])

  def rule(kind):
    def record(name, srcs=None, data=None, deps=None, main=None, args=None, **_):
      if name in build.targets:
        build.errors.append(f"BUILD: target name {name!r} is defined twice")
      build.targets[name] = Target(kind, name, _as_tuple(srcs, "srcs", name), _as_tuple(data, "data", name),
                                   _as_tuple(deps, "deps", name), main, _as_tuple(args, "args", name))
    return record

  env = {k: rule(k) for k in ("py_library", "py_binary", "py_test", "filegroup")}
  env.update(glob=lambda *a, **kw: _glob(root, build.empty_globs, *a, **kw),
             package=lambda **_: None, exports_files=lambda *a, **kw: None, load=lambda *a, **kw: None,
             __builtins__={"len": len, "sorted": sorted, "dict": dict, "list": list, "str": str})
  try:
    exec(compile(tree, str(path), "exec"), env)  # pylint: disable=exec-used
  except NameError as e:
    raise ValueError(f"{path}: {e}; the checker knows py_library, py_binary, py_test, filegroup, glob "
                     "(extend read_build for other rules)") from e
  return build


def _label_name(label: str) -> str | None:
  """':x' and '//:x' -> 'x'; anything else (a file path, another package) -> None."""
  for prefix in ("//:", ":"):
    if label.startswith(prefix):
      return label[len(prefix):]
  return None


# ---------------------------------------------------------------------------------------------------
# The tree and its imports.


def _walk(root: pathlib.Path, top: str) -> Iterator[str]:
  for dirpath, dirnames, filenames in os.walk(root / top):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
    for f in sorted(filenames):
      if not f.startswith(".") and not f.endswith(".pyc"):
        yield (pathlib.Path(dirpath) / f).relative_to(root).as_posix()


def expected_sources(root: pathlib.Path) -> list[str]:
  """The files that check (a) requires in some target's srcs."""
  modules = [p for p in _walk(root, PACKAGE) if p.endswith(".py")]
  tests = sorted(p.relative_to(root).as_posix() for p in root.glob("tests/*_test.py"))
  experiments = sorted(p.relative_to(root).as_posix() for p in root.glob("experiments/*.py"))
  return modules + tests + experiments


def expected_data(root: pathlib.Path) -> list[str]:
  """Package data files that check (a) requires in some target's srcs or data.

  Modules inside the package are left to expected_sources; config files in experiments/configs/ are
  Python but data (loaded by path).
  """
  files = [p for d in DATA_DIRS for p in _walk(root, d)]
  return [p for p in files if not (p.startswith(f"{PACKAGE}/") and p.endswith(".py"))]


def _resolve(root: pathlib.Path, module: str, script_dir: pathlib.Path | None) -> str | None:
  """The repo file that `import module` loads, or None (standard library, third party, missing)."""
  parts = module.split(".")
  bases = [root] + ([script_dir] if script_dir is not None else [])
  for base in bases:
    for cand in (base.joinpath(*parts, "__init__.py"), base.joinpath(*parts[:-1], parts[-1] + ".py")):
      if cand.is_file():
        return cand.relative_to(root).as_posix()
  return None


def _import_nodes(tree: ast.AST, module_level: bool) -> Iterator[ast.AST]:
  """Import statements of `tree`: all of them, or with `module_level` those that run when the module is
  imported (not inside a function; class bodies and module-level if / try do run)."""
  if not module_level:
    yield from (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return
  for node in ast.iter_child_nodes(tree):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      yield node
    elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      yield from _import_nodes(node, module_level)


def _imported_modules(tree: ast.AST, package: list[str],
                      module_level: bool = False) -> Iterator[tuple[str, tuple[str, ...]]]:
  """(module, from-names) per import, including imports inside functions (they run too) unless
  `module_level`."""
  for node in _import_nodes(tree, module_level):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield alias.name, ()
    elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
      base = package[:len(package) - node.level + 1] if node.level else []
      module = ".".join(base + ([node.module] if node.module else []))
      yield module, tuple(a.name for a in node.names)


def file_imports(root: pathlib.Path, path: str, *, module_level: bool = False) -> tuple[set[str], set[str]]:
  """(first-party files, third-party top-level names) that the Python file `path` imports (with
  `module_level`, only the imports that run when it is imported)."""
  file = root / path
  tree = ast.parse(file.read_text(), filename=str(file))
  in_package = (file.parent / "__init__.py").is_file()
  script_dir = None if in_package else file.parent  # a script's own folder is on sys.path
  package = list(pathlib.PurePosixPath(path).parent.parts)
  first, third = set(), set()
  for module, names in _imported_modules(tree, package, module_level):
    # `from pkg import a, B`: a may be a submodule; B (not a module) is read from pkg itself.
    hits = [_resolve(root, f"{module}.{n}", script_dir) for n in names]
    if not names or None in hits:
      hits.append(_resolve(root, module, script_dir))
    hits = {h for h in hits if h}
    top = module.split(".")[0]
    if hits:
      first.update(hits - {path})
    elif top not in sys.stdlib_module_names and top != PACKAGE:
      third.add(top)
  return first, third


# ---------------------------------------------------------------------------------------------------
# The checks.


def _owners(build: Build) -> dict[str, list[str]]:
  """File -> names of the targets that own it: for a test file the py_test that runs it, for any other
  file the py_* targets whose srcs list it."""
  owners: dict[str, list[str]] = {}
  for t in build.targets.values():
    if t.rule == "py_test":
      owners.setdefault(t.args[0] if t.args else "", []).append(t.name)
    if t.rule != "filegroup":
      for src in t.srcs:
        if not _is_test_file(src):
          owners.setdefault(src, []).append(t.name)
  return owners


def _is_test_file(path: str) -> bool:
  return path.startswith("tests/") and path.endswith("_test.py")


def _named_files(build: Build, target: Target, seen: frozenset = frozenset()) -> set[str]:
  """Files a target puts in its runfiles directly: srcs, data, main, and filegroups it names."""
  files = set()
  for item in target.srcs + target.data:
    name = _label_name(item)
    if name is None:
      files.add(item)
    elif name in build.targets and build.targets[name].rule == "filegroup" and name not in seen:
      files |= _named_files(build, build.targets[name], seen | {name})
  return files | ({target.main} if target.main else set())


def check_unlisted(root: pathlib.Path, build: Build) -> list[str]:
  """(a): files with no target, and modules that several targets claim."""
  owners = _owners(build)
  # The checker's own target carries the whole tree as data; it must not count as listing a file.
  named = set().union(*(_named_files(build, t) for t in build.targets.values() if t.name != "build_test"))
  problems = [f"{p}: " + ("not run by any py_test" if _is_test_file(p) else "not in the srcs of any target")
              for p in expected_sources(root) if p not in owners]
  problems += [f"{p}: not in the srcs or data of any target" for p in expected_data(root) if p not in named]
  dup = [f"{p}: in the srcs of several targets ({', '.join(o)})" for p, o in owners.items()
         if len(o) > 1 and (p.startswith(f"{PACKAGE}/") or p.startswith("experiments/"))]
  return problems + dup


def check_missing(root: pathlib.Path, build: Build) -> list[str]:
  """(b) and undefined labels: names in BUILD that point at nothing."""
  problems = [f"glob pattern {pat!r} matches no file" for pat in build.empty_globs]
  for t in build.targets.values():
    for item in dict.fromkeys(t.srcs + t.data + ((t.main,) if t.main else ())):
      name = _label_name(item)
      if name is None and item.startswith(("//", "@")):
        problems.append(f"{t.name}: {item!r} is a label outside this BUILD file")
      elif name is None and not (root / item).is_file():
        problems.append(f"{item}: named by target {t.name!r} but does not exist")
      elif name is not None and name not in build.targets:
        problems.append(f"{t.name}: names undefined target {item!r}")
    problems += [f"{t.name}: deps names undefined target {d!r}" for d in t.deps
                 if _label_name(d) not in build.targets]
  return problems


def check_deps(root: pathlib.Path, build: Build) -> list[str]:
  """(c): first-party imports that neither the target nor a direct dep provides."""
  owners = _owners(build)
  problems = []
  for t in build.targets.values():
    provided = set(t.srcs)
    for d in t.deps:
      provided.update(build.targets[_label_name(d)].srcs if _label_name(d) in build.targets else ())
    for src in t.srcs:
      if not src.endswith(".py") or not (root / src).is_file():
        continue
      for dep_file in sorted(file_imports(root, src)[0] - provided):
        want = " or ".join(f'":{o}"' for o in owners.get(dep_file, [])) or "a new target"
        problems.append(f"{t.name}: {src} imports {dep_file}; add {want} to its deps")
  return problems


def check_tests(build: Build) -> list[str]:
  """(d): each py_test runs its own file through the pytest wrapper."""
  problems = []
  for t in build.targets.values():
    if t.rule != "py_test":
      continue
    if t.main != PYTEST_MAIN:
      problems.append(f"{t.name}: main must be {PYTEST_MAIN!r}, got {t.main!r}")
    if not t.args or not _is_test_file(t.args[0]) or t.args[0] not in t.srcs:
      problems.append(f"{t.name}: args[0] must name a tests/*_test.py of its srcs "
                      f"(srcs {list(t.srcs)}, args {list(t.args)})")
  return problems


def _binaries_quoted(root: pathlib.Path, build: Build, path: str) -> list[str]:
  """Names of the py_binary targets whose main file name the file `path` quotes as a string."""
  text = (root / path).read_text() if (root / path).is_file() else ""
  return sorted(t.name for t in build.targets.values() if t.rule == "py_binary" and t.main and any(
      f"{q}{pathlib.PurePosixPath(t.main).name}{q}" in text for q in "'\""))


def check_test_data(root: pathlib.Path, build: Build) -> list[str]:
  """(d): a test that runs or loads an experiment binary by path has that binary as data."""
  problems = []
  for t in build.targets.values():
    if t.rule == "py_test" and t.args:
      for name in _binaries_quoted(root, build, t.args[0]):
        if f":{name}" not in t.data and f"//:{name}" not in t.data:
          problems.append(f'{t.name}: {t.args[0]} names the file of binary ":{name}"; add it to its data')
  return problems


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
  """Cycles of a directed graph (node -> successors), each as [a, b, ..., a]; [] iff it has none.

  One cycle per back edge of a depth-first search (nodes and successors in sorted order), so every
  strongly connected component with a cycle shows at least one.
  """
  state: dict[str, str] = {}   # "open" while on the search path, then "done"
  cycles = []
  for start in sorted(graph):
    if start in state:
      continue
    path, successors = [start], [iter(sorted(graph[start]))]
    state[start] = "open"
    while path:
      node = next(successors[-1], None)
      if node is None:
        state[path.pop()] = "done"
        successors.pop()
      elif state.get(node) == "open":
        cycles.append(path[path.index(node):] + [node])
      elif node not in state:
        state[node] = "open"
        path.append(node)
        successors.append(iter(sorted(graph.get(node, ()))))
  return cycles


def target_graph(build: Build) -> dict[str, set[str]]:
  """Target name -> names of the targets it refers to (labels in its deps, srcs and data)."""
  return {t.name: {n for label in t.deps + t.srcs + t.data if (n := _label_name(label)) is not None}
          for t in build.targets.values()}


def check_cycles(build: Build) -> list[str]:
  """(e): cycles among the targets."""
  return ["BUILD: dependency cycle " + " -> ".join(f"//:{n}" for n in cycle)
          for cycle in find_cycles(target_graph(build))]


def check(root: pathlib.Path) -> list[str]:
  """Every disagreement between root/BUILD and the files under root, one line each."""
  build = read_build(root)
  return (build.errors + check_unlisted(root, build) + check_missing(root, build) + check_deps(root, build)
          + check_tests(build) + check_test_data(root, build) + check_cycles(build))


# ---------------------------------------------------------------------------------------------------
# Suggested targets for unlisted files.


def target_name(path: str, root: pathlib.Path = ROOT) -> str:
  """rl_fusion_jax/models/hf_io.py -> models_hf_io; rl_fusion_jax/models/__init__.py -> models;
  tests/x_test.py -> x_test; experiments/x_main.py -> x_main; experiments/common.py -> experiments_common."""
  p = pathlib.PurePosixPath(path)
  if p.parts[0] == PACKAGE:
    parts = list(p.parent.parts[1:]) + ([] if p.stem == "__init__" else [p.stem])
    return "_".join(parts) or PACKAGE
  if p.parts[0] == "experiments" and not _is_binary(root, path):
    return f"experiments_{p.stem}"
  return p.stem


def _is_binary(root: pathlib.Path, path: str) -> bool:
  """An experiment is a binary when it is a *_main.py or runs something under `if __name__ == "__main__"`."""
  file = root / path
  return path.endswith("_main.py") or (file.is_file() and '__name__ == "__main__"' in file.read_text())


def _list(items: Iterable[str]) -> str:
  """A Starlark list as buildifier writes it: one line for one item, else one item a line."""
  quoted = [f'"{i}"' for i in items]
  if len(quoted) < 2:
    return "[" + ", ".join(quoted) + "]"
  return "[\n" + "".join(f"        {q},\n" for q in quoted) + "    ]"


def suggest_target(root: pathlib.Path, build: Build, owners: dict[str, list[str]], path: str) -> str:
  """A BUILD stanza for the unlisted file `path`, deps from its imports (third-party ones as a comment)."""
  first, third = file_imports(root, path)
  name = target_name(path, root)
  # A test that imports another file of tests/ (a shared helper, another test) takes it into its srcs,
  # and with it that file's imports.
  helpers: list[str] = []
  while path.startswith("tests/") and (new := sorted(f for f in first - {path} - set(helpers)
                                                      if f.startswith("tests/"))):
    helpers += new
    for helper in new:
      first, third = first | file_imports(root, helper)[0], third | file_imports(root, helper)[1]
  deps = sorted({f":{owners[f][0]}" for f in first - {path} - set(helpers)
                 if f in owners and owners[f][0] != name})
  lines = [f'    name = "{name}",']
  if path.startswith("tests/"):
    rule = "py_test"
    binaries = "".join(f' + [":{b}"]' for b in _binaries_quoted(root, build, path))
    lines += [f"    srcs = {_list([path] + helpers)} + PYTEST_SRCS,", f'    args = ["{path}"],',
              f"    data = PYTEST_DATA{binaries},", "    main = PYTEST_MAIN,"]
  elif path.startswith("experiments/") and _is_binary(root, path):
    rule = "py_binary"
    lines += [f'    srcs = ["{path}"],', f'    main = "{path}",']
  else:
    rule = "py_library"
    lines += [f'    srcs = ["{path}"],']
  if third:
    lines.append(f"    # third-party: {', '.join(sorted(third))}")
  if deps:
    lines.append(f"    deps = {_list(deps)},")
  return "\n".join([f"{rule}("] + lines + [")"])


def suggestions(root: pathlib.Path) -> str:
  """Stanzas for every unlisted file; they may depend on each other, so they are added as one batch."""
  build = read_build(root)
  owners = _owners(build)
  unlisted = [p for p in expected_sources(root) if p not in owners]
  owners.update({p: [target_name(p, root)] for p in unlisted})
  return "\n\n".join(suggest_target(root, build, owners, p) for p in unlisted)


# ---------------------------------------------------------------------------------------------------
# Tests.


def test_build_matches_tree():
  problems = check(ROOT)
  hint = suggestions(ROOT)
  assert not problems, ("BUILD and the tree disagree:\n  " + "\n  ".join(problems)
                        + (f"\n\nTargets to add to BUILD:\n\n{hint}" if hint else ""))


_FAKE_BUILD = '''
PYTEST_MAIN = "tests/bazel_pytest_main.py"
PYTEST_SRCS = [PYTEST_MAIN, "tests/conftest.py"]
PYTEST_DATA = [":experiment_configs"]
filegroup(name = "experiment_configs", srcs = glob(["experiments/configs/*.py"]))
py_library(name = "rl_fusion_jax", srcs = ["rl_fusion_jax/__init__.py"])
py_library(name = "core", srcs = ["rl_fusion_jax/core.py"])
py_library(name = "testing", srcs = ["rl_fusion_jax/testing/__init__.py"],
           data = glob(["rl_fusion_jax/testing/**"], exclude = ["**/*.py"]))
py_library(name = "experiments_common", srcs = ["experiments/common.py"], deps = [":core"])
py_binary(name = "run_main", srcs = ["experiments/run_main.py"], main = "experiments/run_main.py",
          data = [":experiment_configs"], deps = [":experiments_common"])
py_test(name = "core_test", srcs = ["tests/core_test.py"] + PYTEST_SRCS, args = ["tests/core_test.py"],
        main = PYTEST_MAIN, data = PYTEST_DATA, deps = [":core", ":testing"])
'''

_FAKE_FILES = {
    "rl_fusion_jax/__init__.py": "",
    "rl_fusion_jax/core.py": "import numpy as np\n",
    "rl_fusion_jax/testing/__init__.py": "",
    "rl_fusion_jax/testing/sample.jsonl": "{}\n",
    "experiments/common.py": "from rl_fusion_jax import core\n",
    "experiments/run_main.py": "import common\n",
    "experiments/configs/tiny.py": "",
    "tests/conftest.py": "",
    "tests/bazel_pytest_main.py": "",
    "tests/core_test.py": "import rl_fusion_jax.testing\nfrom rl_fusion_jax.core import np\n",
}


@pytest.fixture
def fake_tree(tmp_path):
  """A tiny consistent copy of the repo layout; tests break it one way each."""
  for rel, text in _FAKE_FILES.items():
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_text(text)
  (tmp_path / "BUILD").write_text(_FAKE_BUILD)
  return tmp_path


def test_checker_accepts_consistent_fake_tree(fake_tree):
  assert check(fake_tree) == []


@pytest.mark.parametrize("rel", ["rl_fusion_jax/sub/extra.py", "tests/extra_test.py", "experiments/extra.py"])
def test_checker_reports_unlisted_file(fake_tree, rel):
  (fake_tree / rel).parent.mkdir(parents=True, exist_ok=True)
  (fake_tree / rel).write_text("")
  what = "not run by any py_test" if rel.startswith("tests/") else "not in the srcs of any target"
  assert check(fake_tree) == [f"{rel}: {what}"]


def test_checker_reports_unlisted_data_file(fake_tree):
  (fake_tree / "experiments/configs/other.txt").write_text("")  # not matched by the *.py glob
  assert check(fake_tree) == ["experiments/configs/other.txt: not in the srcs or data of any target"]


def test_checker_reports_missing_files(fake_tree):
  (fake_tree / "rl_fusion_jax/core.py").unlink()
  (fake_tree / "rl_fusion_jax/testing/sample.jsonl").unlink()  # the data glob now matches nothing
  problems = check(fake_tree)
  assert "rl_fusion_jax/core.py: named by target 'core' but does not exist" in problems
  assert "glob pattern 'rl_fusion_jax/testing/**' matches no file" in problems


def test_checker_reports_missing_dep(fake_tree):
  (fake_tree / "experiments/common.py").write_text("import numpy\n\ndef f():\n  import rl_fusion_jax.testing\n")
  assert check(fake_tree) == [
      'experiments_common: experiments/common.py imports rl_fusion_jax/testing/__init__.py; '
      'add ":testing" to its deps']


def test_checker_reports_undefined_label_and_duplicate(fake_tree):
  text = _FAKE_BUILD.replace('deps = [":core"])', 'deps = [":nope"])')
  text += 'py_library(name = "core2", srcs = ["rl_fusion_jax/core.py"])\n'
  (fake_tree / "BUILD").write_text(text)
  problems = check(fake_tree)
  assert "rl_fusion_jax/core.py: in the srcs of several targets (core, core2)" in problems
  assert "experiments_common: deps names undefined target ':nope'" in problems


def test_checker_reports_miswired_test(fake_tree):
  text = _FAKE_BUILD.replace('args = ["tests/core_test.py"]', 'args = ["tests/other_test.py"]')
  (fake_tree / "BUILD").write_text(text)
  problems = check(fake_tree)
  assert problems[0] == "tests/core_test.py: not run by any py_test"
  assert problems[1].startswith("core_test: args[0] must name a tests/*_test.py of its srcs")
  assert len(problems) == 2, problems


def test_checker_reports_binary_missing_from_test_data(fake_tree):
  (fake_tree / "tests/core_test.py").write_text('import rl_fusion_jax.testing\nSCRIPT = "run_main.py"\n')
  assert check(fake_tree) == [
      'core_test: tests/core_test.py names the file of binary ":run_main"; add it to its data']


def test_find_cycles_on_hand_made_graphs():
  assert find_cycles({"a": ["b", "c"], "b": ["d"], "c": ["d"], "d": []}) == []   # a diamond: no cycle
  assert find_cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c", "a"]]
  assert find_cycles({"a": ["a"]}) == [["a", "a"]]
  assert find_cycles({"x": ["y"], "y": ["x", "z"], "z": ["z"]}) == [["x", "y", "x"], ["z", "z"]]
  assert find_cycles({"a": ["b"]}) == []   # a successor that is no key is a leaf


def test_checker_reports_dependency_cycle(fake_tree):
  # core -> experiments_common -> core: the error Bazel 4.2.3 gives at analysis, before any test runs.
  text = _FAKE_BUILD.replace('srcs = ["rl_fusion_jax/core.py"])',
                             'srcs = ["rl_fusion_jax/core.py"], deps = [":experiments_common"])')
  (fake_tree / "BUILD").write_text(text)
  assert check(fake_tree) == ["BUILD: dependency cycle //:core -> //:experiments_common -> //:core"]


def test_checker_rejects_non_starlark(fake_tree):
  (fake_tree / "BUILD").write_text(_FAKE_BUILD + "import os\n")
  with pytest.raises(ValueError, match=r"BUILD:\d+: Import is not allowed"):
    check(fake_tree)
  (fake_tree / "BUILD").write_text(_FAKE_BUILD + 'sh_test(name = "x")\n')
  with pytest.raises(ValueError, match="name 'sh_test' is not defined; the checker knows"):
    check(fake_tree)


def test_suggestions_make_the_fake_tree_consistent(fake_tree):
  files = {"rl_fusion_jax/sub/__init__.py": "", "rl_fusion_jax/sub/extra.py": "import jax\nfrom rl_fusion_jax import core\n",
           "tests/extra_test.py": "from rl_fusion_jax.sub import extra\nMAIN = 'run_main.py'\n",
           "tests/other_test.py": "import extra_test\n",  # a test reusing another's helpers
           "experiments/extra_main.py": "import common\n"}
  for rel, text in files.items():
    (fake_tree / rel).parent.mkdir(parents=True, exist_ok=True)
    (fake_tree / rel).write_text(text)
  with (fake_tree / "BUILD").open("a") as f:
    f.write("\n" + suggestions(fake_tree) + "\n")
  assert check(fake_tree) == []
  text = (fake_tree / "BUILD").read_text()
  assert 'name = "sub_extra"' in text and "# third-party: jax" in text and 'name = "extra_main"' in text
  assert 'data = PYTEST_DATA + [":run_main"],' in text
  assert '"tests/other_test.py",\n        "tests/extra_test.py",\n    ] + PYTEST_SRCS' in text


def test_target_names():
  assert [target_name(p) for p in ["rl_fusion_jax/models/hf_io.py", "rl_fusion_jax/models/__init__.py",
                                    "rl_fusion_jax/__init__.py", "tests/x_test.py", "experiments/x_main.py",
                                    "experiments/common.py"]] == [
      "models_hf_io", "models", "rl_fusion_jax", "x_test", "x_main", "experiments_common"]


if __name__ == "__main__":
  # Stanzas on stdout, so that `python tests/build_test.py >> BUILD` adds them; the rest on stderr.
  _text = suggestions(ROOT)
  if _text:
    print("\n" + _text)
  problems = check(ROOT) if not _text else []
  print("\n".join(problems) or ("BUILD lists every file." if not _text else ""), file=sys.stderr)
