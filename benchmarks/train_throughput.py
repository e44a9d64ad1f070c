"""RL update throughput: arlflow's `rl_update` (DeepSpeed ZeRO-0) vs TRL 1.16 `GRPOTrainer`, same run, same CPU.

    .venv/bin/python benchmarks/train_throughput.py [--batch 64] [--prompt-len 64] [--completion-len 32]
        [--optimizer-steps 1] [--repeats 7] [--threads 1] [--ragged] [--trl-defaults] [--profile]

What is timed: the policy update on one fixed GRPO batch, never generation. Both sides start from the same weights (a
tiny Qwen2 built once with `models.build`, by default the size of the pipeline's bootstrap model, saved to a
temporary folder and loaded twice), get the same prompts (one per group of `--group-size` rows), the same completions
and the same per-sequence advantages (group-normalized random rewards), the same PPO-clip objective (clip 0.2/0.2,
token mean = TRL's "dapo" loss, no KL: beta=0), fp32, torch AdamW at the same lr, global grad-norm clipping at 1.0,
and the batch is split into `--optimizer-steps` equal micro-batches with one optimizer step each (default 1).

- ours: wall time of `rl_update(engine, rows, loss=LossConfig(), update=UpdateConfig(epochs=1, micro_batch_size=batch // steps))`: collate, a no-grad forward
  recomputing the old log-probs, then per micro-batch the forward (full [b, l, V] logits) with log-prob gather,
  PPO-clip loss, entropy metric, `engine.backward`, grad-norm metric and `engine.step` (clip + AdamW).
- TRL: wall time of what `Trainer._run_epoch` does for the same optimizer steps: per step `trainer.training_step`
  then `_clip_grad_norm`, `optimizer.step`, `lr_scheduler.step`, `model.zero_grad`. Generation is stubbed:
  `_generate_and_score_completions` returns the prepared batch in exactly its format (left-padded prompt_ids and
  prompt_mask, right-padded completion_ids and completion_mask, advantages [B], num_items_in_batch); building
  those tensors is not timed (our collate is). When steps > 1, TRL computes `old_per_token_logps` with a no-grad
  forward at generation time; the stub does the same call (`_get_per_token_logps_and_entropies`) and it is timed.

Per-step differences (what one side does that the other does not):
- With one optimizer step per batch (the default), ours still runs the no-grad forward that recomputes the old
  log-probs (so the ratio is exactly 1 and rollout/trainer drift can be measured); TRL skips it and uses
  per_token_logps.detach(). With steps > 1 both run it.
- TRL patches the model with a fused, chunked LM head: it never materializes the [B, L, V] logits and computes
  log-probs + entropy tile by tile (on CPU it scores every position, prompt positions included). Ours materializes
  float32 logits over every position and takes a no-grad entropy metric from them.
- With --ragged, ours pads each micro-batch to its longest prompt + completion; TRL left-pads prompts and right-pads
  completions separately, so it computes over more padding.
- TRL's GRPOConfig defaults are bf16 autocast, activation checkpointing and fused AdamW; they are turned off here to
  match ours (fp32, no checkpointing, foreach AdamW). `--trl-defaults` keeps them, as a reference point only.
- TRL logs a few metrics with `.item()` syncs and shuffles the batch; ours computes a few float metrics and the grad
  norm through DeepSpeed.

Tokens are counted identically for both: prompt + completion tokens of every row (padding excluded) per update; a
group's shared prompt counts once per row on both sides, although ours runs a shared prompt prefix once per
micro-batch and reuses its KV cache for the group's rows (models/trainer.py, `_shared_prefix_plan`), which is where
most of our advantage comes from; TRL runs every row's prompt.
The sides alternate within each repeat (ours, TRL, ours, TRL, ...) after one warm-up update each, so load from other
processes hits both alike; the median tokens/s over the repeats is reported, with min and max. With one optimizer
step, the warm-up update (both from identical weights) also checks that both optimize the same objective:
`update_sign_agreement` is the share of parameters whose first update has the same sign (Adam's first step is about
lr * sign(grad)); 1.000 in fp32.

Writes benchmarks/results/train_throughput.json (tokens/s, ratio, config); `--profile` prints a cProfile breakdown of
one more update on each side. Timings on a shared machine are noisy: compare the ratio, and look at min/max. With
2 threads per side on 2 busy cores, OpenMP threads get descheduled at barriers and single updates take up to 10x
longer, hitting one side or the other; one thread (the default) keeps min/max within ~10%.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import deepspeed
import torch
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from models.build import TinyModelConfig, build_model, count_parameters, save_policy, train_tokenizer
from models.batching import TrainRow, UpdateConfig
from models.ds_engine import OptimizerConfig, make_ds_engine
from models.losses import LossConfig
from models.trainer import rl_update

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "train_throughput.json"
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pu", "go", "fa", "de", "bi", "xo", "wa"]


@dataclass(frozen=True)
class BenchConfig:
    """What both sides train on; written into the results file."""

    batch: int                 # sequences per update
    group_size: int            # rows per GRPO group: they share a prompt; advantages are normalized within it
    prompt_len: int            # tokens per prompt (the maximum with ragged)
    completion_len: int        # tokens per completion (the maximum with ragged)
    ragged: bool               # lengths drawn uniformly from [len // 2, len] per prompt / completion
    optimizer_steps: int       # equal micro-batches per update, one optimizer step each
    vocab_size: int            # requested tokenizer vocabulary
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    lr: float
    repeats: int
    torch_threads: int
    trl_defaults: bool         # TRL keeps its bf16 autocast, activation checkpointing and fused AdamW
    seed: int

    @property
    def micro_batch(self) -> int:
        return self.batch // self.optimizer_steps


@dataclass(frozen=True)
class FixedBatch:
    """The batch both sides train on: token ids without padding and one advantage per sequence."""

    prompts: list[list[int]]
    completions: list[list[int]]
    advantages: list[float]

    @property
    def tokens(self) -> int:
        """Prompt + completion tokens processed per update (padding excluded), the same count for both sides."""
        return sum(len(p) + len(c) for p, c in zip(self.prompts, self.completions))


def synthetic_corpus(n_words: int, seed: int) -> list[str]:
    """Lines of made-up words: enough distinct character pairs for BPE to learn a vocabulary of a few thousand."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(SYLLABLES, k=rng.randint(1, 4))) for _ in range(n_words)]
    return [" ".join(words[i : i + 12]) for i in range(0, n_words, 12)]


def make_batch(cfg: BenchConfig, vocab: int, pad_id: int) -> FixedBatch:
    """GRPO-shaped batch: each group of `group_size` rows shares one prompt and has its own completions.

    Random non-pad token ids; group-normalized random rewards (TRL's scale_rewards="group" formula) as advantages.
    """
    rng = random.Random(cfg.seed)

    def length(full: int) -> int:
        return rng.randint(max(full // 2, 1), full) if cfg.ragged else full

    usable = [t for t in range(vocab) if t != pad_id]
    n_groups = cfg.batch // cfg.group_size
    group_prompts = [rng.choices(usable, k=length(cfg.prompt_len)) for _ in range(n_groups)]
    prompts = [list(group_prompts[b // cfg.group_size]) for b in range(cfg.batch)]
    completions = [rng.choices(usable, k=length(cfg.completion_len)) for _ in range(cfg.batch)]
    rewards = torch.tensor([rng.random() for _ in range(cfg.batch)]).view(n_groups, cfg.group_size)  # [G, g]
    advantages = (rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(dim=1, keepdim=True) + 1e-4)
    return FixedBatch(prompts, completions, advantages.flatten().tolist())


def trl_inputs(batch: FixedBatch, pad_id: int) -> dict[str, torch.Tensor]:
    """The dict `GRPOTrainer._generate_and_score_completions` returns (beta=0, no vLLM), without old log-probs."""
    n, p_width, c_width = len(batch.prompts), max(map(len, batch.prompts)), max(map(len, batch.completions))
    prompt_ids = torch.full((n, p_width), pad_id, dtype=torch.long)            # [B, P] left-padded
    prompt_mask = torch.zeros((n, p_width), dtype=torch.long)                   # [B, P]
    completion_ids = torch.full((n, c_width), pad_id, dtype=torch.long)        # [B, C] right-padded
    completion_mask = torch.zeros((n, c_width), dtype=torch.long)               # [B, C]
    for b, (prompt, completion) in enumerate(zip(batch.prompts, batch.completions)):
        prompt_ids[b, p_width - len(prompt):] = torch.tensor(prompt)
        prompt_mask[b, p_width - len(prompt):] = 1
        completion_ids[b, : len(completion)] = torch.tensor(completion)
        completion_mask[b, : len(completion)] = 1
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor(batch.advantages, dtype=torch.float32),  # [B]
        "num_items_in_batch": completion_mask.sum(),                        # []
    }


def build_policy_folder(cfg: BenchConfig, folder: Path) -> tuple[int, int]:
    """Trains the tokenizer, builds the model once and saves both; returns (vocabulary size, parameter count)."""
    tokenizer = train_tokenizer(synthetic_corpus(40_000, cfg.seed), cfg.vocab_size)
    model = build_model(tokenizer, TinyModelConfig(arch="qwen2", hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, intermediate_size=cfg.intermediate_size, max_position_embeddings=2 * (cfg.prompt_len + cfg.completion_len)), seed=cfg.seed)
    save_policy(model, tokenizer, folder)
    return len(tokenizer), count_parameters(model)


def load_model(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)


def make_ours(cfg: BenchConfig, folder: Path, batch: FixedBatch, pad_id: int) -> tuple[torch.nn.Module, Callable]:
    """Our DeepSpeed engine and a function running one `rl_update` on the batch."""
    engine = make_ds_engine(load_model(folder), OptimizerConfig(lr=cfg.lr, zero_stage=0), micro_batch_size=cfg.micro_batch)
    rows = [TrainRow(p, c, None, a) for p, c, a in zip(batch.prompts, batch.completions, batch.advantages)]

    def update() -> None:
        rl_update(engine, rows, pad_id=pad_id, seed=0, loss=LossConfig(clip_low=0.2, clip_high=0.2), update=UpdateConfig(epochs=1, micro_batch_size=cfg.micro_batch))

    return engine.module, update


def make_trl(cfg: BenchConfig, folder: Path, batch: FixedBatch, pad_id: int, out_dir: Path):
    """A GRPOTrainer whose generation returns the fixed batch, and a function running its steps for one update."""
    parity = {} if cfg.trl_defaults else {"bf16": False, "activation_checkpointing": False, "optim": "adamw_torch"}
    args = GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, use_vllm=False, report_to="none", save_strategy="no",
        per_device_train_batch_size=cfg.micro_batch, gradient_accumulation_steps=1,
        steps_per_generation=cfg.optimizer_steps, num_generations=cfg.group_size,
        max_completion_length=cfg.completion_len, beta=0.0, loss_type="dapo", epsilon=0.2, epsilon_high=0.2,
        learning_rate=cfg.lr, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        seed=cfg.seed, logging_steps=10**9, disable_tqdm=True, **parity,
    )
    trainer = GRPOTrainer(
        model=load_model(folder), reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
        train_dataset=Dataset.from_dict({"prompt": ["unused"] * cfg.batch}),
        processing_class=AutoTokenizer.from_pretrained(folder, local_files_only=True),
    )
    inputs = trl_inputs(batch, pad_id)

    def generate_and_score(_generation_batch) -> dict[str, torch.Tensor]:
        """The tail of `_generate_and_score_completions` after generation: old log-probs when steps are misaligned."""
        out = dict(inputs)
        if args.gradient_accumulation_steps % (args.steps_per_generation * args.num_iterations) != 0:
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)         # [B, P + C]
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)     # [B, P + C]
            with torch.no_grad():
                out["old_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
                    trainer.model, ids, mask, inputs["completion_ids"].size(1), batch_size=cfg.micro_batch)
        return out

    trainer._generate_and_score_completions = generate_and_score
    trainer.create_optimizer_and_scheduler(num_training_steps=10**6)
    trainer.current_gradient_accumulation_steps = 1                         # set by Trainer._run_epoch otherwise
    model = trainer.model

    def update() -> None:
        for _ in range(cfg.optimizer_steps):
            trainer.training_step(model, {"prompt": ["unused"] * cfg.batch}, None)
            trainer._clip_grad_norm(model)
            trainer.optimizer.step()
            trainer.lr_scheduler.step()
            model.zero_grad()

    return model, update


def sign_agreement(before: dict[str, torch.Tensor], ours: torch.nn.Module, trl_model: torch.nn.Module) -> float:
    """Share of parameter entries whose first update has the same sign on both sides (both moved or both did not)."""
    agree, total = 0, 0
    trl_params = dict(trl_model.named_parameters())
    for name, param in ours.named_parameters():
        d_ours = torch.sign(param.detach() - before[name])
        d_trl = torch.sign(trl_params[name].detach() - before[name])
        agree += int((d_ours == d_trl).sum())
        total += d_ours.numel()
    return agree / total


def profile_update(name: str, update: Callable[[], None], lines: int = 25) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    update()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(lines)
    print(f"\n--- cProfile of one {name} update (cumulative) ---\n" + text.getvalue().split("\n", 6)[-1])


def parse_config() -> tuple[BenchConfig, bool, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=32)
    parser.add_argument("--ragged", action="store_true", help="vary lengths per row (padding then differs)")
    parser.add_argument("--optimizer-steps", type=int, default=1, help="micro-batches (optimizer steps) per update")
    parser.add_argument("--vocab-size", type=int, default=384)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for both sides; 1 keeps the ratio stable on a busy machine")
    parser.add_argument("--trl-defaults", action="store_true", help="keep TRL's bf16/checkpointing/fused AdamW")
    parser.add_argument("--profile", action="store_true", help="print a cProfile breakdown of one update per side")
    parser.add_argument("--out", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    if args.batch % args.group_size or args.batch % args.optimizer_steps:
        raise SystemExit(f"--batch ({args.batch}) must be a multiple of --group-size ({args.group_size}) and of "
                         f"--optimizer-steps ({args.optimizer_steps})")
    torch.set_num_threads(args.threads)
    cfg = BenchConfig(
        batch=args.batch, group_size=args.group_size, prompt_len=args.prompt_len, completion_len=args.completion_len,
        ragged=args.ragged, optimizer_steps=args.optimizer_steps, vocab_size=args.vocab_size,
        hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=4, num_kv_heads=2,
        intermediate_size=3 * args.hidden_size, lr=1e-5, repeats=args.repeats, torch_threads=torch.get_num_threads(),
        trl_defaults=args.trl_defaults, seed=0,
    )
    return cfg, args.profile, args.out


def main() -> None:
    cfg, profile, out_path = parse_config()
    with tempfile.TemporaryDirectory(prefix="arlflow-train-bench-") as tmp:
        folder = Path(tmp) / "policy"
        vocab, n_params = build_policy_folder(cfg, folder)
        pad_id = AutoTokenizer.from_pretrained(folder, local_files_only=True).pad_token_id
        batch = make_batch(cfg, vocab, pad_id)
        ours_model, ours_update = make_ours(cfg, folder, batch, pad_id)
        trl_model, trl_update = make_trl(cfg, folder, batch, pad_id, Path(tmp) / "trl")
        torch.set_num_threads(cfg.torch_threads)                            # in case a library changed it
        before = {n: p.detach().clone() for n, p in ours_model.named_parameters()}
        ours_update()                                                       # warm-up, from identical weights
        trl_update()
        agreement = sign_agreement(before, ours_model, trl_model) if cfg.optimizer_steps == 1 else None

        seconds: dict[str, list[float]] = {"ours": [], "trl": []}
        for _ in range(cfg.repeats):
            for name, update in (("ours", ours_update), ("trl", trl_update)):
                start = time.perf_counter()
                update()
                seconds[name].append(time.perf_counter() - start)
        if profile:
            profile_update("arlflow rl_update", ours_update)
            profile_update("TRL GRPOTrainer", trl_update)

    rate = {name: statistics.median(batch.tokens / s for s in values) for name, values in seconds.items()}
    print(f"model: qwen2 {n_params / 1e6:.2f}M params (vocab {vocab}); batch {cfg.batch} x ({cfg.prompt_len} prompt + "
          f"{cfg.completion_len} completion){' ragged' if cfg.ragged else ''}, {batch.tokens} tokens/update in "
          f"{cfg.optimizer_steps} optimizer step(s); torch threads {cfg.torch_threads}"
          f"{'; TRL with its defaults (bf16 autocast, checkpointing)' if cfg.trl_defaults else ''}")
    if agreement is not None:
        print(f"update_sign_agreement after the warm-up update: {agreement:.3f}")
    for name, label in (("ours", "arlflow rl_update"), ("trl", "TRL GRPOTrainer")):
        s = seconds[name]
        print(f"{label:18s} {rate[name]:9.0f} tok/s  (median of {cfg.repeats}; s/update median "
              f"{statistics.median(s):.3f}, min {min(s):.3f}, max {max(s):.3f})")
    print(f"ratio ours/TRL: {rate['ours'] / rate['trl']:.2f}x")
    if any(max(s) > 1.5 * min(s) for s in seconds.values()):
        print("warning: update times vary by more than 1.5x (a busy machine?): rerun, or use more --repeats")

    result = {
        "ours_tokens_per_s": rate["ours"],
        "trl_tokens_per_s": rate["trl"],
        "ratio": rate["ours"] / rate["trl"],
        "ours_seconds_per_update": seconds["ours"],
        "trl_seconds_per_update": seconds["trl"],
        "tokens_per_update": batch.tokens,
        "update_sign_agreement": agreement,
        "model_parameters": n_params,
        "vocab": vocab,
        "config": asdict(cfg),
        "versions": {"torch": torch.__version__, "trl": trl.__version__, "deepspeed": deepspeed.__version__,
                     "python": platform.python_version()},
        "machine": platform.machine(),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
