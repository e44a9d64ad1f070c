"""DeepSpeed engine setup for the trainer: config files (infra/deepspeed), precision, LR schedule, the one-process
environment, `make_ds_engine` and `full_weights` (whole, merged weights out of ZeRO-3 / LoRA)."""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from models.config import LR_SCHEDULES, PRECISIONS, OptimizerConfig

log = logging.getLogger(__name__)


@functools.cache
def import_deepspeed():
    """DeepSpeed, imported on first use (the import takes seconds).
    Where no GPU is visible the accelerator is named first: that skips DeepSpeed's detection, whose CPU fallback
    warns "Setting accelerator to CPU" on every import."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    return deepspeed


def _open_files_of(uid: int) -> set[tuple[int, int]] | None:
    """(device, inode) of every file the processes of user ``uid`` hold open; None where one cannot be read."""
    held: set[tuple[int, int]] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if proc.stat().st_uid != uid:
                continue
            fds = list((proc / "fd").iterdir())
        except FileNotFoundError:  # the process ended meanwhile
            continue
        except PermissionError:
            return None
        for fd in fds:
            with contextlib.suppress(OSError):
                st = fd.stat()
                held.add((st.st_dev, st.st_ino))
    return held


def clear_stale_build_locks(root: str | Path | None = None) -> list[Path]:
    """Removes the build locks of torch JIT extensions (DeepSpeed's CPU ops) that no live process holds; the removed.

    torch's FileBaton creates ``<op build dir>/lock`` with O_EXCL, holds it open while it checks or builds
    the op, and removes it when done; every other process loading the op polls until the file is gone, with no
    timeout. A process SIGKILLed inside that window (a killed stage, the OOM killer) leaves the file behind, and
    every later DeepSpeed start on the machine hangs without a word. A lock is stale when no process of the user who
    created it holds it open (Linux /proc). Where that cannot be told (no /proc, another user's processes
    unreadable) nothing is removed and the lock is named in a warning, with what to do."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(root or os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    removed: list[Path] = []
    held_by: dict[int, set[tuple[int, int]] | None] = {}  # one /proc scan per lock owner, and none without a lock
    # <TORCH_EXTENSIONS_DIR>/<op>/lock where that variable is set, else <default root>/<py311_cpu>/<op>/lock
    for lock in sorted([*root.glob("*/lock"), *root.glob("*/*/lock")]):
        try:
            st = lock.stat()
        except FileNotFoundError:  # released meanwhile
            continue
        if st.st_uid not in held_by:
            held_by[st.st_uid] = _open_files_of(st.st_uid) if Path("/proc/self/fd").is_dir() else None
        held = held_by[st.st_uid]
        if held is None:
            log.warning("%s exists: if no process is building or loading that torch extension now, remove it "
                        "(a killed process leaves it behind, and DeepSpeed then waits for it forever)", lock)
            continue
        if (st.st_dev, st.st_ino) in held:
            continue
        with contextlib.suppress(FileNotFoundError):
            again = lock.stat()
            if (again.st_dev, again.st_ino) == (st.st_dev, st.st_ino):  # still the lock judged stale
                lock.unlink()
                removed.append(lock)
                log.warning("removed %s: a stale torch-extension build lock that no process holds (left by a "
                            "process killed while it loaded the op); DeepSpeed would have waited for it forever", lock)
    return removed


DEEPSPEED_CONFIG_DIR = Path(__file__).resolve().parents[1] / "infra" / "deepspeed"


def ensure_single_process_env() -> None:
    """Sets the torch.distributed variables of a one-process world where a launcher has not set them."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])


def load_ds_config(zero_stage: int = 0, config_path: str | Path | None = None) -> dict:
    """Reads a DeepSpeed JSON config: `config_path`, or infra/deepspeed/zero{zero_stage}.json of this repository."""
    path = Path(config_path) if config_path is not None else DEEPSPEED_CONFIG_DIR / f"zero{zero_stage}.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"DeepSpeed config {path} not found: pass config_path, or use zero_stage 0-3 from a source checkout "
            f"(configs live in {DEEPSPEED_CONFIG_DIR})"
        )
    return json.loads(path.read_text())


def resolve_precision(precision: str) -> str:
    """"fp32" or "bf16": "auto" is bf16 when a GPU is visible, else fp32; bf16 is never used on CPU."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    if precision == "auto":
        return "bf16" if torch.cuda.is_available() else "fp32"
    if precision == "bf16" and not torch.cuda.is_available():
        raise ValueError("precision 'bf16' needs a GPU (CPU training stays fp32): use precision 'auto' or 'fp32'")
    return precision


@dataclass
class LrSchedule:
    """Learning-rate multiplier after `step` optimizer steps (torch LambdaLR convention: step 0 is the first update).

    Warmup: update k (1-based) of the first `warmup_steps` uses k / warmup_steps of the base rate. After it,
    "constant" keeps 1; "cosine" decays from 1 to `min_ratio` at `total_steps` (Loshchilov & Hutter 2017, "SGDR",
    arXiv:1608.03983) and stays there. Not frozen: LambdaLR's load_state_dict writes back its fields.
    """

    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"unknown lr schedule {self.kind!r}; valid: {', '.join(LR_SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"min_ratio is a fraction of the base lr, in [0, 1]; got {self.min_ratio}")
        if self.kind == "cosine" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ValueError(f"the cosine schedule needs total_steps > warmup_steps ({self.warmup_steps}), got "
                             f"{self.total_steps}: pass the number of optimizer steps of the run")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        progress = min((step - self.warmup_steps) / (self.total_steps - self.warmup_steps), 1.0)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_ds_config(
    zero_stage: int = 0,
    config_path: str | Path | None = None,
    *,
    micro_batch_size: int = 8,
    grad_accum: int = 1,
    grad_clip: float = 1.0,
    precision: str = "auto",
) -> dict:
    """The DeepSpeed config `make_ds_engine` uses: the JSON file with batch sizes, clipping and precision filled in.

    train_batch_size (micro_batch_size x grad_accum x world size) is also rl_update's default mini-batch size.
    """
    config = load_ds_config(zero_stage, config_path)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config["train_micro_batch_size_per_gpu"] = micro_batch_size
    config["gradient_accumulation_steps"] = grad_accum
    config["train_batch_size"] = micro_batch_size * grad_accum * world_size
    config["gradient_clipping"] = grad_clip
    config["bf16"] = {**config.get("bf16", {}), "enabled": resolve_precision(precision) == "bf16"}
    config["fp16"] = {**config.get("fp16", {}), "enabled": False}
    return config


def make_ds_engine(
    model: torch.nn.Module,
    optimizer: OptimizerConfig,
    *,
    micro_batch_size: int = 8,
    grad_accum: int = 1,
    total_steps: int | None = None,
    config_path: str | Path | None = None,
):
    """Wraps `model` in a DeepSpeed engine with AdamW over its trainable parameters; `engine.module` is the model.

    Only parameters with requires_grad train (after `models.reference.apply_lora`: the adapters). A config without
    an "optimizer" section gets a client `torch.optim.AdamW` (no JIT compile); one with a section keeps it, with
    lr/weight_decay set. The learning rate follows `LrSchedule(lr_schedule, warmup_steps, total_steps,
    min_lr_ratio)` (a torch LambdaLR that DeepSpeed steps and checkpoints; `total_steps`, the call's optimizer
    steps, is needed by the cosine schedule), unless the config file has its own "scheduler" section. Precision:
    see `resolve_precision`. `config_path` replaces infra/deepspeed/zero{zero_stage}.json.
    """
    cfg = optimizer
    ensure_single_process_env()
    config = build_ds_config(cfg.zero_stage, config_path, micro_batch_size=micro_batch_size, grad_accum=grad_accum,
                             grad_clip=cfg.grad_clip, precision=cfg.precision)
    schedule = LrSchedule(cfg.lr_schedule, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no parameter with requires_grad: nothing to train")
    client_optimizer = None
    if "optimizer" in config:
        config["optimizer"].setdefault("params", {}).update(lr=cfg.lr, weight_decay=cfg.weight_decay)
    else:
        client_optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = None
    if "scheduler" not in config:
        scheduler = functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=schedule)
    elif cfg.lr_schedule != "constant" or cfg.warmup_steps:
        raise ValueError(f"config has a 'scheduler' section and lr_schedule={cfg.lr_schedule!r}/warmup_steps="
                         f"{cfg.warmup_steps} were set too: keep one of the two")
    deepspeed = import_deepspeed()
    clear_stale_build_locks()
    if not deepspeed.comm.is_initialized() and not torch.cuda.is_available():
        log.info("starting DeepSpeed on the CPU (a machine's first run builds its shared-memory communication op: "
                 "~1-2 min without output, cached after) ...")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, optimizer=client_optimizer,
                                      lr_scheduler=scheduler, config=config)
    return engine


@contextlib.contextmanager
def full_weights(engine) -> Iterator[torch.nn.Module]:
    """Yields the trained policy with whole parameters, as a plain HF model.

    Under ZeRO-3 the parameters are partitioned (empty) outside this block. A LoRA policy (peft) is yielded as a
    merged copy (`merge_and_unload`), so what is saved is a plain HF model; the engine keeps training its adapters.
    Save or serve inside it, e.g. `with full_weights(engine) as m: save_policy(m, tok, path)` (on several ranks,
    save from rank 0 only).
    """
    module = engine.module
    gathered = (import_deepspeed().zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
                if engine.zero_optimization_stage() == 3 else contextlib.nullcontext())
    with gathered:
        yield copy.deepcopy(module).merge_and_unload() if hasattr(module, "merge_and_unload") else module
