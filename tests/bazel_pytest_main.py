"""Entry point of every Bazel py_test: runs one test file through pytest.

  bazel_pytest_main.py tests/foo_test.py [pytest args...]

Bazel wants a main script per py_test; handing the file to pytest keeps tests/conftest.py (8 virtual CPU
devices, compilation cache) and pytest.ini (markers, `-m "not slow"`) in force, as under
`python -m pytest`. Named so that pytest's `*_test.py` pattern does not collect it.
"""
import os
import sys

import pytest

# pytest's exit status when it collected no test; see _main.
_NO_TESTS_COLLECTED = 5


def _drop_editable_finder() -> None:
  """Makes a module missing from the runfiles fail to import.

  `pip install -e .` of this repo installs a finder that serves rl_fusion_jax's modules from the
  checkout. Under Bazel that would hide a missing dep, since the runfiles tree is the truth.
  """
  sys.meta_path[:] = [f for f in sys.meta_path
                      if not getattr(f, "__module__", "").startswith("__editable__")]


def _main(argv: list[str]) -> int:
  if len(argv) < 2 or not argv[1].endswith("_test.py"):
    print(f"usage: {argv[0]} tests/<name>_test.py [pytest args...]; got {argv[1:]}", file=sys.stderr)
    return 2
  _drop_editable_finder()
  # One file per Bazel test, and Bazel runs the tests side by side: no pytest-xdist workers (pytest.ini's
  # `-n auto` is for `python -m pytest`).
  args = [argv[1], "-q", "-n", "0", *argv[2:]]
  if "XML_OUTPUT_FILE" in os.environ:  # Bazel's per-test result file (test.xml)
    args.append(f"--junitxml={os.environ['XML_OUTPUT_FILE']}")
  code = pytest.main(args)
  # A test file whose every test is deselected (e.g. all marked slow) ran nothing: that is not a pass.
  if code == _NO_TESTS_COLLECTED:
    print(f"{argv[1]}: no test ran", file=sys.stderr)
  return int(code)


if __name__ == "__main__":
  sys.exit(_main(sys.argv))
