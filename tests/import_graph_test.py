"""The modules of rl_fusion_jax import each other without a cycle, and `rl_fusion_jax.config` is a leaf.

Pure Python (ast), no jax. Two graphs over the package's files, both from `build_test.file_imports`
(`from pkg import x` is an edge to pkg/x.py when x is a submodule, else to pkg/__init__.py):

  - the dependency graph: every import, inside functions too. A deferred import still needs the module at
    run time, and it is the graph BUILD's deps mirror, so a cycle here is a cycle Bazel refuses to analyse
    (build_test checks BUILD's own graph). Package __init__.py files are not implicit edges here, as in
    BUILD (a submodule's target does not depend on its package).
  - the import-time graph: the imports that run when a module is imported (not inside functions), plus
    the package __init__.py files Python runs first when a module of another package is imported. A cycle
    here means some import order meets a half-initialised module.

A deferred import is the usual way around an import-time cycle, so it is allowed by the second graph and
still caught by the first: that is the cycle config -> models -> hf_io -> sharding.reshard ->
sharding.mesh -> config that once broke `bazel test //...`.
"""
from __future__ import annotations

import pathlib
import subprocess
import sys

import build_test
from build_test import PACKAGE, ROOT, find_cycles


def _packages(path: str) -> set[str]:
  """The __init__.py files Python runs before the module `path` (its package and the ones above)."""
  parts = pathlib.PurePosixPath(path).parent.parts
  return {"/".join(parts[:i]) + "/__init__.py" for i in range(1, len(parts) + 1)}


def import_graph(root: pathlib.Path, *, import_time: bool = False) -> dict[str, set[str]]:
  """Package file -> the package files it imports (the module docstring says which edges count)."""
  files = [p for p in build_test.expected_sources(root) if p.startswith(f"{PACKAGE}/")]
  graph = {}
  for path in files:
    deps = {f for f in build_test.file_imports(root, path, module_level=import_time)[0]
            if f.startswith(f"{PACKAGE}/")}
    if import_time:   # a package already running when `path` runs is no new import
      deps |= {init for f in deps for init in _packages(f) - _packages(path)}
    graph[path] = deps - {path}
  return graph


def _format(cycles: list[list[str]]) -> str:
  return "\n  ".join(" -> ".join(cycle) for cycle in cycles)


def test_package_has_no_import_cycle():
  cycles = find_cycles(import_graph(ROOT))
  assert not cycles, f"import cycles (imports inside functions count):\n  {_format(cycles)}"


def test_package_has_no_import_time_cycle():
  cycles = find_cycles(import_graph(ROOT, import_time=True))
  assert not cycles, f"import-time cycles (package __init__.py files count):\n  {_format(cycles)}"


def test_config_is_a_leaf_without_jax_or_flax():
  """Defining configs needs no decoder, Flax or JAX (DESIGN.md: `config.py` is a leaf)."""
  code = ("import sys; import rl_fusion_jax.config, rl_fusion_jax.model_config, rl_fusion_jax.hf_config; "
          "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'jaxlib', 'flax', 'optax'}), "
          "sorted(m for m in sys.modules if m.startswith('rl_fusion_jax.')))")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       check=True).stdout
  assert out.split("] ", 1)[0] == "[", f"importing rl_fusion_jax.config imported {out}"
  assert "rl_fusion_jax.models" not in out and "rl_fusion_jax.sharding" not in out, out


_FAKE_PACKAGE = {
    "__init__.py": "",
    # a -> b at import time, b -> a inside a function: a cycle of the dependency graph only. `from pkg
    # import b` is an edge to the submodule b, not to pkg/__init__.py.
    "a.py": "from rl_fusion_jax import b\n",
    "b.py": "def f():\n  from rl_fusion_jax.a import g\n",
    # c imports sub.y, so Python first runs sub/__init__.py, which imports sub.x, which imports c: a cycle
    # of the import-time graph only (through the implicit package edge c -> sub/__init__.py).
    "c.py": "from rl_fusion_jax.sub import y\n",
    "sub/__init__.py": "from rl_fusion_jax.sub import x\n",
    "sub/x.py": "import rl_fusion_jax.c\n",
    "sub/y.py": "",
}


def test_cycles_are_found_in_a_fake_package(tmp_path):
  for rel, text in _FAKE_PACKAGE.items():
    (tmp_path / PACKAGE / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / PACKAGE / rel).write_text(text)
  pkg = lambda *names: [f"{PACKAGE}/{n}" for n in names]
  assert find_cycles(import_graph(tmp_path)) == [pkg("a.py", "b.py", "a.py")]
  assert find_cycles(import_graph(tmp_path, import_time=True)) == [
      pkg("c.py", "sub/__init__.py", "sub/x.py", "c.py")]
  (tmp_path / PACKAGE / "sub/x.py").write_text("")
  (tmp_path / PACKAGE / "b.py").write_text("")
  assert find_cycles(import_graph(tmp_path)) == find_cycles(import_graph(tmp_path, import_time=True)) == []
