"""Builds, saves and loads the policy: a locally trained byte-level BPE tokenizer and a tiny HF causal LM.

The embedded default has no model hub: `bootstrap` trains the tokenizer on environment text and builds a small
Qwen2 (or Llama) model from a config. A real user points `load_policy` at any local HF model folder instead.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from models.config import TinyModelConfig

ENDOFTEXT = "<|endoftext|>"

# Qwen2's pre-tokenization regex. `AutoTokenizer` on a qwen2 folder returns `Qwen2Tokenizer`, which rebuilds its
# pre-tokenizer from this regex, so the tokenizer must be trained with exactly this pipeline for ids to match.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

ARCHITECTURES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}


def train_tokenizer(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE tokenizer whose ids survive `save_pretrained` + `AutoTokenizer.from_pretrained`.

    The pipeline is Qwen2's (NFC, regex split, byte-level without prefix space, byte-level decoder), so any text
    encodes (the 256 byte symbols are always in the vocabulary) and decode(encode(text)) == NFC(text).
    `<|endoftext|>` is id 0 and serves as eos and pad.
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 (256 byte symbols + {ENDOFTEXT}), got {vocab_size}")
    tokenizer = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=ENDOFTEXT, pad_token=ENDOFTEXT)


def build_model(tokenizer: PreTrainedTokenizerBase, cfg: TinyModelConfig, *, seed: int) -> PreTrainedModel:
    """A randomly initialized float32 causal LM of architecture `cfg.arch` with tied embeddings, sized to
    `tokenizer`."""
    config_cls, model_cls = ARCHITECTURES[cfg.arch]
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    bos_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos_id
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    # A local generator would not reach HF's in-module init, so seed the global RNG and restore it afterwards.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.to(torch.float32)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.generation_config.bos_token_id = bos_id
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def save_policy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> Path:
    """Writes model (safetensors) and tokenizer into one folder that `load_policy` (and vLLM) can read."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def load_policy(path: str | Path, *, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Loads a policy folder offline; returns (model in eval mode, tokenizer)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"policy folder {path} is missing or has no config.json: run `dvc repro bootstrap` "
            "(or point the policy path at a local Hugging Face model folder)"
        )
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model.eval()
    return model, tokenizer


TOKENIZER_PROBE = "Task: go north. State: 3 coins, a lamp."


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The folder's tokenizer, offline, after checking that it can tokenize: a folder without its tokenizer files
    (tokenizer.json, or vocab/merges) loads as a one-token tokenizer that turns every text into no ids, and
    everything built on it would be silently wrong."""
    path = Path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load a tokenizer from {path}: {err}") from err
    ids = tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False)
    if len(tokenizer) < 2 or not ids or TOKENIZER_PROBE not in tokenizer.decode(ids, skip_special_tokens=True):
        present = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        raise ValueError(f"the tokenizer in {path} cannot tokenize text ({len(tokenizer)} tokens; {TOKENIZER_PROBE!r} "
                         f"-> {ids[:8]}): the folder has {present} but not its tokenizer files (tokenizer.json, or "
                         "vocab.json + merges.txt); copy them from the model the policy was saved from")
    return tokenizer
