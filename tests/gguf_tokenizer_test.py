"""The tokenizer of a GGUF's metadata (gguf_tokenizer.py), read back through HFTokenizer from the converted
folder: byte-level BPE with the merges in priority order, SmolLM2's digit split, control tokens kept whole,
the chat template and the special ids. Expected ids are worked out by hand from tiny_gguf's vocabulary.
"""
import json
import os

import pytest

pytest.importorskip("gguf")

from rl_fusion_jax import gguf_tokenizer, tokenizer as tokenizer_lib  # noqa: E402
from rl_fusion_jax.models import gguf_io  # noqa: E402
from rl_fusion_jax.testing import tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  root = tmp_path_factory.mktemp("gguf_tok")
  tiny_gguf.write_tiny_gguf(str(root / "tiny.gguf"))
  gguf_io.convert_gguf(str(root / "tiny.gguf"), str(root / "hf"))
  return tokenizer_lib.load_tokenizer(str(root / "hf"))


def _id(token: str) -> int:
  return tiny_gguf.tokens().index(token)


def _byte(ch: str) -> int:
  return _id(gguf_tokenizer.bytes_to_unicode()[ord(ch)])


def test_merges_apply_in_priority_order(tok):
  assert tok.encode("hello world") == [_id("hello"), _id("Ġworld")]
  assert tok.encode("hell") == [_id("hell")]
  assert tok.encode("ll o") == [_id("ll"), _id("Ġ"), _byte("o")]


def test_every_digit_is_its_own_piece(tok):
  """SmolLM2's pre-tokenizer ("smollm") splits each digit off first: the merges "1 2" and "Ġ 1" never apply."""
  assert tok.encode("x12 1") == [_byte("x"), _byte("1"), _byte("2"), _id("Ġ"), _byte("1")]


def test_special_and_user_defined_tokens_stay_whole(tok):
  assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [
      1, *(_byte(c) for c in "user"), _id("Ċ"), _byte("h"), _byte("i"), 2]
  assert tok.encode("a<tool>b") == [_byte("a"), _id("<tool>"), _byte("b")]


def test_unicode_round_trips_through_bytes(tok):
  text = "naïve café — 東京 🚀 ²³"
  ids = tok.encode(text)
  assert len(ids) == len(text.encode("utf-8"))   # no merge applies: one id per byte
  assert tok.decode(ids) == text


def test_special_ids_and_chat_template(tok):
  assert (tok.eos_id, tok.bos_id, tok.pad_id, tok.vocab_size) == (2, 1, 2, len(tiny_gguf.tokens()))
  assert tok.special_tokens["eos_token"] == "<|im_end|>" and tok.special_tokens["unk_token"] == "<|endoftext|>"
  text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
  assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                  "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
  chat = tok.for_chat()
  assert (chat.eos_id, chat.bos_id) == (2, None)
  assert chat.encode_chat([{"role": "user", "content": "Hi"}])[:2] == [1, _byte("s")]


def test_tokenizer_config_names_the_special_tokens(tok):
  with open(os.path.join(os.path.dirname(tok.source), "tokenizer_config.json"), encoding="utf-8") as f:
    config = json.load(f)
  assert config["bos_token"] == "<|im_start|>" and config["pad_token"] == "<|im_end|>"
  assert config["add_bos_token"] is False


def _metadata(**changes):
  meta = {key: value for key, (value, _) in tiny_gguf.metadata(len(tiny_gguf.tokens())).items()}
  meta.update(changes)
  return meta


@pytest.mark.parametrize("changes, message", [
    (dict(**{"tokenizer.ggml.token_type": [1, 1]}), "tokenizer.ggml.token_type has 2 entries for 271 tokens"),
    (dict(**{"tokenizer.ggml.eos_token_id": 999}), "tokenizer.ggml.eos_token_id=999 outside the 271 tokens"),
    (dict(**{"tokenizer.ggml.merges": ["h e", "hx"]}), r"tokenizer.ggml.merges\[1\]='hx' is not two tokens"),
    (dict(**{"tokenizer.ggml.merges": ["h q_unknown"]}), "tokenizer.ggml.merges do not fit tokenizer.ggml.tokens"),
    (dict(**{"tokenizer.ggml.tokens": ["a", "a"], "tokenizer.ggml.token_type": [1, 1],
             "tokenizer.ggml.eos_token_id": 0, "tokenizer.ggml.bos_token_id": 0,
             "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.padding_token_id": 0}),
     "tokenizer.ggml.tokens holds 'a' twice"),
])
def test_metadata_errors_name_the_key(changes, message):
  with pytest.raises(ValueError, match=message) as e:
    gguf_tokenizer.tokenizer_files(_metadata(**changes), "/x/model.gguf")
  assert str(e.value).startswith("/x/model.gguf: ")
