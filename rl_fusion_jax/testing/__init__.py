"""Helpers for the tests and the benchmarks' checks (never imported by the package itself)."""

# The test suite compiles with XLA:CPU's older LLVM IR fusion emitters (tests/conftest.py sets
# `--xla_cpu_use_fusion_emitters=false` for every program: a third less compile time). Tests whose claim is
# about the programs users compile (bit-exact float32 equalities, gradient tolerances, compiled memory)
# compile with these options instead: XLA's default, the MLIR fusion emitters.
USER_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": True}
