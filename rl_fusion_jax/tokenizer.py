"""Tokenizers behind one small interface, shared by generation, supervised warm-up and the tasks.

Two implementations:

* `CharTokenizer`: one id per character of a fixed alphabet. It needs no files, so the tiny models the
  tests and the CPU quickstart train can learn the procedural tasks (`rewards/`) from scratch.
* `HFTokenizer`: a Hugging Face `tokenizer.json` (the `tokenizers` library), with eos / pad / bos read
  from the `tokenizer_config.json` / `special_tokens_map.json` next to it (and `generation_config.json`'s
  eos ids), plus the checkpoint's chat template (`chat_template.jinja`, else `tokenizer_config.json`'s
  `chat_template`), for real checkpoints.

Conventions every caller can rely on:

* `encode(text)` returns the ids of `text` only; it never adds bos or eos (the caller decides).
* `decode(ids)` drops pad ids and never stops at eos: cutting a completion at its first eos is the
  generation engine's job, done before decoding.

This module never touches jax: tokenization happens on the host, outside jitted code.
"""

from __future__ import annotations

import json
import os
import string
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import tokenizers

from rl_fusion_jax import chat

__all__ = ["DEFAULT_ALPHABET", "CharTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
  """What generation and the tasks need from a tokenizer."""

  vocab_size: int
  pad_id: int
  eos_id: int
  bos_id: int | None

  def encode(self, text: str) -> list[int]:
    """Ids of `text`, without bos or eos."""

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`; pad ids are dropped, eos does not end the text."""


# ----------------------------------------------------------------------------------------------------
# Character-level tokenizer.
# ----------------------------------------------------------------------------------------------------

# Enough for the procedural tasks ("12+345=", "3 5 7 -> 22:") and short GSM8K-style text.
DEFAULT_ALPHABET = (
    string.digits + string.ascii_lowercase + string.ascii_uppercase + " +-*/()=:,.?#\n<>!'\"$%;_"
)

_CHAR_JSON_TYPE = "char"
_NUM_SPECIAL = 3  # pad, bos, eos come before the alphabet.
# Ids inside a padded vocabulary but past the alphabet have no character. A model can still sample
# them, so they decode to the replacement character (which no verifier accepts) instead of raising.
_UNUSED_ID_TEXT = "\ufffd"


class CharTokenizer:
  """One id per character: 0 = pad, 1 = bos, 2 = eos, then the alphabet in order.

  Plain attributes only, so instances pickle; `to_json` / `from_json` save it next to a checkpoint.
  """

  def __init__(self, alphabet: str = DEFAULT_ALPHABET, vocab_size: int | None = None):
    _check_alphabet(alphabet)
    needed = _NUM_SPECIAL + len(alphabet)
    if vocab_size is None:
      vocab_size = needed
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < needed:
      raise ValueError(
          f"CharTokenizer: vocab_size={vocab_size!r} is smaller than the {needed} ids needed "
          f"({_NUM_SPECIAL} special + {len(alphabet)} characters)"
      )
    self.alphabet = alphabet
    self.vocab_size = vocab_size
    self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
    self._char_to_id = {ch: _NUM_SPECIAL + i for i, ch in enumerate(alphabet)}

  def encode(self, text: str) -> list[int]:
    ids = []
    for pos, ch in enumerate(text):
      token_id = self._char_to_id.get(ch)
      if token_id is None:
        raise ValueError(f"CharTokenizer.encode: character {ch!r} at position {pos} is not in the alphabet")
      ids.append(token_id)
    return ids

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`; pad, bos and eos have no text, unused padded ids give U+FFFD."""
    pieces = []
    for pos, token_id in enumerate(ids):
      token_id = int(token_id)
      if not 0 <= token_id < self.vocab_size:
        raise ValueError(
            f"CharTokenizer.decode: id {token_id} at position {pos} is outside "
            f"[0, vocab_size={self.vocab_size})"
        )
      if token_id < _NUM_SPECIAL:
        continue
      index = token_id - _NUM_SPECIAL
      pieces.append(self.alphabet[index] if index < len(self.alphabet) else _UNUSED_ID_TEXT)
    return "".join(pieces)

  def to_json(self) -> str:
    return json.dumps({"type": _CHAR_JSON_TYPE, "alphabet": self.alphabet, "vocab_size": self.vocab_size})

  @classmethod
  def from_json(cls, text: str) -> CharTokenizer:
    try:
      data = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(f"CharTokenizer.from_json: not valid JSON ({e})") from e
    if not isinstance(data, dict) or data.get("type") != _CHAR_JSON_TYPE:
      raise ValueError(f"CharTokenizer.from_json: field 'type' must be {_CHAR_JSON_TYPE!r}")
    for field, kind in (("alphabet", str), ("vocab_size", int)):
      if not isinstance(data.get(field), kind):
        raise ValueError(f"CharTokenizer.from_json: field {field!r} must be a {kind.__name__}")
    return cls(alphabet=data["alphabet"], vocab_size=data["vocab_size"])

  def __eq__(self, other: object) -> bool:
    return (
        isinstance(other, CharTokenizer)
        and self.alphabet == other.alphabet
        and self.vocab_size == other.vocab_size
    )

  def __hash__(self) -> int:
    return hash((self.alphabet, self.vocab_size))

  def __repr__(self) -> str:
    return f"CharTokenizer(alphabet={self.alphabet!r}, vocab_size={self.vocab_size})"


def _check_alphabet(alphabet: str) -> None:
  if not isinstance(alphabet, str) or not alphabet:
    raise ValueError(f"CharTokenizer: alphabet must be a non-empty str, got {alphabet!r}")
  seen = set()
  for pos, ch in enumerate(alphabet):
    if ch in seen:
      raise ValueError(f"CharTokenizer: alphabet repeats character {ch!r} at position {pos}")
    seen.add(ch)


# ----------------------------------------------------------------------------------------------------
# Hugging Face tokenizer.json.
# ----------------------------------------------------------------------------------------------------

TOKENIZER_FILE = "tokenizer.json"
CHAR_TOKENIZER_FILE = "char_tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# A separate template file wins over tokenizer_config.json's field, as in transformers.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
# Read in this order; a later file only fills the special tokens an earlier one left unset.
_CONFIG_FILES = (TOKENIZER_CONFIG_FILE, "special_tokens_map.json")
# The named special tokens a chat template sees as variables (transformers' special_tokens_map).
_SPECIAL_TOKEN_NAMES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
# Text of an assistant message when probing which eos token a template writes after one.
_PROBE = "PROBE_ASSISTANT_TEXT"

TokenSpec = str | int | None  # A token's text, its id, or unset.


class HFTokenizer:
  """A `tokenizers.Tokenizer` with resolved special-token ids and, when the checkpoint has one, its chat
  template.

  pad falls back to eos when no pad token is configured (the usual choice for decoder-only models).
  `vocab_size` may be padded up to the model's embedding size, never below the tokenizer's own.
  `eos_ids` lists every id the checkpoint declares as an end of sequence: `eos_id` first, then those only
  `generation_config.json` names (Qwen's `<|endoftext|>` next to `<|im_end|>`). Generation stops at
  `eos_id` alone; `for_chat` picks which one that is for chat prompts.
  """

  def __init__(
      self,
      tokenizer: tokenizers.Tokenizer,
      *,
      eos_id: int,
      pad_id: int | None = None,
      bos_id: int | None = None,
      vocab_size: int | None = None,
      source: str = "<memory>",
      eos_ids: Sequence[int] = (),
      chat_template: str | None = None,
      chat_template_source: str = "",
      special_tokens: Mapping[str, Any] | None = None,
  ):
    own_size = tokenizer.get_vocab_size(with_added_tokens=True)
    vocab_size = own_size if vocab_size is None else vocab_size
    if vocab_size < own_size:
      raise ValueError(
          f"HFTokenizer({source}): vocab_size={vocab_size} is smaller than the "
          f"tokenizer's {own_size} tokens"
      )
    eos_ids = tuple(dict.fromkeys([eos_id, *eos_ids]))
    named = [("eos_id", eos_id), ("pad_id", pad_id), ("bos_id", bos_id)]
    for field, value in named + [("eos_ids", i) for i in eos_ids]:
      if value is not None and not 0 <= value < own_size:
        raise ValueError(f"HFTokenizer({source}): {field}={value} outside [0, {own_size})")
    self.tokenizer = tokenizer
    self.vocab_size = vocab_size
    self.eos_id = eos_id
    self.eos_ids = eos_ids
    self.pad_id = eos_id if pad_id is None else pad_id
    self.bos_id = bos_id
    self.source = source
    self.chat_template = chat_template
    # The file the template came from, or (without one) a sentence saying where none was found.
    self.chat_template_source = chat_template_source
    self.special_tokens = dict(special_tokens or {})
    self._compiled: chat.ChatTemplate | None = None

  @classmethod
  def from_file(
      cls,
      path: str | os.PathLike,
      *,
      eos_token: TokenSpec = None,
      pad_token: TokenSpec = None,
      bos_token: TokenSpec = None,
      vocab_size: int | None = None,
  ) -> HFTokenizer:
    """Loads `path` (a tokenizer.json or a folder holding one); explicit tokens win over configs.

    Next to it: tokenizer_config.json, then special_tokens_map.json, give the special tokens (a later file
    only fills what an earlier one left unset); tokenizer_config.json's `added_tokens_decoder` adds the
    tokens tokenizer.json lacks (each must get its declared id); generation_config.json's `eos_token_id`
    (an int or a list) gives the eos when no config names one, and extra `eos_ids`; chat_template.jinja,
    else tokenizer_config.json's `chat_template` (a string, or a list of {name, template} from which the
    one named "default" is taken), is the chat template.
    """
    path = _resolve_tokenizer_json(os.fspath(path))
    try:
      tokenizer = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # The Rust binding raises a bare Exception for every failure.
      raise ValueError(f"HFTokenizer: cannot load tokenizer file {path}: {e}") from e
    folder = os.path.dirname(path)
    config_path = os.path.join(folder, TOKENIZER_CONFIG_FILE)
    config = _load_json_object(config_path) if os.path.isfile(config_path) else {}
    _add_declared_tokens(tokenizer, config.get("added_tokens_decoder"), config_path)
    configured = _read_special_tokens(folder)
    generation_eos = _generation_eos_ids(folder)
    explicit = {"eos": eos_token, "pad": pad_token, "bos": bos_token}
    ids = {}
    for role, value in explicit.items():
      spec = value if value is not None else configured.get(f"{role}_token")
      ids[role] = _token_id(tokenizer, spec, role, path)
    if ids["eos"] is None and generation_eos:
      ids["eos"] = generation_eos[0]
    if ids["eos"] is None:
      raise ValueError(
          f"HFTokenizer: no eos token for {path}: none in {' / '.join(_CONFIG_FILES)} or "
          f"{GENERATION_CONFIG_FILE} next to it; pass eos_token="
      )
    template, template_source = _read_chat_template(folder, config)
    return cls(
        tokenizer, eos_id=ids["eos"], pad_id=ids["pad"], bos_id=ids["bos"], vocab_size=vocab_size,
        source=path, eos_ids=generation_eos, chat_template=template, chat_template_source=template_source,
        special_tokens={**configured, **_explicit_texts(tokenizer, explicit)},
    )

  def encode(self, text: str) -> list[int]:
    return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids` with pad ids dropped; other special tokens keep their text."""
    kept = [int(i) for i in ids if int(i) != self.pad_id]
    return self.tokenizer.decode(kept, skip_special_tokens=False)

  # --------------------------------------------------------------------------------------------------
  # Chat template.
  # --------------------------------------------------------------------------------------------------

  def template(self) -> chat.ChatTemplate:
    """The compiled chat template (compiled once); a ValueError naming the file when there is none or it
    does not compile."""
    if self._compiled is None:
      if self.chat_template is None:
        raise ValueError(f"HFTokenizer({self.source}): no chat template: {self.chat_template_source}")
      self._compiled = chat.ChatTemplate(self.chat_template, self.chat_template_source, self.special_tokens)
    return self._compiled

  def apply_chat_template(self, messages: Sequence[chat.Message], add_generation_prompt: bool = True) -> str:
    """The chat template's text for `messages`, as transformers' `apply_chat_template(tokenize=False)`."""
    return self.template().render(messages, add_generation_prompt=add_generation_prompt)

  def encode_chat(self, messages: Sequence[chat.Message], add_generation_prompt: bool = True) -> list[int]:
    """Ids of the rendered conversation, adding no bos / eos beyond the template's own text (as
    transformers' `apply_chat_template(tokenize=True)`)."""
    return self.encode(self.apply_chat_template(messages, add_generation_prompt))

  def turn_end_id(self) -> int:
    """The id of `eos_ids` whose text the template writes right after an assistant message's content
    (Gemma: `<end_of_turn>` although eos is `<eos>`); `eos_id` when none does or the template refuses the
    probe conversation [user, assistant]."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
    try:
      text = self.apply_chat_template(probe, add_generation_prompt=False)
    except ValueError:
      return self.eos_id
    after = text[text.find(_PROBE) + len(_PROBE):] if _PROBE in text else ""
    for token_id in self.eos_ids:
      token = self.tokenizer.id_to_token(token_id)
      if token and after.startswith(token):
        return token_id
    return self.eos_id

  def for_chat(self) -> HFTokenizer:
    """The tokenizer a run with chat prompts uses: this one with `bos_id` None, since the rendered
    template is the whole prompt and holds bos exactly when the template writes it (transformers encodes
    it without adding special tokens), and `eos_id` = `turn_end_id()`, where an assistant turn ends.

    Compiles the template, so a missing or malformed one fails here, naming its file.
    """
    self.template()
    return HFTokenizer(
        self.tokenizer, eos_id=self.turn_end_id(), pad_id=self.pad_id, bos_id=None,
        vocab_size=self.vocab_size, source=self.source, eos_ids=self.eos_ids,
        chat_template=self.chat_template, chat_template_source=self.chat_template_source,
        special_tokens=self.special_tokens,
    )

  def __getstate__(self) -> dict[str, Any]:
    # A compiled jinja template does not pickle; it is rebuilt from the text on first use.
    return {**self.__dict__, "_compiled": None}

  def __repr__(self) -> str:
    return (
        f"HFTokenizer(source={self.source!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id}, "
        f"pad_id={self.pad_id}, bos_id={self.bos_id}, chat_template={self.chat_template is not None})"
    )


def _resolve_tokenizer_json(path: str) -> str:
  if os.path.isdir(path):
    path = os.path.join(path, TOKENIZER_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"HFTokenizer: tokenizer file not found: {path}")
  return path


def _read_special_tokens(folder: str) -> dict[str, Any]:
  """`{"eos_token": text, ...}`: the named special tokens (bos, eos, unk, sep, pad, cls, mask and the
  list `additional_special_tokens`) of the optional config files in `folder`; a chat template sees these."""
  texts: dict[str, Any] = {}
  for name in _CONFIG_FILES:
    config_path = os.path.join(folder, name)
    if not os.path.isfile(config_path):
      continue
    config = _load_json_object(config_path)
    for role in _SPECIAL_TOKEN_NAMES:
      entry = config.get(f"{role}_token")
      if f"{role}_token" not in texts and entry is not None:
        texts[f"{role}_token"] = _token_text(entry, f"{config_path}: {role}_token")
    extra = config.get("additional_special_tokens")
    if "additional_special_tokens" not in texts and isinstance(extra, list) and extra:
      where = f"{config_path}: additional_special_tokens"
      texts["additional_special_tokens"] = [_token_text(e, where) for e in extra]
  return texts


def _explicit_texts(tokenizer: tokenizers.Tokenizer, explicit: Mapping[str, TokenSpec]) -> dict[str, str]:
  """`{"eos_token": text, ...}` for the tokens passed to from_file, so a template sees those."""
  out = {}
  for role, spec in explicit.items():
    text = tokenizer.id_to_token(spec) if isinstance(spec, int) else spec
    if text is not None:
      out[f"{role}_token"] = text
  return out


def _add_declared_tokens(tokenizer: tokenizers.Tokenizer, decoder: Any, config_path: str) -> None:
  """Adds the `added_tokens_decoder` entries (id -> {"content", "special"}) tokenizer.json lacks.

  Each must land on its declared id (the model's embedding row); tokens tokenizer.json already has are
  left as they are. Mutates `tokenizer`.
  """
  if decoder is None:
    return
  where = f"{config_path}: added_tokens_decoder"
  if not isinstance(decoder, dict):
    raise ValueError(f"HFTokenizer: {where} must be an object mapping ids to tokens")
  entries = []
  for key, entry in decoder.items():
    if not str(key).isdigit():
      raise ValueError(f"HFTokenizer: {where}: key {key!r} is not a token id")
    special = isinstance(entry, dict) and bool(entry.get("special"))
    entries.append((int(key), _token_text(entry, f"{where}[{key}]"), special))
  for token_id, content, special in sorted(entries):
    if tokenizer.token_to_id(content) is not None:
      continue
    added = tokenizers.AddedToken(content, special=special, normalized=not special)
    (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([added])
    if tokenizer.token_to_id(content) != token_id:
      raise ValueError(f"HFTokenizer: {where} declares {content!r} as id {token_id}, but the tokenizer "
                       f"file gives it id {tokenizer.token_to_id(content)}")


def _generation_eos_ids(folder: str) -> tuple[int, ...]:
  """generation_config.json's `eos_token_id` (an int or a list of ints) as a tuple; () without one."""
  path = os.path.join(folder, GENERATION_CONFIG_FILE)
  if not os.path.isfile(path):
    return ()
  value = _load_json_object(path).get("eos_token_id")
  values = value if isinstance(value, list) else [] if value is None else [value]
  if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
    raise ValueError(f"HFTokenizer: {path}: eos_token_id must be a non-negative int or a list of them, "
                     f"got {value!r}")
  return tuple(values)


def _read_chat_template(folder: str, config: Mapping[str, Any]) -> tuple[str | None, str]:
  """(template text, the file it came from), or (None, a sentence saying where none was found)."""
  jinja_path = os.path.join(folder, CHAT_TEMPLATE_FILE)
  config_path = os.path.join(folder, TOKENIZER_CONFIG_FILE)
  if os.path.isfile(jinja_path):
    try:
      with open(jinja_path, encoding="utf-8") as f:
        return f.read(), jinja_path
    except (OSError, UnicodeDecodeError) as e:
      raise ValueError(f"HFTokenizer: cannot read {jinja_path}: {e}") from e
  entry = config.get("chat_template")
  if entry is None:
    return None, f"neither {jinja_path} nor a 'chat_template' field in {config_path}"
  if isinstance(entry, str):
    return entry, config_path
  if not isinstance(entry, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                            and isinstance(t.get("template"), str) for t in entry):
    raise ValueError(f"HFTokenizer: {config_path}: chat_template must be a string or a list of "
                     "{'name': str, 'template': str}")
  named = {t["name"]: t["template"] for t in entry}
  if "default" not in named:
    return None, f"{config_path} lists chat templates {sorted(named)} but none named 'default'"
  return named["default"], f"{config_path} (chat_template 'default')"


def _load_json_object(path: str) -> Mapping[str, Any]:
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"HFTokenizer: cannot read {path}: {e}") from e
  if not isinstance(data, dict):
    raise ValueError(f"HFTokenizer: {path} must hold a JSON object, got {type(data).__name__}")
  return data


def _token_text(entry: Any, where: str) -> str:
  # Configs write a token either as its text or as an AddedToken dict {"content": text, ...}.
  if isinstance(entry, dict):
    entry = entry.get("content")
  if not isinstance(entry, str):
    raise ValueError(f"HFTokenizer: {where} must be a string or {{'content': string}}")
  return entry


def _token_id(tokenizer: tokenizers.Tokenizer, spec: TokenSpec, role: str, path: str) -> int | None:
  if spec is None or isinstance(spec, int):
    return spec
  token_id = tokenizer.token_to_id(spec)
  if token_id is None:
    raise ValueError(f"HFTokenizer: {role} token {spec!r} is not in the vocabulary of {path}")
  return token_id


# ----------------------------------------------------------------------------------------------------
# One entry point for configs.
# ----------------------------------------------------------------------------------------------------


def load_tokenizer(spec: str | os.PathLike, *, vocab_size: int | None = None) -> Tokenizer:
  """`"char"` -> CharTokenizer; a tokenizer.json, a saved CharTokenizer JSON, or a folder holding either.

  In a folder `tokenizer.json` wins over `char_tokenizer.json`. A JSON file is a saved CharTokenizer
  when its top-level "type" is "char" (what `CharTokenizer.to_json` writes).
  """
  if spec == "char":
    return CharTokenizer(vocab_size=vocab_size)
  path = os.fspath(spec) if isinstance(spec, (str, os.PathLike)) else None
  if path is None or not os.path.exists(path):
    raise ValueError(
        f"load_tokenizer: {spec!r} is neither 'char' nor an existing tokenizer file " "or folder"
    )
  if os.path.isdir(path):
    candidates = [os.path.join(path, name) for name in (TOKENIZER_FILE, CHAR_TOKENIZER_FILE)]
    existing = [c for c in candidates if os.path.isfile(c)]
    if not existing:
      raise ValueError(
          f"load_tokenizer: folder {path} holds neither {TOKENIZER_FILE} nor " f"{CHAR_TOKENIZER_FILE}"
      )
    path = existing[0]
  if _is_char_tokenizer_file(path):
    with open(path, encoding="utf-8") as f:
      tokenizer = CharTokenizer.from_json(f.read())
    if vocab_size is not None and vocab_size != tokenizer.vocab_size:
      tokenizer = CharTokenizer(tokenizer.alphabet, vocab_size=vocab_size)
    return tokenizer
  return HFTokenizer.from_file(path, vocab_size=vocab_size)


def _is_char_tokenizer_file(path: str) -> bool:
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, ValueError):
    return False  # Not ours; HFTokenizer.from_file reports the real problem with the path.
  return isinstance(data, dict) and data.get("type") == _CHAR_JSON_TYPE
