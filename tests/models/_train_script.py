"""A complete small RL training run, for the subprocess tests (kill/resume, several ranks under `deepspeed`).

The model (a tiny Qwen2, seeded) and the rows (seeded synthetic token ids) are built the same way in every process,
so runs are comparable parameter by parameter. Rank 0 writes the final parameters (torch.save of a name -> tensor
dict) to --out and a JSON summary next to it (.json). Every rank passes the whole row list; rl_update shards it.

    python tests/models/_train_script.py --out final.pt [--checkpoint-dir D --checkpoint-every 2]
    deepspeed --num_gpus 2 --master_addr 127.0.0.1 --master_port P --no_local_rank tests/models/_train_script.py ...
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: make the repository importable

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from models import checkpoint  # noqa: E402
from models.ds_engine import OptimizerConfig, full_weights, make_ds_engine  # noqa: E402
from models.losses import LossConfig  # noqa: E402
from models.trainer import TrainRow, UpdateConfig, rl_update  # noqa: E402

VOCAB = 64


def build_model(dropout: float) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, attention_dropout=dropout, pad_token_id=0)
    return Qwen2ForCausalLM(config).float()


def build_rows(n: int) -> list[TrainRow]:
    rng = random.Random(1)
    rows = []
    for i in range(n):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 12))]
        response = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 9))]
        logprobs = [rng.uniform(-5.0, -0.5) for _ in response] if i % 2 else None
        rows.append(TrainRow(prompt, response, logprobs, rng.gauss(0.0, 1.0)))
    return rows


def kill_during_save(nth: int) -> None:
    """SIGKILLs this process inside the nth checkpoint save, after DeepSpeed wrote its files, before publishing."""
    publish, calls = checkpoint._publish, [0]

    def dying_publish(staging: Path, final: Path) -> None:
        calls[0] += 1
        if calls[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        publish(staging, final)

    checkpoint._publish = dying_publish


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--mini-batch-size", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--token-budget", type=int, default=None)
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--checkpoint-every", type=int, default=2)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to wait after each update (pacing)")
    parser.add_argument("--die-in-save", type=int, default=0, help="SIGKILL itself inside the nth save (0: never)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    if args.die_in_save:
        kill_during_save(args.die_in_save)
    rows = build_rows(args.rows)
    updates = args.epochs * -(-args.rows // args.mini_batch_size)
    model = build_model(args.dropout)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = OptimizerConfig(lr=3e-3, zero_stage=args.zero_stage, lr_schedule="cosine", warmup_steps=2,
                                min_lr_ratio=0.1)
    engine = make_ds_engine(model, optimizer, micro_batch_size=args.micro_batch_size, total_steps=updates)
    seen: list[int] = []

    def on_update(step: int, metrics: dict[str, float]) -> None:
        seen.append(step)
        time.sleep(args.step_sleep)

    update = UpdateConfig(epochs=args.epochs, micro_batch_size=args.micro_batch_size,
                          mini_batch_size=args.mini_batch_size, token_budget=args.token_budget or 0,
                          checkpoint_every=args.checkpoint_every)
    result = rl_update(engine, rows, pad_id=0, seed=7, on_update=on_update, checkpoint_dir=args.checkpoint_dir,
                       loss=LossConfig(clip_high=0.28), update=update)
    with full_weights(engine) as module:
        if dist.get_rank() == 0:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            torch.save({name: p.detach().clone() for name, p in module.named_parameters()}, args.out)
            change = max(float((p.detach() - initial[name]).abs().max()) for name, p in module.named_parameters())
            summary = {"result": result, "steps_seen": seen, "world_size": dist.get_world_size(),
                       "max_change": change}
            args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
