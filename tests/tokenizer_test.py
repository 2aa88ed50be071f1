"""Tests for rl_fusion_jax/tokenizer.py: CharTokenizer ids by hand, HFTokenizer against `tokenizers`."""

import json
import pickle

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from rl_fusion_jax import tokenizer as tok_lib
from rl_fusion_jax.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer

# ----------------------------------------------------------------------------------------------------
# CharTokenizer
# ----------------------------------------------------------------------------------------------------


def test_char_special_ids_and_small_alphabet_ids():
  tok = CharTokenizer("ab")
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  # 3 special ids, then 'a' -> 3, 'b' -> 4.
  assert tok.vocab_size == 5
  assert tok.encode("ba") == [4, 3]
  assert tok.encode("") == []


def test_char_default_alphabet_ids_by_hand():
  tok = CharTokenizer()
  # Default alphabet: 10 digits (ids 3..12), 26 lower (13..38), 26 upper (39..64), then ' ' at
  # alphabet index 62 -> id 65, '+' at 63 -> 66, '-' 64 -> 67, '*' 65 -> 68, '/' 66 -> 69,
  # '(' 67 -> 70, ')' 68 -> 71, '=' 69 -> 72.
  assert tok.encode("12+3=") == [4, 5, 66, 6, 72]
  assert tok.encode("aZ ") == [13, 64, 65]


def test_char_round_trip_default_alphabet():
  tok = CharTokenizer()
  text = "3 5 7 -> 22:\n12+345=357 #### 1,234.5? (a*b)/c"
  assert tok.decode(tok.encode(text)) == text


def test_char_decode_skips_pad_and_does_not_stop_at_eos():
  tok = CharTokenizer("ab")
  # bos, 'a', eos, 'b', pad, pad: specials have no text and eos does not end the decode.
  assert tok.decode([1, 3, 2, 4, 0, 0]) == "ab"


def test_char_unknown_character_error_names_char_and_position():
  tok = CharTokenizer("abc")
  with pytest.raises(ValueError, match=r"'z' at position 2"):
    tok.encode("abzc")


def test_char_vocab_padding():
  tok = CharTokenizer("ab", vocab_size=512)
  assert tok.vocab_size == 512
  assert tok.encode("ab") == [3, 4]
  # id 100 is inside the padded vocabulary but has no character.
  assert tok.decode([3, 100]) == "a\ufffd"
  with pytest.raises(ValueError, match="outside"):
    tok.decode([512])
  with pytest.raises(ValueError, match="outside"):
    tok.decode([-1])


def test_char_vocab_too_small_raises():
  # "abc" needs 3 + 3 = 6 ids.
  CharTokenizer("abc", vocab_size=6)
  with pytest.raises(ValueError, match=r"vocab_size=5 .*6 ids"):
    CharTokenizer("abc", vocab_size=5)


@pytest.mark.parametrize("alphabet", ["", "abca"])
def test_char_bad_alphabet_raises(alphabet):
  with pytest.raises(ValueError, match="alphabet"):
    CharTokenizer(alphabet)


def test_char_json_and_pickle_round_trip():
  tok = CharTokenizer("xyz0", vocab_size=16)
  for restored in (CharTokenizer.from_json(tok.to_json()), pickle.loads(pickle.dumps(tok))):
    assert restored == tok
    assert restored.encode("0zyx") == tok.encode("0zyx") == [6, 5, 4, 3]
    assert restored.vocab_size == 16


@pytest.mark.parametrize(
    "text, field",
    [
        ("not json", "JSON"),
        ('{"type": "bpe", "alphabet": "ab", "vocab_size": 5}', "'type'"),
        ('{"type": "char", "vocab_size": 5}', "'alphabet'"),
        ('{"type": "char", "alphabet": "ab", "vocab_size": "5"}', "'vocab_size'"),
    ],
)
def test_char_from_json_errors_name_the_field(text, field):
  with pytest.raises(ValueError, match=field):
    CharTokenizer.from_json(text)


def test_char_tokenizer_is_a_tokenizer():
  assert isinstance(CharTokenizer(), tok_lib.Tokenizer)


# ----------------------------------------------------------------------------------------------------
# HFTokenizer: a byte-level BPE trained here on a few strings, written to tmp_path.
# ----------------------------------------------------------------------------------------------------

_SPECIALS = ["<pad>", "<s>", "</s>"]


def _train_bpe() -> tokenizers.Tokenizer:
  bpe = tokenizers.Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=300,
      special_tokens=_SPECIALS,
      show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  bpe.train_from_iterator(["12+34=46", "hello world", "the answer is 42"], trainer)
  return bpe


@pytest.fixture(name="bpe")
def fixture_bpe():
  return _train_bpe()


def _write(folder, bpe, config=None, special_map=None):
  bpe.save(str(folder / "tokenizer.json"))
  if config is not None:
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
  if special_map is not None:
    (folder / "special_tokens_map.json").write_text(json.dumps(special_map))
  return folder / "tokenizer.json"


def test_hf_reads_tokenizer_config(tmp_path, bpe):
  config = {"eos_token": "</s>", "bos_token": {"content": "<s>", "special": True}, "pad_token": "<pad>"}
  hf = HFTokenizer.from_file(_write(tmp_path, bpe, config=config))
  assert hf.eos_id == bpe.token_to_id("</s>")
  assert hf.bos_id == bpe.token_to_id("<s>")
  assert hf.pad_id == bpe.token_to_id("<pad>")
  assert hf.vocab_size == bpe.get_vocab_size(with_added_tokens=True)
  assert isinstance(hf, tok_lib.Tokenizer)


def test_hf_round_trip_matches_library_and_adds_no_specials(tmp_path, bpe):
  hf = HFTokenizer.from_file(_write(tmp_path, bpe, config={"eos_token": "</s>", "pad_token": "<pad>"}))
  text = "hello 12+3=15, the answer is 42"
  ids = hf.encode(text)
  assert ids == bpe.encode(text, add_special_tokens=False).ids
  assert hf.eos_id not in ids and hf.pad_id not in ids
  assert hf.decode(ids) == text
  # pad dropped, eos kept as its text, nothing after eos cut.
  assert hf.decode(ids + [hf.eos_id] + hf.encode("hi") + [hf.pad_id] * 3) == text + "</s>hi"


def test_hf_special_tokens_map_and_pad_fallback(tmp_path, bpe):
  # Folder path, only special_tokens_map.json, no pad: pad falls back to eos.
  _write(tmp_path, bpe, special_map={"eos_token": {"content": "</s>", "lstrip": False}})
  hf = HFTokenizer.from_file(tmp_path)
  assert hf.eos_id == hf.pad_id == bpe.token_to_id("</s>")
  assert hf.bos_id is None


def test_hf_tokenizer_config_wins_over_special_tokens_map(tmp_path, bpe):
  path = _write(
      tmp_path, bpe, config={"eos_token": "</s>"}, special_map={"eos_token": "<s>", "pad_token": "<pad>"}
  )
  hf = HFTokenizer.from_file(path)
  assert hf.eos_id == bpe.token_to_id("</s>")
  assert hf.pad_id == bpe.token_to_id("<pad>")  # Filled from the map, which the config left unset.


def test_hf_explicit_arguments_win(tmp_path, bpe):
  path = _write(tmp_path, bpe, config={"eos_token": "</s>", "pad_token": "<pad>"})
  hf = HFTokenizer.from_file(path, eos_token="<s>", pad_token=2, vocab_size=512)
  assert hf.eos_id == bpe.token_to_id("<s>")
  assert hf.pad_id == 2
  assert hf.vocab_size == 512


def test_hf_no_eos_raises_naming_path(tmp_path, bpe):
  path = _write(tmp_path, bpe)
  with pytest.raises(ValueError, match=r"no eos token .*tokenizer\.json.*eos_token="):
    HFTokenizer.from_file(path)


def test_hf_missing_file_names_path(tmp_path):
  missing = tmp_path / "nowhere" / "tokenizer.json"
  with pytest.raises(FileNotFoundError, match=str(missing)):
    HFTokenizer.from_file(missing)
  with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
    HFTokenizer.from_file(tmp_path)  # A folder without tokenizer.json.


def test_hf_malformed_tokenizer_file_names_path(tmp_path):
  path = tmp_path / "tokenizer.json"
  path.write_text("{not json")
  with pytest.raises(ValueError, match=f"cannot load tokenizer file {path}"):
    HFTokenizer.from_file(path, eos_token=0)


def test_hf_malformed_config_names_config_path(tmp_path, bpe):
  path = _write(tmp_path, bpe)
  (tmp_path / "tokenizer_config.json").write_text("[1, 2")
  with pytest.raises(ValueError, match=str(tmp_path / "tokenizer_config.json")):
    HFTokenizer.from_file(path)
  (tmp_path / "tokenizer_config.json").write_text('{"eos_token": 7}')
  with pytest.raises(ValueError, match="eos_token must be a string"):
    HFTokenizer.from_file(path)


def test_hf_unknown_token_and_small_vocab_raise(tmp_path, bpe):
  path = _write(tmp_path, bpe, config={"eos_token": "<|end|>"})
  with pytest.raises(ValueError, match=r"eos token '<\|end\|>' is not in the vocabulary"):
    HFTokenizer.from_file(path)
  with pytest.raises(ValueError, match="vocab_size=10"):
    HFTokenizer.from_file(path, eos_token="</s>", vocab_size=10)


def test_hf_generation_config_eos_ids(tmp_path, bpe):
  path = _write(tmp_path, bpe, config={"pad_token": "<pad>"})
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
  hf = HFTokenizer.from_file(path)  # No eos in the tokenizer configs: generation_config's first one.
  assert (hf.eos_id, hf.eos_ids, hf.pad_id) == (2, (2, 1), 0)
  _write(tmp_path, bpe, config={"eos_token": "<s>"})
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
  hf = HFTokenizer.from_file(path)  # The tokenizer's own eos comes first.
  assert (hf.eos_id, hf.eos_ids) == (1, (1, 2))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
  with pytest.raises(ValueError, match=r"generation_config\.json: eos_token_id must be"):
    HFTokenizer.from_file(path)


def test_hf_added_tokens_decoder_adds_missing_tokens_at_their_ids(tmp_path, bpe):
  size = bpe.get_vocab_size(with_added_tokens=True)
  decoder = {"2": {"content": "</s>", "special": True}, str(size): {"content": "<|im_end|>", "special": True}}
  path = _write(tmp_path, bpe, config={"eos_token": "<|im_end|>", "added_tokens_decoder": decoder})
  hf = HFTokenizer.from_file(path)
  assert hf.eos_id == size and hf.vocab_size == size + 1
  assert hf.encode("hi<|im_end|>")[-1] == size  # Matched as one token inside text.
  decoder = {str(size + 5): {"content": "<|im_end|>", "special": True}}
  _write(tmp_path, bpe, config={"eos_token": "</s>", "added_tokens_decoder": decoder})
  message = (rf"tokenizer_config\.json: added_tokens_decoder declares '<\|im_end\|>' as id {size + 5}, "
             rf"but the tokenizer file gives it id {size}")
  with pytest.raises(ValueError, match=message):
    HFTokenizer.from_file(path)


def test_hf_template_sees_the_special_tokens(tmp_path, bpe):
  config = {"eos_token": "</s>", "bos_token": {"content": "<s>"}, "unk_token": None,
            "additional_special_tokens": ["<pad>"],
            "chat_template": "{{ bos_token }}|{{ eos_token }}|{{ additional_special_tokens[0] }}|"
                             "{{ unk_token }}"}
  hf = HFTokenizer.from_file(_write(tmp_path, bpe, config=config))
  user = [{"role": "user", "content": "x"}]
  assert hf.apply_chat_template(user) == "<s>|</s>|<pad>|"  # unk_token unset: renders as nothing.
  assert pickle.loads(pickle.dumps(hf)).apply_chat_template(user) == "<s>|</s>|<pad>|"


# ----------------------------------------------------------------------------------------------------
# load_tokenizer
# ----------------------------------------------------------------------------------------------------


def test_load_tokenizer_char_and_hf(tmp_path, bpe):
  assert load_tokenizer("char") == CharTokenizer()
  assert load_tokenizer("char", vocab_size=512).vocab_size == 512
  path = _write(tmp_path, bpe, config={"eos_token": "</s>"})
  for spec in (path, str(path), tmp_path):
    loaded = load_tokenizer(spec)
    assert isinstance(loaded, HFTokenizer)
    assert loaded.eos_id == bpe.token_to_id("</s>")


def test_load_tokenizer_saved_char_tokenizer(tmp_path):
  saved = CharTokenizer("0123456789+=", vocab_size=32)
  (tmp_path / "char_tokenizer.json").write_text(saved.to_json())
  assert load_tokenizer(tmp_path) == saved
  assert load_tokenizer(tmp_path / "char_tokenizer.json") == saved
  assert load_tokenizer(tmp_path, vocab_size=64).vocab_size == 64


@pytest.mark.parametrize("spec", ["bpe", "/no/such/tokenizer.json", ""])
def test_load_tokenizer_unknown_spec_raises(spec):
  with pytest.raises(ValueError, match="neither 'char' nor"):
    load_tokenizer(spec)


def test_load_tokenizer_empty_folder_raises(tmp_path):
  with pytest.raises(ValueError, match=f"folder {tmp_path} holds neither"):
    load_tokenizer(tmp_path)
