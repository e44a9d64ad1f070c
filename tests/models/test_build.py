"""Tokenizer round-trip through AutoTokenizer, model building for both archs, save/load."""
from __future__ import annotations

import unicodedata

import pytest
import torch
from transformers import AutoTokenizer

from models.build import TinyModelConfig, build_model, count_parameters, load_policy, save_policy, train_tokenizer

SAMPLES = [
    "You are in the kitchen (room 3). Exits: north, east.\n> take key 21\n",
    "  leading spaces,  double  spaces and trailing   \n\n\n\ttabs\t\r\nCRLF",
    "digits 1234567890 and 3.14159 and -42",
    "unicode: Café naïve 東京 Ωmega 🚀 e\u0301 (combining accent)",
    "it's they're we've I'm you'll he'd",
    "",
]

SMALL = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
             max_position_embeddings=128)


def small(arch: str, **change) -> TinyModelConfig:
    return TinyModelConfig(arch=arch, **{**SMALL, **change})


@pytest.fixture(scope="module")
def tokenizer(env_like_texts):
    return train_tokenizer(env_like_texts, vocab_size=300)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_autotokenizer_on_saved_folder_gives_identical_ids_and_round_trips(tokenizer, arch, tmp_path):
    save_policy(build_model(tokenizer, small(arch), seed=0), tokenizer, tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    if arch == "qwen2":
        assert type(reloaded).__name__ == "Qwen2Tokenizer"  # the class that rebuilds its own pre-tokenizer
    for text in SAMPLES:
        ids = tokenizer(text)["input_ids"]
        assert reloaded(text)["input_ids"] == ids, text
        assert reloaded.decode(ids) == tokenizer.decode(ids)
        # decode round-trips up to NFC normalization ("e" + combining accent becomes "é")
        assert reloaded.decode(ids) == unicodedata.normalize("NFC", text)
    assert reloaded.eos_token == reloaded.pad_token == "<|endoftext|>"
    assert reloaded.eos_token_id == tokenizer.eos_token_id == 0


def test_tokenizer_learns_merges_and_rejects_tiny_vocab(tokenizer):
    assert len(tokenizer) == 300
    assert len(tokenizer("You are in the kitchen")["input_ids"]) < len("You are in the kitchen")
    with pytest.raises(ValueError, match="257"):
        train_tokenizer(["abc"], vocab_size=100)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_build_model_sets_ids_ties_embeddings_and_is_seeded(tokenizer, arch):
    model = build_model(tokenizer, small(arch), seed=0)
    assert model.config.model_type == arch
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == model.config.pad_token_id == tokenizer.eos_token_id
    assert model.config.bos_token_id == tokenizer.eos_token_id  # no bos token: eos stands in
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert next(model.parameters()).dtype == torch.float32
    again = build_model(tokenizer, small(arch), seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    other = build_model(tokenizer, small(arch), seed=1)
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, other.model.layers[0].mlp.up_proj.weight)
    # tied weights counted once: embedding + 1 layer + final norm
    assert count_parameters(model) == sum(p.numel() for p in set(model.parameters()))


def test_tiny_model_config_errors():
    with pytest.raises(ValueError, match=r"arch = 'gpt2': must be one of \['llama', 'qwen2'\]"):
        small("gpt2")
    with pytest.raises(ValueError, match=r"num_heads = 3: must be a divisor of hidden_size \(32\)"):
        small("qwen2", num_heads=3)
    with pytest.raises(ValueError, match=r"num_kv_heads = 3: must be a divisor of num_heads \(2\)"):
        small("qwen2", num_kv_heads=3)
    with pytest.raises(ValueError, match="num_layers = 0: must be > 0"):
        small("qwen2", num_layers=0)


def test_save_and_load_policy_round_trip(tiny_policy_dir):
    model, tokenizer = load_policy(tiny_policy_dir)
    assert (tiny_policy_dir / "model.safetensors").is_file()
    assert not model.training
    ids = torch.tensor([tokenizer("> take key 7\n")["input_ids"]])
    again, _ = load_policy(tiny_policy_dir)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)


def test_load_policy_missing_folder_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="dvc repro bootstrap"):
        load_policy(tmp_path / "nope")
