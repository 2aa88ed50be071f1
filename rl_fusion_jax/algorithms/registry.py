"""Name -> function tables, so that an algorithm ablation is a config string; a new algorithm is one file.

A config names its advantage estimator ("grpo", "dr_grpo", "rloo"; with a critic, a token advantage
estimator: "gae"), policy loss ("ppo_clip", and for stale tokens "decoupled_ppo", "tis_token", "tis_seq",
"uncorrected"), KL estimator ("k1", "k2", "k3") and aggregation mode; the train step looks the functions
up here once, before tracing. A loss or an advantage estimator is registered with a decorator together
with its hyperparameter dataclass (frozen; its __post_init__ validates), in one file that imports this
module:

    @dataclasses.dataclass(frozen=True)
    class MyParams:
      eps: float = 0.2

    @register_policy_loss("my_loss", params=MyParams)
    def my_loss(logp_bt, old_logp_bt, adv, *, eps, mask_bt=None, proximal_logp_bt=None):
      ...

and a run loads it with ``--config.algo.plugins=my_pkg.my_loss`` (a module, or a path to a .py file;
several comma-separated), imported before the config is validated, then selects it with
``--config.algo.policy_loss=my_loss --config.algo.loss_kwargs=eps=0.1`` (``name=value`` pairs, comma-
separated; ``algo.advantage_kwargs`` likewise). A hyperparameter named like a field of ``AlgoConfig``
(``clip_low``, ``clip_high``, ``dual_clip``, ``is_cap``, ``gamma``, ``lam``) takes that field's value
unless the kwargs set it: the shipped losses' hyperparameters are those fields.

Call conventions of the tables:
    ADVANTAGE_ESTIMATORS[name](rewards_b, group_size, **hparams) -> adv_b
    TOKEN_ADVANTAGE_ESTIMATORS[name](token_rewards_bt, values_bt, mask_bt, **hparams) -> (adv_bt, returns_bt)
    POLICY_LOSSES[name](logp_bt, old_logp_bt, adv, *, mask_bt, [proximal_logp_bt], **hparams)
        -> (loss_bt, stats)
    KL_ESTIMATORS[name](logp_bt, ref_logp_bt) -> kl_bt
    AGGREGATIONS[name](mask_bt, *, norm_len=None) -> weights_bt

Policy losses: ``hparams`` are the fields of the loss's dataclass; ``mask_bt`` is always passed, and
``proximal_logp_bt`` (the log-probs before the batch's first update) when a batch takes several updates
(except to "ppo_clip", which has no behaviour weight: it is handed them as its `old_logp_bt`).
`old_logp_bt` is the behaviour log-probs. `stats` holds exactly the keys `losses.POLICY_LOSS_STATS`, each
a float [B, T] array. A loss registered with ``row_level=True`` reduces over a whole row (``tis_seq``),
so it cannot take packed rows.

Token advantage estimators ("gae") serve a learned critic: per-token rewards (e.g.
`advantages.outcome_token_rewards`) and values over the rows' response tokens give per-token advantages
and the critic's regression targets, both exactly 0 outside mask_bt; gamma and lam are static floats in
[0, 1]. The policy losses accept the resulting adv_bt as they accept adv_b.

Importing this module only defines the tables: it registers nothing elsewhere and runs no JAX code.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import importlib.util
import pathlib
import sys
from collections.abc import Mapping
from typing import Callable, TypeVar

from rl_fusion_jax.algorithms import advantages, losses, offpolicy

F = TypeVar("F", bound=Callable)

ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}
TOKEN_ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}
POLICY_LOSSES: dict[str, Callable] = {}
# name -> the hyperparameter dataclass of a policy loss / an advantage estimator (token-level too).
POLICY_LOSS_PARAMS: dict[str, type] = {}
ADVANTAGE_PARAMS: dict[str, type] = {}
ROW_LEVEL_POLICY_LOSSES: set[str] = set()
# Advantage estimators whose value for a sample depends on its own group's rewards only: the host's
# advantage stage computes them one group at a time, as soon as a group's rewards are in.
PER_GROUP_ADVANTAGES: set[str] = set()
KL_ESTIMATORS: dict[str, Callable] = {
    kind: functools.partial(losses.kl_estimate, kind=kind) for kind in losses.KL_KINDS
}
AGGREGATIONS: dict[str, Callable] = {
    mode: functools.partial(losses.token_weights, mode=mode) for mode in losses.AGGREGATION_MODES
}


def _lookup(table: dict[str, Callable], what: str, name: str) -> Callable:
  if name not in table:
    raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(table))}")
  return table[name]


def _register(table: dict[str, Callable], what: str, name: str, params: type | None = None,
              params_table: dict[str, type] | None = None) -> Callable[[F], F]:
  """Decorator factory adding a function (and its hyperparameter dataclass) to `table`; re-using a name
  is an error, not an override."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"{what} name must be a non-empty string, got {name!r}")
  if params is not None and not (dataclasses.is_dataclass(params) and isinstance(params, type)):
    raise ValueError(f"{what} {name!r}: params must be a dataclass type, got {params!r}")

  def decorator(fn: F) -> F:
    if name in table:
      raise ValueError(f"{what} {name!r} is already registered")
    table[name] = fn
    if params is not None and params_table is not None:
      params_table[name] = params
    return fn

  return decorator


def get_advantage_fn(name: str) -> Callable:
  """Returns the advantage estimator `fn(rewards_b, group_size) -> adv_b` registered as `name`."""
  return _lookup(ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def get_token_advantage_fn(name: str) -> Callable:
  """Returns `fn(token_rewards_bt, values_bt, mask_bt, *, gamma, lam) -> (adv_bt, returns_bt)` for `name`."""
  return _lookup(TOKEN_ADVANTAGE_ESTIMATORS, "token advantage estimator", name)


def get_policy_loss(name: str) -> Callable:
  """Returns the per-token policy loss `fn(logp_bt, old_logp_bt, adv, **hparams) -> (loss_bt, stats)`."""
  return _lookup(POLICY_LOSSES, "policy loss", name)


def get_kl_estimator(name: str) -> Callable:
  """Returns the per-token KL estimator `fn(logp_bt, ref_logp_bt) -> kl_bt` registered as `name`."""
  return _lookup(KL_ESTIMATORS, "KL estimator", name)


def get_token_weights_fn(name: str) -> Callable:
  """Returns `fn(mask_bt, *, norm_len=None) -> weights_bt` for the aggregation mode `name`."""
  return _lookup(AGGREGATIONS, "aggregation", name)


def _marked(decorate: Callable[[F], F], marks: set[str] | None, name: str) -> Callable[[F], F]:
  """``decorate``, then ``name`` added to the set ``marks`` (none if None)."""

  def decorator(fn: F) -> F:
    fn = decorate(fn)
    if marks is not None:
      marks.add(name)
    return fn

  return decorator


def check_aggregation(name: str) -> str:
  """Returns `name` if it is a known aggregation mode, else raises ValueError listing the known ones."""
  _lookup(AGGREGATIONS, "aggregation", name)
  return name


def register_advantage(name: str, params: type | None = None, *, per_group: bool = False) -> Callable[[F], F]:
  """Decorator registering `fn(rewards_b, group_size, **hparams) -> adv_b` under `name`; `params`: the
  dataclass of its hyperparameters (none if None). `per_group=True` declares that a sample's advantage
  depends on its own group's rewards only (GRPO, RLOO); such an estimator is computed one group at a time
  by the host's advantage stage (`orchestration/advantage_stage.py`). Without it the estimator sees the
  whole batch, inside the update's program."""
  return _marked(_register(ADVANTAGE_ESTIMATORS, "advantage estimator", name, params, ADVANTAGE_PARAMS),
                 PER_GROUP_ADVANTAGES if per_group else None, name)


def register_token_advantage(name: str, params: type | None = None) -> Callable[[F], F]:
  """Decorator registering `fn(token_rewards_bt, values_bt, mask_bt, **hparams) -> (adv_bt, returns_bt)`.

  With packed rows (`optim.pack_rows`) a row holds several responses, each followed by a position outside
  the mask (the next sample's prompt or padding): `fn` must treat every run of the mask as its own
  episode (as `gae` does: nothing past a response's last token is bootstrapped)."""
  return _register(TOKEN_ADVANTAGE_ESTIMATORS, "token advantage estimator", name, params, ADVANTAGE_PARAMS)


def register_policy_loss(name: str, params: type | None = None, *, row_level: bool = False) -> Callable[[F], F]:
  """Decorator registering `fn(logp_bt, old_logp_bt, adv, *, mask_bt, **hparams) -> (loss_bt, stats)`.

  `params`: the dataclass of its hyperparameters (passed as keywords); `fn` returns the
  `losses.POLICY_LOSS_STATS` keys and accepts `proximal_logp_bt` (see above). `row_level`: it reduces
  over a whole row, so packed rows (several samples per row) are refused.
  """
  return _marked(_register(POLICY_LOSSES, "policy loss", name, params, POLICY_LOSS_PARAMS),
                 ROW_LEVEL_POLICY_LOSSES if row_level else None, name)


def register_kl_estimator(name: str) -> Callable[[F], F]:
  """Decorator registering `fn(logp_bt, ref_logp_bt) -> kl_bt` under `name`."""
  return _register(KL_ESTIMATORS, "KL estimator", name)


# ----------------------------------------------------------------------------------------------------
# Hyperparameters and plugins
# ----------------------------------------------------------------------------------------------------

def parse_kwargs(text, where: str) -> dict:
  """``"a=1,b=0.5,c=None"`` (or a mapping) -> {name: value}; values are Python literals (``inf``, ``nan``
  and bare words are kept as float / str)."""
  if isinstance(text, Mapping):
    return dict(text)
  out = {}
  for item in filter(None, (part.strip() for part in str(text or "").split(","))):
    key, sep, value = item.partition("=")
    key, value = key.strip(), value.strip()
    if not sep or not key.isidentifier():
      raise ValueError(f"{where}: expected name=value pairs separated by commas, got {item!r}")
    try:
      out[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      try:
        out[key] = float(value)
      except ValueError:
        out[key] = value
  return out


def hyperparameters(params_table: dict[str, type], what: str, name: str, shared: Mapping, kwargs,
                    where: str):
  """The hyperparameter dataclass instance of the registered `name` (None when it has none): its fields
  from `kwargs` (``parse_kwargs``), else from `shared` (the config's fields of the same name), else the
  dataclass defaults. Errors name the field: ``{where}.{field}``."""
  given = parse_kwargs(kwargs, where)
  cls = params_table.get(name)
  if cls is None:
    if given:
      raise ValueError(f"{where}: the {what} {name!r} takes no hyperparameters; got {sorted(given)}")
    return None
  names = [f.name for f in dataclasses.fields(cls)]
  for key in given:
    if key not in names:
      raise ValueError(f"{where}.{key}: not a hyperparameter of the {what} {name!r}; known: {names}")
  values = {k: shared[k] for k in names if k in shared} | given
  try:
    return cls(**values)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{where} ({what} {name!r}, values {values}): {e}") from e


def hparams_dict(instance) -> dict:
  """A hyperparameter dataclass instance as keyword arguments ({} for None)."""
  return {} if instance is None else {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance)}


_PLUGINS: dict[str, object] = {}


def load_plugins(spec: str, where: str = "algo.plugins") -> None:
  """Imports each comma-separated plugin of `spec` once per process: a module name, or a path to a .py file
  (loaded as a module of that file's stem). Its decorators register what it defines."""
  for item in filter(None, (part.strip() for part in str(spec or "").split(","))):
    if item in _PLUGINS:
      continue
    try:
      if item.endswith(".py"):
        path = pathlib.Path(item).expanduser().resolve()
        if not path.is_file():
          raise FileNotFoundError(f"no file {path}")
        module_spec = importlib.util.spec_from_file_location(f"rl_fusion_jax_plugin_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module     # dataclasses look their module up while it runs
        try:
          module_spec.loader.exec_module(module)
        except BaseException:
          del sys.modules[module_spec.name]
          raise
      else:
        module = importlib.import_module(item)
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f"{where}: cannot import {item!r}: {type(e).__name__}: {e}") from e
    _PLUGINS[item] = module


# The shipped estimators and losses, registered as a fork's would be.
register_advantage("grpo", per_group=True)(functools.partial(advantages.group_advantages, scale="std"))
register_advantage("dr_grpo", per_group=True)(functools.partial(advantages.group_advantages, scale="none"))
register_advantage("rloo", per_group=True)(advantages.rloo_advantages)
register_token_advantage("gae", params=advantages.GAEParams)(advantages.gae)
register_policy_loss("ppo_clip", params=losses.ClipParams)(losses.clipped_surrogate)
register_policy_loss("decoupled_ppo", params=offpolicy.OffPolicyParams)(offpolicy.decoupled_ppo_surrogate)
register_policy_loss("tis_token", params=offpolicy.TISParams)(offpolicy.tis_token_loss)
register_policy_loss("tis_seq", params=offpolicy.TISParams, row_level=True)(offpolicy.tis_seq_loss)
register_policy_loss("uncorrected", params=offpolicy.OffPolicyParams)(offpolicy.uncorrected_surrogate)
