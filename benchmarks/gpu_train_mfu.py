"""DeepSpeed bf16 training throughput and MFU of SmolLM2-135M's architecture, through arlflow's own engine factory.

    python benchmarks/gpu_train_mfu.py [--steps 30] [--warmup 5] [--seq 1024] [--micro-batch 16] [--zero 0]
        [--peak-tflops 989] [--out result.json]
    python benchmarks/gpu_train_mfu.py --dry-run        # CPU, a 2-layer model, 3 steps: checks the script here

The model is built from SmolLM2-135M-Instruct's config (Llama, 30 layers, hidden 576, 9 heads / 3 KV heads, MLP
1536, vocab 49152, tied embeddings) with random weights: the FLOPs per token are the real model's, and nothing has
to be carried to a machine without network (the converted weights are 269 MB in bf16). Each step is a causal-LM
forward + backward + AdamW step on `--micro-batch` x `--seq` random tokens through `models.ds_engine.make_ds_engine`
(bf16, the ZeRO stage given). Tokens/s is timed over `--steps` steps after `--warmup` (CUDA synchronized);
MFU = tokens/s x FLOPs per token / peak, with FLOPs per token = 6 N (N = parameters, embeddings included since the
head is tied and runs every token) + 12 L d T (attention scores and values, forward + backward; PaLM's appendix B).
The H200's dense bf16 peak is 989 TFLOP/s (`--peak-tflops`).
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0)
DRY_RUN = dict(SMOLLM2_135M, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, vocab_size=512)


def flops_per_token(params: int, layers: int, hidden: int, seq: int) -> float:
    return 6.0 * params + 12.0 * layers * hidden * seq


def run(args) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.ds_engine import OptimizerConfig, make_ds_engine

    device = "cpu" if args.dry_run else "cuda"
    shape = DRY_RUN if args.dry_run else SMOLLM2_135M
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(device)
    params = sum(p.numel() for p in model.parameters())
    precision = "fp32" if args.dry_run else "bf16"
    engine = make_ds_engine(model, OptimizerConfig(lr=1e-4, zero_stage=args.zero, precision=precision),
                            micro_batch_size=args.micro_batch)
    batch = torch.randint(0, shape["vocab_size"], (args.micro_batch, args.seq), device=engine.device)

    def step() -> float:
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        return float(loss)

    for _ in range(args.warmup):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    tokens_per_s = args.steps * args.micro_batch * args.seq / elapsed
    per_token = flops_per_token(params, shape["num_hidden_layers"], shape["hidden_size"], args.seq)
    achieved = tokens_per_s * per_token
    return {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
            "dry_run": args.dry_run, "parameters": params, "precision": precision, "zero_stage": args.zero,
            "micro_batch": args.micro_batch, "seq": args.seq, "steps": args.steps, "seconds": round(elapsed, 3),
            "tokens_per_s": tokens_per_s, "flops_per_token": per_token, "achieved_tflops": achieved / 1e12,
            "peak_tflops": args.peak_tflops, "mfu": achieved / (args.peak_tflops * 1e12), "final_loss": loss,
            "max_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.dry_run:
        args.steps, args.warmup, args.seq, args.micro_batch = min(args.steps, 3), 1, min(args.seq, 64), 2
    result = run(args)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
