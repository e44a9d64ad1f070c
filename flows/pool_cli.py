"""`arlflow pool ls | show | export | import | stats`: look into the data pool, move steps in and out as Parquet.

Every command takes ``--url`` (a SQLAlchemy URL or a SQLite file path; default ``sqlite:///data/pool.db`` under the
current folder) or ``--experiment NAME`` (that DVC experiment's pool, data/pools/NAME@BASELINE.db). Reading commands refuse a SQLite file that does not exist rather than create an empty pool.
export and import also take ``s3://BUCKET/KEY.parquet`` (credentials from the environment, the endpoint from
``--endpoint`` or AWS_ENDPOINT_URL; see flows.remote_cli): an export is uploaded as one object once the file is
complete, an import downloads the object before the pool is opened, so a refused request writes nothing.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

import typer

from tasks.layout import Layout
from flows.remote_cli import ENDPOINT_HELP, S3Error, local_source, local_target

if TYPE_CHECKING:  # SQLAlchemy, pyarrow and the pool load in the commands: `arlflow --help` needs none of them
    from datapool.records import StepRecord
    from datapool.store import DataPool

DEFAULT_URL = "sqlite:///data/pool.db"
URL_OPTION = typer.Option(DEFAULT_URL, "--url", help="data pool: SQLAlchemy URL or SQLite file path")
ENDPOINT_OPTION = typer.Option(None, "--endpoint", help=ENDPOINT_HELP + "; for s3:// paths")
EXPERIMENT_OPTION = typer.Option(None, "--experiment", help="the pool of this DVC experiment (NAME or NAME@BASELINE, "
                                                            "in data/pools/) instead of --url")

pool_app = typer.Typer(help="Inspect and curate the data pool; export and import steps as Parquet.",
                       no_args_is_help=True, pretty_exceptions_enable=False)


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code)


def _open(url: str, *, create: bool = False, experiment: str | None = None) -> DataPool:
    if experiment:
        if url != DEFAULT_URL:
            raise _fail("pass --url or --experiment, not both")
        try:
            url = str(Layout(Path.cwd()).find_experiment_pool(experiment))
        except ValueError as err:
            raise _fail(str(err)) from err
    from sqlalchemy.engine import make_url

    from datapool.store import DataPool

    full = url if "://" in url else f"sqlite:///{url}"
    parsed = make_url(full)
    if (not create and parsed.get_backend_name() == "sqlite" and parsed.database
            and parsed.database != ":memory:" and not Path(parsed.database).exists()):
        raise _fail(f"no data pool at {parsed.database}: run a rollout or the gateway first, or pass --url")
    try:
        return DataPool(url)
    except Exception as exc:  # noqa: BLE001 - shown to the user with the URL
        raise _fail(f"cannot open data pool {url}: {exc}") from exc


def _table(rows: list[list[Any]], header: list[str]) -> Iterator[str]:
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        yield "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()


def _short(text: str, width: int = 40) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _step_flags(step: StepRecord, excluded: bool) -> str:
    flags = [name for name, on in (("truncated", step.truncated), ("invalid_action", not step.action_valid),
                                   ("retokenized", step.retokenized),
                                   ("tool_failure", step.tool_successes < step.tool_calls),
                                   ("prefix_break", step.prefix_break),
                                   ("excluded", excluded)) if on]
    return ",".join(flags) or "-"


@pool_app.command("ls")
def ls(url: str = URL_OPTION, experiment: Optional[str] = EXPERIMENT_OPTION,
       env: Optional[str] = typer.Option(None, help="only this env"),
       round: Optional[int] = typer.Option(None, "--round", help="only this round"),
       policy_version: Optional[str] = typer.Option(None, help="only this policy version"),
       status: Optional[str] = typer.Option(None, help="open, complete, truncated or failed"),
       min_return: Optional[float] = typer.Option(None, help="episode return >= this"),
       max_return: Optional[float] = typer.Option(None, help="episode return <= this"),
       label: Optional[str] = typer.Option(None, help="labelled so (the trajectory or one of its steps)"),
       excluded: Optional[bool] = typer.Option(None, "--excluded/--not-excluded", help="curation exclusion"),
       flag: Optional[str] = typer.Option(None, help="truncated, invalid_action, retokenized, tool_failure or "
                                                     "prefix_break"),
       limit: int = typer.Option(50, help="rows to show"),
       offset: int = typer.Option(0, help="rows to skip"),
       as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table")) -> None:
    """List trajectories, newest first."""
    with _open(url, experiment=experiment) as pool:
        try:
            rows = pool.query_trajectories(env=env, round=round, policy_version=policy_version, status=status,
                                           min_return=min_return, max_return=max_return, label=label,
                                           excluded=excluded, flag=flag, limit=limit, offset=offset)
        except ValueError as err:
            raise _fail(str(err)) from err
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        return
    if not rows:
        typer.echo("no trajectories match")
        return
    header = ["trajectory_id", "group_id", "env", "round", "status", "return", "steps", "tokens", "flags", "labels",
              "excluded"]
    table = [[r["trajectory_id"], r["group_id"], r["env"], r["round"], r["status"], f"{r['episode_return']:.3g}",
              r["num_steps"], r["response_tokens"], ",".join(r["flags"]) or "-", ",".join(r["labels"]) or "-",
              "yes" if r["excluded"] else (f"{r['excluded_steps']} steps" if r["excluded_steps"] else "-")]
             for r in rows]
    for line in _table(table, header):
        typer.echo(line)


@pool_app.command("show")
def show(trajectory_id: str = typer.Argument(..., help="the trajectory to show"), url: str = URL_OPTION,
         experiment: Optional[str] = EXPERIMENT_OPTION,
         as_json: bool = typer.Option(False, "--json", help="print the record (with steps) as JSON")) -> None:
    """Show one trajectory and its steps: index, action/response, reward, tokens, flags, labels."""
    with _open(url, experiment=experiment) as pool:
        try:
            traj = pool.get_trajectory(trajectory_id)
            curation = pool.curation_of(trajectory_id)
        except KeyError as err:
            raise _fail(str(err.args[0]), code=1) from err
    if as_json:
        typer.echo(json.dumps({**asdict(traj), "curation": curation}, indent=1))
        return
    own = curation["trajectory"] or {}
    typer.echo(f"trajectory {traj.trajectory_id}  group {traj.group_id}  env {traj.env}  round {traj.round}  "
               f"policy {traj.policy_version}")
    typer.echo(f"status {traj.status}  won {traj.won}  return {traj.episode_return:.4g}  steps {traj.num_steps}  "
               f"response tokens {traj.response_tokens}  wall {traj.wall_time_s:.2f}s"
               + (f"  error {traj.error}" if traj.error else ""))
    if own:
        typer.echo(f"curation: excluded {own['excluded']}  label {own['label'] or '-'}  note {own['note'] or '-'}")
    header = ["step", "reward", "prompt", "response", "flags", "label", "action / response"]
    rows = []
    for step in traj.steps:
        cur = curation["steps"].get(step.step_index, {})
        rows.append([step.step_index, f"{step.reward:.3g}", len(step.prompt_ids), len(step.response_ids),
                     _step_flags(step, bool(own.get("excluded")) or bool(cur.get("excluded"))),
                     cur.get("label") or "-", _short(step.action or step.response_text)])
    for line in _table(rows, header):
        typer.echo(line)


@pool_app.command("export")
def export(path: str = typer.Argument(..., help="Parquet file to write: a path or s3://BUCKET/KEY.parquet"),
           url: str = URL_OPTION, experiment: Optional[str] = EXPERIMENT_OPTION,
           round: Optional[int] = typer.Option(None, "--round", help="only this round"),
           env: Optional[str] = typer.Option(None, help="only this env"),
           drop_excluded: bool = typer.Option(False, "--drop-excluded",
                                              help="leave out excluded steps (default: keep them, flagged)"),
           endpoint: Optional[str] = ENDPOINT_OPTION) -> None:
    """Export steps (with their trajectory fields and flags) to a Parquet file, local or on S3."""
    try:
        with _open(url, experiment=experiment) as pool, local_target(path, endpoint) as local:
            rows = pool.export(local, round=round, env=env, include_excluded=not drop_excluded)
    except S3Error as err:
        raise _fail(f"nothing written: {err}") from err
    typer.echo(f"wrote {rows} steps to {path}")


@pool_app.command("import")
def import_(path: str = typer.Argument(..., help="Parquet steps file (arlflow pool export / a round's steps): a "
                                               "path or s3://BUCKET/KEY.parquet"),
            url: str = URL_OPTION, experiment: Optional[str] = EXPERIMENT_OPTION,
            endpoint: Optional[str] = ENDPOINT_OPTION) -> None:
    """Import a steps file, local or on S3, into the pool (trajectories already there are skipped)."""
    from datapool.parquet import import_steps

    try:
        with local_source(path, endpoint) as local, _open(url, create=True, experiment=experiment) as pool:
            added = import_steps(local, pool)
    except S3Error as err:
        raise _fail(f"nothing imported: {err}") from err
    except ValueError as err:
        raise _fail(str(err)) from err
    typer.echo(f"imported {added} new trajectories from {path}")


@pool_app.command("stats")
def stats(url: str = URL_OPTION, experiment: Optional[str] = EXPERIMENT_OPTION) -> None:
    """Counts by status, env and round; steps; exclusions, labels, flagged and retokenized steps (JSON)."""
    with _open(url, experiment=experiment) as pool:
        typer.echo(json.dumps(pool.stats(), indent=1, sort_keys=True))
