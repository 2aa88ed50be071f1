"""Chat templates: a checkpoint's own prompt format, rendered the way transformers renders it.

A chat model is trained on conversations laid out by its chat template (a jinja2 program shipped in the
checkpoint's ``tokenizer_config.json`` or ``chat_template.jinja``). ``ChatTemplate`` compiles and renders
one in the environment of transformers' ``apply_chat_template``: an ``ImmutableSandboxedEnvironment``
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, ``{% generation %}`` blocks
(rendered as their body), the ``raise_exception`` global, a ``tojson`` filter that does not escape HTML,
and the variables ``messages``, ``add_generation_prompt``, ``tools`` / ``documents`` (None) and the
special tokens (``bos_token``, ``eos_token``, ...). One deliberate difference: there is no
``strftime_now`` global, so templates that print today's date fall back to their own fixed date (Llama
3.1's do) and a problem renders to the same prompt on every day, which a restartable data stream needs.

``ChatTask`` wraps a task so that each problem's prompt is that rendering of a one-turn conversation.
Every error names the file the template came from. This module reads no files and never touches jax.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rl_fusion_jax.rewards import base

__all__ = ["ChatTask", "ChatTemplate", "chat_task", "one_turn"]

Message = Mapping[str, Any]


class _GenerationBlocks(jinja2.ext.Extension):
  """``{% generation %}...{% endgeneration %}`` renders its body (transformers uses the tag to mark the
  assistant's tokens for loss masks; prompts need only the text)."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    return caller()


def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
  # transformers replaces jinja's own tojson, which escapes HTML characters such as '<'.
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[_GenerationBlocks, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  return env


class ChatTemplate:
  """One compiled chat template; ``where`` (the file it came from) is named in every error.

  Args:
    text: the jinja2 source.
    where: the file (and field) it was read from, e.g. ``/ckpt/tokenizer_config.json``.
    special_tokens: template variables such as ``{"bos_token": "<s>", "eos_token": "</s>"}``.
  """

  def __init__(self, text: str, where: str, special_tokens: Mapping[str, Any] | None = None):
    if not isinstance(text, str) or not text:
      raise ValueError(f"chat template in {where}: must be a non-empty string, got {text!r:.80}")
    self.text, self.where = text, where
    self.special_tokens = dict(special_tokens or {})
    try:
      self._template = _environment().from_string(text)
    except jinja2.TemplateSyntaxError as e:
      raise ValueError(f"chat template in {where}: jinja syntax error at line {e.lineno}: {e.message}") from e

  def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
    """The template's text for ``messages`` (each a dict with 'role' and 'content')."""
    _check_messages(messages, self.where)
    try:
      return self._template.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **self.special_tokens)
    except Exception as e:  # The template is a program from the checkpoint: any failure is its error.
      roles = [m["role"] for m in messages]
      raise ValueError(f"chat template in {self.where} failed to render a conversation with roles {roles} "
                       f"({type(e).__name__}: {e})") from e

  def __repr__(self) -> str:
    return f"ChatTemplate(where={self.where!r})"


def _check_messages(messages: Sequence[Message], where: str) -> None:
  if isinstance(messages, (str, bytes)) or not messages:
    raise ValueError(f"chat template in {where}: messages must be a non-empty list of dicts")
  for i, m in enumerate(messages):
    if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
      raise ValueError(f"chat template in {where}: messages[{i}] must be a dict with string 'role' and "
                       f"'content', got {m!r:.80}")


def one_turn(user: str, system_prompt: str = "") -> list[dict[str, str]]:
  """[system (when ``system_prompt`` is not empty), user] messages."""
  system = [{"role": "system", "content": system_prompt}] if system_prompt else []
  return system + [{"role": "user", "content": user}]


class ChatTask:
  """A task whose prompts are the chat template's rendering of one user turn.

  ``problem(i).prompt`` is ``render(one_turn(p.prompt.strip(), system_prompt))`` for the wrapped task's
  problem ``p``, with the generation prompt (the text that opens the assistant's turn). Answers, targets,
  meta and scoring are the wrapped task's. ``render`` is e.g. ``HFTokenizer.apply_chat_template``.
  """

  def __init__(self, task: base.Task, render: Callable[[Sequence[Message]], str], system_prompt: str = ""):
    self.task, self.render, self.system_prompt = task, render, system_prompt

  @property
  def name(self) -> str:
    return self.task.name

  def problem(self, index: int) -> base.Problem:
    plain = self.task.problem(index)
    return dataclasses.replace(plain, prompt=self.render(one_turn(plain.prompt.strip(), self.system_prompt)))

  def score(self, problem: base.Problem, completion: str) -> base.Score:
    return self.task.score(problem, completion)

  def __repr__(self) -> str:
    return f"ChatTask({self.task!r}, system_prompt={self.system_prompt!r})"


class _SizedChatTask(ChatTask):
  """A ChatTask over a task with a finite problem set (``len``), such as GSM8K's file."""

  def __len__(self) -> int:
    return len(self.task)


def chat_task(task: base.Task, render: Callable[[Sequence[Message]], str],
              system_prompt: str = "") -> ChatTask:
  """``ChatTask(task, ...)``, with ``len`` exactly when ``task`` has one (callers test ``hasattr``)."""
  cls = _SizedChatTask if hasattr(task, "__len__") else ChatTask
  return cls(task, render, system_prompt)
