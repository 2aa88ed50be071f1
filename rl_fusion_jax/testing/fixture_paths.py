"""Paths of the committed tiny Hugging Face fixtures (testing/hf_fixtures/), shared by the HF tests."""
from __future__ import annotations

import os
import shutil

FIXTURES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_fixtures")


def fixture(name: str) -> str:
  """The folder of fixture ``name`` (config.json, safetensors, reference.npz)."""
  return os.path.join(FIXTURES_DIR, name)


def copy_fixture(name: str, tmp_path) -> str:
  """A writable copy of fixture ``name`` under ``tmp_path`` (for tests that damage a checkpoint)."""
  dst = os.path.join(str(tmp_path), name)
  shutil.copytree(fixture(name), dst)
  return dst
