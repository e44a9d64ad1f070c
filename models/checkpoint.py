"""Complete, atomic training checkpoints that a killed run resumes from bit-identically.

A checkpoint directory holds:

    step_00000004/                 one complete checkpoint (a DeepSpeed tag)
        mp_rank_00_model_states.pt ...    weights, optimizer, LR scheduler (`engine.save_checkpoint`)
        trainer_state_rank0.pt            that rank's RNG states and data position (one file per rank)
        manifest.json                     size and sha256 of every other file; written last
    step_00000006.tmp/             a save in progress, or one killed mid-way: never loaded, removed by the next save
    latest                         name of the newest published tag (DeepSpeed's pointer file)

A save writes everything into `<tag>.tmp`, adds the manifest, renames the folder to `<tag>` (atomic on POSIX) and then
replaces `latest` (temporary file + os.replace). A load takes the newest `step_*` folder whose manifest matches its
files, so a kill at any point, or a damaged file, falls back to the previous complete checkpoint. Several ranks must
share the directory (one node, or a shared file system); rank 0 writes the manifest and publishes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "latest"
STAGING_SUFFIX = ".tmp"
_TAG = re.compile(r"^step_(\d{8})$")


def checkpoint_tag(step: int) -> str:
    """Folder name of the checkpoint taken after optimizer step `step` (zero-padded so names sort by step)."""
    return f"step_{step:08d}"


def capture_rng_state() -> dict[str, Any]:
    """The python, numpy, torch CPU and (when present) CUDA generator states of this process."""
    state: dict[str, Any] = {
        "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Puts back the generator states that `capture_rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of torch.distributed; (0, 1) when it is not initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if rank_and_world()[1] > 1:
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_digest(path: Path, *, sync: bool = False) -> str:
    """sha256 of the file; with sync, also flushes it to disk (before the folder it is in is published)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
        if sync:
            os.fsync(handle.fileno())
    return digest.hexdigest()


def _write_manifest(folder: Path, step: int) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _file_digest(p, sync=True)}
               for p in files}
    staging = folder / f"{MANIFEST}{STAGING_SUFFIX}"
    with open(staging, "w") as handle:
        json.dump({"step": step, "files": entries}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, folder / MANIFEST)


def _publish(staging: Path, final: Path) -> None:
    """Renames the finished staging folder to its tag, then points `latest` at it."""
    if final.exists():  # a damaged checkpoint of the same step that the resume skipped
        shutil.rmtree(final)
    os.rename(staging, final)
    _fsync_dir(final.parent)
    pointer = final.parent / f"{LATEST}{STAGING_SUFFIX}"
    pointer.write_text(final.name)
    os.replace(pointer, final.parent / LATEST)
    _fsync_dir(final.parent)


def _prune(directory: Path, keep: int, just_saved: Path) -> None:
    """Removes staging leftovers and all but the `keep` newest published checkpoints."""
    for path in directory.glob(f"step_*{STAGING_SUFFIX}"):
        shutil.rmtree(path, ignore_errors=True)
    published = sorted(p for p in directory.iterdir() if _TAG.match(p.name))
    for path in published[: max(len(published) - keep, 0)]:
        if path != just_saved:
            shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(engine, directory: str | Path, step: int, trainer_state: dict[str, Any], *, keep: int = 2) -> Path:
    """Saves a complete checkpoint of `engine` + `trainer_state` (+ this process's RNG states) after step `step`.

    Parameters without requires_grad (a LoRA base model) are left out: resuming expects the same base weights in the
    engine it loads into. Every rank must call it (DeepSpeed writes per-rank optimizer shards). Keeps the `keep`
    newest checkpoints. Returns the published folder.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    directory = Path(directory)
    rank, world = rank_and_world()
    final = directory / checkpoint_tag(step)
    staging = directory / f"{final.name}{STAGING_SUFFIX}"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
    _barrier()
    # frozen weights (a LoRA base) are not saved: a resume rebuilds them from the same base model
    frozen = any(not p.requires_grad for p in engine.module.parameters())
    engine.save_checkpoint(str(directory), tag=staging.name, save_latest=False, exclude_frozen_parameters=frozen)
    state = {**trainer_state, "rng": capture_rng_state(), "world_size": world, "step": step, "frozen_excluded": frozen}
    torch.save(state, staging / f"trainer_state_rank{rank}.pt")
    _barrier()
    if rank == 0:
        _write_manifest(staging, step)
        _publish(staging, final)
        _prune(directory, keep, final)
    _barrier()
    return final


def checkpoint_problem(folder: Path) -> str | None:
    """Why `folder` is not a complete checkpoint (no manifest, a missing or changed file), or None if it is.

    Every file is hashed (sha256): reading the whole checkpoint once per resume."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (the save did not finish)"
    try:
        entries = json.loads(manifest_path.read_text())["files"]
        for name, expected in entries.items():
            path = folder / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != expected["bytes"]:
                return f"{name} has {path.stat().st_size} bytes, the manifest says {expected['bytes']}"
            if _file_digest(path) != expected["sha256"]:
                return f"{name} does not match its sha256"
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:  # OSError: removed while being read
        return f"unreadable ({type(error).__name__}: {error})"
    return None


def latest_complete_checkpoint(directory: str | Path) -> Path | None:
    """The newest published `step_*` folder of `directory` that passes `checkpoint_problem`; None if there is none."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    for folder in sorted((p for p in directory.iterdir() if _TAG.match(p.name)), reverse=True):
        problem = checkpoint_problem(folder)
        if problem is None:
            return folder
        log.warning("skipping checkpoint %s: %s", folder, problem)
    return None


def _read_trainer_state(folder: Path, rank: int, world: int, fingerprint: str | None):
    """(this rank's trainer state, None) or (None, why it cannot be resumed)."""
    path = folder / f"trainer_state_rank{rank}.pt"
    if not path.is_file():
        return None, (f"checkpoint {folder} has no {path.name}: it was written by a run with fewer ranks; resume "
                      f"with the same number of ranks or delete {folder.parent}")
    state = torch.load(path, weights_only=False)  # our own file: python/numpy RNG states are not tensors
    if state["world_size"] != world:
        return None, (f"checkpoint {folder} was written by {state['world_size']} ranks, this run has {world}: "
                      f"resume with the same number of ranks or delete {folder.parent}")
    if fingerprint is not None and state.get("fingerprint") != fingerprint:
        return None, (f"checkpoint {folder} belongs to another run (other rows, settings or optimizer "
                      f"hyperparameters): delete {folder.parent} or pass a fresh checkpoint directory")
    return state, None


def load_checkpoint(engine, directory: str | Path, *, fingerprint: str | None = None) -> dict[str, Any] | None:
    """Loads the newest complete checkpoint of `directory` into `engine` (weights, optimizer, LR scheduler), restores
    this process's RNG states and returns its trainer state; None (engine untouched) when there is none.

    fingerprint: when given, a checkpoint whose trainer state carries another one raises ValueError before anything
    is loaded (it belongs to another run). Every rank must call it; rank 0 picks the checkpoint and tells the others.
    """
    rank, world = rank_and_world()
    chosen = [str(latest_complete_checkpoint(directory) or "") if rank == 0 else ""]
    if world > 1:
        dist.broadcast_object_list(chosen, src=0)
    if not chosen[0]:
        return None
    folder = Path(chosen[0])
    state, problem = _read_trainer_state(folder, rank, world, fingerprint)
    if world > 1:  # every rank raises, or none does
        problems: list[str | None] = [None] * world
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise ValueError(problem)
    loaded, _ = engine.load_checkpoint(str(folder.parent), tag=folder.name,
                                       load_module_strict=not state["frozen_excluded"],
                                       load_optimizer_states=True, load_lr_scheduler_states=True)
    if loaded is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {folder} although its manifest checks out")
    restore_rng_state(state.pop("rng"))
    log.info("resumed from %s", folder)
    return state
