"""`arlflow`: run the pipeline or one stage (dvc.yaml calls `arlflow stage NAME [--round N]`)."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from flows.gateway_cli import gateway_app
from flows.pool_cli import pool_app
from flows.remote_cli import remote_app
from tasks.layout import Layout

# The pipeline and its stages import torch, DeepSpeed, transformers, great-expectations and every env (10-20 s on
# 2 cores): each command imports what it runs, so `arlflow --help` starts at once and `check-params` (config classes
# and flows/stage_order.py only) loads no torch.

app = typer.Typer(help="arlflow: train multi-turn LLM agents with RL, as a versioned, tracked pipeline.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
app.add_typer(pool_app, name="pool")
app.add_typer(remote_app, name="remote")
app.add_typer(gateway_app, name="gateway")


def _load(root: Path):
    from tasks.config import ParamsError, load_params

    layout = Layout(root.resolve())
    try:
        return layout, load_params(layout.root / "params.yaml")
    except ParamsError as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from err


def _require_current_dvc_yaml(params, layout: Layout) -> None:
    """Exit 2 with one line when dvc.yaml does not match params.yaml (rounds) or the stages' code (imports)."""
    from flows import dvc_sync

    try:
        dvc_sync.check_dvc_yaml(params, layout)
    except RuntimeError as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from err


def _say_starting(what: str) -> None:
    """The first line, printed before the seconds of imports and Prefect's server start-up that precede a flow."""
    server = os.environ.get("PREFECT_API_URL")
    where = (f"Prefect server {server}" if server else
             "Prefect's temporary server starts first (~5-15 s; export PREFECT_API_URL of a running server to skip it)")
    typer.echo(f"arlflow {what}: loading; {where}", err=True)


@app.command()
def stage(name: str = typer.Argument(..., help="bootstrap, curate, warmstart, rollout, validate, mine, train, "
                                              "evaluate, transfer"),
          round: Optional[int] = typer.Option(None, "--round", help="round number for rollout/validate/mine/train"),
          root: Path = typer.Option(Path("."), help="project root (holds params.yaml)")) -> None:
    """Run one stage as its Prefect flow (what each dvc.yaml stage calls)."""
    _say_starting(f"stage {name}" + (f" round {round}" if round is not None else ""))
    from flows.stage_order import check_stage

    layout, params = _load(root)
    try:
        check_stage(name, round, params.pipeline.rounds)
    except ValueError as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from err
    from flows.pipeline import STAGE_FLOWS

    STAGE_FLOWS[name](root=str(layout.root), round_index=round)


@app.command()
def pipeline(root: Path = typer.Option(Path("."), help="project root (holds params.yaml and dvc.yaml)"),
             force: bool = typer.Option(False, help="rerun every stage even if DVC sees it up to date")) -> None:
    """Run the whole pipeline as one Prefect flow (stages DVC sees as fresh are skipped); print the results."""
    _say_starting("pipeline")
    from flows.pipeline import pipeline_flow

    layout, params = _load(root)
    _require_current_dvc_yaml(params, layout)
    result = pipeline_flow(root=str(layout.root), force=force)
    typer.echo(f"ran: {', '.join(result['ran']) or 'nothing'}; skipped: {', '.join(result['skipped']) or 'nothing'}")
    typer.echo("\n" + result["results"], nl=False)


@app.command("dvc-yaml")
def dvc_yaml(root: Path = typer.Option(Path(".")),
             check: bool = typer.Option(False, help="exit 1 if dvc.yaml is out of date instead of writing it")) -> None:
    """Write dvc.yaml from params.yaml (one unrolled set of stages per round)."""
    from flows import dvc_sync

    layout, params = _load(root)
    text = dvc_sync.render_dvc_yaml(params, layout)
    path = layout.root / "dvc.yaml"
    if check:
        if not path.exists() or path.read_text() != text:
            typer.echo(f"{path} is out of date: run `arlflow dvc-yaml`", err=True)
            raise typer.Exit(1)
        typer.echo(f"{path} is up to date")
        return
    path.write_text(text)
    typer.echo(f"wrote {path} ({params.pipeline.rounds} rounds)")


@app.command("use-profile")
def use_profile(profile: Path = typer.Argument(..., help="a params profile, e.g. configs/smollm2-household.yaml"),
                root: Path = typer.Option(Path("."), help="project root (holds params.yaml and dvc.yaml)")) -> None:
    """Make params.yaml the defaults with the profile's keys on top (checked like params.yaml; the old file is
    kept as params.yaml.bak) and rewrite dvc.yaml to match."""
    from flows import dvc_sync
    from tasks.config import ParamsError, load_params, params_to_yaml

    layout = Layout(root.resolve())
    try:
        params = load_params(profile)
    except ParamsError as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)   # the message names the profile's file
        raise typer.Exit(2) from err
    target = layout.root / "params.yaml"
    text = (f"# written by `arlflow use-profile {profile}`: the defaults with that profile's keys on top\n"
            + params_to_yaml(params))
    if target.exists() and target.read_text() != text:
        target.replace(target.with_name("params.yaml.bak"))
    target.write_text(text)
    (layout.root / "dvc.yaml").write_text(dvc_sync.render_dvc_yaml(params, layout))
    typer.echo(f"wrote {target} from {profile} and dvc.yaml ({params.pipeline.rounds} rounds)")


@app.command("convert-model")
def convert_model(name: str = typer.Argument(..., help="a packaged model, e.g. smollm2-135m-instruct"),
                  out: Path = typer.Option(..., help="the Hugging Face folder to write")) -> None:
    """Turn a packaged GGUF model into a Hugging Face folder, offline (bootstrap.model does it by name too)."""
    from models.gguf import convert_packaged

    try:
        path = convert_packaged(name, out)
    except (ValueError, FileNotFoundError) as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from err
    typer.echo(f"wrote {path}")


@app.command("relocate-mlflow")
def relocate_mlflow(root: Path = typer.Option(Path("."), help="project root (holds mlflow.db)")) -> None:
    """Re-root the project's MLflow store after the project folder moved or was copied (stages do it when they open
    the store; run it before `mlflow ui` on a moved project)."""
    from tasks.tracking import relocate_store

    layout = Layout(root.resolve())
    old = relocate_store(layout) if layout.mlflow_db.exists() else None
    typer.echo(f"re-rooted {layout.mlflow_db}: {old} -> {layout.root}" if old else f"{layout.mlflow_db}: nothing to do")


@app.command("check-params")
def check_params(root: Path = typer.Option(Path("."), help="project root (holds params.yaml and dvc.yaml)"),
                 defaults: bool = typer.Option(False, "--defaults", help="print the default config instead")) -> None:
    """Validate params.yaml (and that dvc.yaml matches it) and print the resolved config as YAML."""
    from tasks.config import Params, params_to_yaml

    if defaults:
        typer.echo(params_to_yaml(Params()), nl=False)
        return
    layout, params = _load(root)
    _require_current_dvc_yaml(params, layout)
    typer.echo(params_to_yaml(params), nl=False)


def main() -> None:  # pragma: no cover - console entry
    sys.exit(app())
