"""Packaging for rl_fusion_jax."""

import setuptools

setuptools.setup(
    name="rl_fusion_jax",
    version="0.1.0",
    description="JAX-native RL post-training of LLMs (GRPO, PPO) with co-located training and generation.",
    packages=setuptools.find_packages(include=["rl_fusion_jax", "rl_fusion_jax.*"]),
    package_data={"rl_fusion_jax": ["testing/*.jsonl", "testing/*.json", "testing/hf_fixtures/*/*"]},
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.10.2",
        "flax>=0.12.8",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12.8",
        "chex>=0.1.92",
        "absl-py>=2.1",
        "ml-collections>=1.1.0",
        "safetensors>=0.4",
        "tokenizers>=0.20",
        "jinja2>=3.1",  # chat templates (rl_fusion_jax/chat.py), rendered as transformers does
        "numpy>=1.26",
        # Every process imports it through jax: 0.7.0's extension takes 0.55 s to load (it registers its
        # ufunc loops one by one against numpy's list), 0.6.0's 8 ms (2-core AMD EPYC, numpy 2.4.6).
        "ml_dtypes>=0.5,<0.7",
        "jaxtyping>=0.2.36",
    ],
    extras_require={
        # gguf: the default suite writes and imports a tiny GGUF (tests/gguf_io_test.py).
        "test": ["pytest>=8", "pytest-xdist>=3.8", "hypothesis>=6.100", "matplotlib>=3.8", "gguf>=0.19"],
        # Reading GGUF checkpoints (rl_fusion_jax/models/gguf_io.py, experiments/fetch_model_main.py); imported
        # lazily, only where a GGUF file is read.
        "gguf": ["gguf>=0.19"],
        # Reference fixtures only (experiments/make_hf_fixtures.py); never imported by the package.
        "fixtures": ["torch>=2.3", "transformers>=4.45"],
        "tensorboard": ["tensorboardX>=2.6"],
        "plot": ["matplotlib>=3.8"],
        # The TRL side of experiments/benchmark_vs_trl.py (experiments/trl_tiny_grpo.py), in its own
        # environment; the versions it was measured with are in BENCHMARKS.md.
        "trl_bench": ["torch>=2.13", "transformers>=5.24", "trl>=1.16", "datasets>=5.2", "accelerate>=1.15"],
        # The transformers side of experiments/gguf_parity_main.py (experiments/gguf_reference.py), in its own
        # environment: transformers reads GGUF files with gguf and accelerate.
        "gguf_ref": ["torch>=2.13", "transformers>=5.24", "gguf>=0.19", "accelerate>=1.15"],
    },
)
