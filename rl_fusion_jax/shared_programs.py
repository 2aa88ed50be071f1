"""Jitted programs shared by every run in one process.

A factory decorated with ``@shared`` returns the function it made before when it is called again with equal
arguments. A second run in the same process with the same model, meshes, layouts and settings (several
``loop.run`` calls in one process, as the test suite makes) then traces, lowers and compiles none of those
programs again: JAX's own cache of a jitted function answers it. The generation engines' programs
(``rollout.slots.programs``) are shared the same way. Without sharing, each run builds new closures, and
even with the persistent compilation cache every program is traced and lowered again to find its entry.

Arguments are compared as pytrees: the same structure, and every leaf of the same type and equal by
``==`` / ``hash`` (frozen configs, meshes, shardings, rule tables, numbers). A call with an unhashable leaf (an
array) is not cached. Objects without value equality (functions, an optax transformation) are equal only to
themselves, so the factories that make them are shared too (``train.state.make_optimizer``).

Each factory keeps its ``MAXSIZE`` most recently used functions (each holds its compiled executables);
``clear()`` drops them all.
"""
from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax

F = TypeVar("F", bound=Callable[..., Any])

MAXSIZE = 32
_CACHES: list[collections.OrderedDict] = []


def _key(args: tuple, kwargs: dict):
  leaves, treedef = jax.tree.flatten((args, kwargs))
  key = (treedef, tuple((type(leaf), leaf) for leaf in leaves))
  try:
    hash(key)
  except TypeError:
    return None
  return key


def shared(factory: F) -> F:
  """``factory`` with its results kept per equal arguments (see the module docstring)."""
  cache: collections.OrderedDict = collections.OrderedDict()
  _CACHES.append(cache)

  @functools.wraps(factory)
  def wrapper(*args, **kwargs):
    key = _key(args, kwargs)
    if key is None:
      return factory(*args, **kwargs)
    if key in cache:
      cache.move_to_end(key)
      return cache[key]
    made = cache[key] = factory(*args, **kwargs)
    if len(cache) > MAXSIZE:
      cache.popitem(last=False)
    return made

  wrapper.uncached = factory
  return wrapper


def clear() -> None:
  """Forgets every shared function (their compiled executables go with the last reference)."""
  for cache in _CACHES:
    cache.clear()


@shared
def jit(fn: Callable, *args, **jit_kwargs):
  """``jax.jit(functools.partial(fn, *args), **jit_kwargs)``, shared: ``fn`` a module-level function (equal
  only to itself), ``args`` its leading, hashable arguments (configs, sizes)."""
  return jax.jit(functools.partial(fn, *args), **jit_kwargs)
