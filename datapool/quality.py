"""The data gate between rollout and training: great-expectations over a round's step table, plus the
zero-variance group filter.

``validate_steps`` derives scalar columns from the step table (prompt/response/log-prob lengths, distinct
trajectories per group, ...) and checks them with a GX suite in an ephemeral context (nothing written to disk).
Failures never raise: the ``QualityReport`` says which expectation failed, how often, with examples.
``write_data_docs`` publishes the same validation as GX's own Data Docs, a static HTML site.

Steps whose token ids were re-derived from text (``retokenized``, an upstream that could not return sampled ids)
fail the expectation named "no retokenized steps": training on them would silently train on ids the policy never
sampled. A frame without the column (older files) has none.

Steps flagged ``prefix_break`` (a gateway step whose prompt does not extend the previous step's prompt + response)
are counted by the expectation named "prefix breaks (counted)", with examples, but do not fail the gate: each such
step is still exactly what the engine was fed and sampled, so the default step_rows layout trains on it as it is;
only the concatenated layout re-renders the text between such turns, which it also does, by design, for every
turn of the rollout loop's own (re-rendered) prompts, which are never flagged. To train without them, find them by
the ``prefix_break`` flag (``arlflow pool ls --flag prefix_break``, the UI) and exclude them by curation.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from datapool.filters import degenerate_group_ids
from models.checks import ConfigValueError, check_config

if TYPE_CHECKING:  # great-expectations is imported where it runs: GateConfig is loaded by every config read
    import great_expectations as gx
    from great_expectations.core import ExpectationSuiteValidationResult

REQUIRED_COLUMNS: tuple[str, ...] = (
    "trajectory_id", "group_id", "step_index", "prompt_ids", "response_ids", "logprobs", "reward",
)
_INDEX_COLUMNS = ["trajectory_id", "step_index", "group_id"]  # identify the rows behind each example
MAX_EXAMPLES = 5
NO_RETOKENIZED = "no retokenized steps"
PREFIX_BREAKS = "prefix breaks (counted)"
COUNTED = (PREFIX_BREAKS,)
"""Expectations that count and show examples but never fail the gate."""


@dataclass(frozen=True)
class GateConfig:
    """params.yaml ``validate``: the data gate's limits and what the validate stage keeps."""

    max_prompt_tokens: int = 256
    """Longest prompt (token ids) a step may have."""
    max_response_tokens: int = 8
    """Longest response a step may have; at least rollout.sampling.max_new_tokens."""
    reward_min: float = -1.0
    """Least step reward the gate accepts (< reward_max)."""
    reward_max: float = 1.0
    """Largest step reward the gate accepts; every reward must also be finite."""
    drop_zero_variance: bool = True
    """Drop groups whose returns are all equal (no group-normalized signal); counted in the report."""
    keep_failed: bool = False
    """Keep trajectories whose env raised or timed out (status "failed"). By default they are left out of training
    (their outcome is an accident, not the policy's) and counted in the report."""

    def __post_init__(self) -> None:
        check_config(self, max_prompt_tokens="positive", max_response_tokens="positive")
        if not self.reward_min < self.reward_max:
            raise ConfigValueError("reward_min", self.reward_min, f"< reward_max ({self.reward_max})")

    def limits(self, group_size: int) -> QualityLimits:
        """The suite's limits for groups of ``group_size`` rollouts."""
        return QualityLimits(max_prompt_tokens=self.max_prompt_tokens, max_response_tokens=self.max_response_tokens,
                             reward_min=self.reward_min, reward_max=self.reward_max, group_size=group_size)


@dataclass(frozen=True)
class QualityLimits:
    max_prompt_tokens: int
    """Longest prompt (in token ids) a step may have."""
    max_response_tokens: int
    """Longest response a step may have (the engine's max_new_tokens)."""
    reward_min: float
    reward_max: float
    """Every step reward must be finite and within [reward_min, reward_max]."""
    group_size: int
    """G: each group must hold exactly this many distinct trajectories."""

    def __post_init__(self) -> None:
        if self.max_prompt_tokens < 1 or self.max_response_tokens < 1 or self.group_size < 1:
            raise ValueError(f"QualityLimits: token limits and group_size must be >= 1, got {self}")
        if not self.reward_min <= self.reward_max:
            raise ValueError(f"QualityLimits: reward_min {self.reward_min} > reward_max {self.reward_max}")


@dataclass
class QualityReport:
    success: bool
    results: list[dict[str, Any]] = field(default_factory=list)
    """One dict per expectation: name, expectation_type, column, success, unexpected_count, examples (<= 5)."""
    row_count: int = 0
    message: str = ""
    """Why the gate failed before any expectation ran (e.g. no steps), else empty."""
    validation: ExpectationSuiteValidationResult | None = field(default=None, repr=False, compare=False)
    """GX's own result, for ``write_data_docs``; None when no expectation ran. Not part of ``to_dict``."""

    @property
    def failures(self) -> list[dict[str, Any]]:
        return [r for r in self.results if not r["success"]]

    @property
    def counted(self) -> dict[str, int]:
        """name -> unexpected count of the COUNTED expectations (they never fail the gate)."""
        return {r["name"]: r["unexpected_count"] for r in self.results if r["name"] in COUNTED}

    def to_dict(self) -> dict[str, Any]:
        return {"success": self.success, "row_count": self.row_count, "message": self.message,
                "results": [dict(r) for r in self.results]}

    def render(self) -> str:
        """A readable report: one line per failing expectation with its count and examples."""
        if self.message:
            return f"data quality gate FAILED: {self.message}"
        counted = "".join(f"; {name}: {count}" for name, count in self.counted.items() if count)
        if self.success:
            return f"data quality gate passed: {len(self.results)} expectations over {self.row_count} steps{counted}"
        lines = [f"data quality gate FAILED: {len(self.failures)} of {len(self.results)} expectations "
                 f"over {self.row_count} steps{counted}"]
        for result in self.failures:
            column = f" on column '{result['column']}'" if result["column"] else ""
            name = f" ({result['name']})" if result.get("name") else ""
            lines.append(f"- {result['expectation_type']}{column}{name}: {result['unexpected_count']} unexpected")
            for example in result["examples"]:
                lines.append(f"    e.g. {', '.join(f'{k}={v}' for k, v in example.items())}")
        return "\n".join(lines)


# -------------------------------------------------------------------------------------------- derived table

def _length(value: Any) -> int:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return 0
    return len(value)


def _all_finite(value: Any) -> bool:
    return bool(np.isfinite(np.asarray(value, dtype=np.float64)).all()) if _length(value) else True


def _flag(df: pd.DataFrame, name: str) -> pd.Series:
    """A boolean step flag; False on every row of a frame without the column (files older than the flag)."""
    return df[name].fillna(False).astype(bool) if name in df.columns else pd.Series(False, index=df.index)


def derive_checked_columns(df: pd.DataFrame) -> pd.DataFrame:
    """Scalar columns the suite checks, one row per step."""
    derived = pd.DataFrame({
        "trajectory_id": df["trajectory_id"].astype(object),
        "group_id": df["group_id"].astype(object),
        "step_index": df["step_index"],
        "prompt_len": df["prompt_ids"].map(_length).astype("int64"),
        "response_len": df["response_ids"].map(_length).astype("int64"),
        "logprob_len": df["logprobs"].map(_length).astype("int64"),
        "logprobs_finite": df["logprobs"].map(_all_finite).astype(bool),
        "reward": pd.to_numeric(df["reward"], errors="coerce").astype("float64"),
        "retokenized": _flag(df, "retokenized"),
        "prefix_break": _flag(df, "prefix_break"),
    })
    derived["logprob_len_mismatch"] = (derived["logprob_len"] - derived["response_len"]).abs()
    # distinct trajectories per group; a row whose group_id is null gets 0 (never a valid group size)
    per_group = derived.groupby("group_id", dropna=True)["trajectory_id"].transform("nunique")
    derived["group_trajectories"] = per_group.fillna(0).astype("int64")
    return derived.reset_index(drop=True)


def _suite(limits: QualityLimits) -> gx.ExpectationSuite:
    import great_expectations as gx
    import great_expectations.expectations as gxe

    suite = gx.ExpectationSuite(name="arlflow_steps")
    for expectation in (
        gxe.ExpectColumnValuesToNotBeNull(column="trajectory_id"),
        gxe.ExpectColumnValuesToNotBeNull(column="group_id"),
        gxe.ExpectColumnValuesToBeBetween(column="prompt_len", min_value=1, max_value=limits.max_prompt_tokens),
        gxe.ExpectColumnValuesToBeBetween(column="response_len", min_value=1,
                                          max_value=limits.max_response_tokens),
        gxe.ExpectColumnValuesToBeInSet(column="logprob_len_mismatch", value_set=[0]),
        gxe.ExpectColumnValuesToBeInSet(column="logprobs_finite", value_set=[True]),
        gxe.ExpectColumnValuesToNotBeNull(column="reward"),
        # NaN counts as missing for "between" (caught above); +-inf is outside any finite range
        gxe.ExpectColumnValuesToBeBetween(column="reward", min_value=limits.reward_min, max_value=limits.reward_max),
        gxe.ExpectColumnValuesToBeInSet(column="group_trajectories", value_set=[limits.group_size]),
        gxe.ExpectColumnValuesToBeInSet(column="retokenized", value_set=[False], description=NO_RETOKENIZED),
        gxe.ExpectColumnValuesToBeInSet(column="prefix_break", value_set=[False], mostly=0.0,
                                        description=PREFIX_BREAKS),  # mostly=0: counted, never failing
    ):
        suite.add_expectation(expectation)
    return suite


def _plain(value: Any) -> Any:
    """JSON-friendly scalar: numpy types to Python, non-finite floats to strings."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _examples(result: dict[str, Any], column: str | None, derived: pd.DataFrame) -> list[dict[str, Any]]:
    examples: list[dict[str, Any]] = []
    seen: set[tuple] = set()
    for row in result.get("unexpected_index_list") or []:
        if isinstance(row, dict):
            position = row.get("index")
            example = {k: _plain(v) for k, v in row.items() if k != "index"}
        else:  # a bare row index
            position, example = row, {}
        if column and isinstance(position, (int, np.integer)) and 0 <= position < len(derived):
            example[column] = _plain(derived.at[int(position), column])
        key = tuple(example.items()) if column != "group_trajectories" else (example.get("group_id"),)
        if key not in seen:
            seen.add(key)
            examples.append(example)
        if len(examples) == MAX_EXAMPLES:
            break
    if not examples:
        examples = [{column or "value": _plain(v)} for v in (result.get("partial_unexpected_list") or [])]
    return examples[:MAX_EXAMPLES]


STEPLESS = "stepless_trajectories"
"""steps.parquet metadata key: group id -> episodes of the group that ended before their first step (an env that
failed at reset). They have no step row, and the group-size check counts them as present, not lost."""


def stepless_groups(trajectories) -> dict[str, int]:
    """group id -> how many of ``trajectories`` (TrajectoryRecords) have no step."""
    counts: dict[str, int] = {}
    for traj in trajectories:
        if not traj.steps:
            counts[traj.group_id] = counts.get(traj.group_id, 0) + 1
    return counts


def _context() -> gx.data_context.EphemeralDataContext:
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.enable_analytics(False)  # never phone home from a training cluster
    context.variables.progress_bars = ProgressBarsConfig(globally=False)  # no tqdm bar per validation
    return context


def validate_steps(df: pd.DataFrame, limits: QualityLimits, *, round: int | None = None,
                   stepless: dict[str, int] | None = None) -> QualityReport:
    """Run the step-table suite on ``df`` (from ``DataPool.steps_frame`` or ``read_steps``).

    ``round`` only names the round in messages and the Data Docs. An empty frame fails ("no steps for round N").
    ``stepless`` (the rollout's ``STEPLESS`` metadata) counts, per group, the episodes that have no step row because
    they failed before their first step, so such a group still has ``group_size`` trajectories.
    """
    missing = [name for name in REQUIRED_COLUMNS if name not in df.columns]
    if missing:
        raise ValueError(f"validate_steps: the step table lacks columns {missing}; "
                         f"pass a frame from DataPool.steps_frame or datapool.parquet.read_steps")
    if len(df) == 0:
        where = f"round {round}" if round is not None else "this round"
        return QualityReport(success=False, row_count=0, message=f"no steps for {where}: did the rollout run?",
                             results=[{"name": "", "expectation_type": "expect_table_row_count_to_be_between",
                                       "column": None,
                                       "success": False, "unexpected_count": 0, "examples": []}])
    derived = derive_checked_columns(df)
    if stepless:
        derived["group_trajectories"] += derived["group_id"].map(stepless).fillna(0).astype("int64")

    import great_expectations as gx
    from great_expectations.core import RunIdentifier

    context = _context()
    batch_definition = (context.data_sources.add_pandas("steps")
                        .add_dataframe_asset("steps")
                        .add_batch_definition_whole_dataframe("round"))
    definition = context.validation_definitions.add(gx.ValidationDefinition(
        name="steps", data=batch_definition, suite=context.suites.add(_suite(limits))))
    validation = definition.run(  # names the run in the Data Docs
        batch_parameters={"dataframe": derived},
        run_id=RunIdentifier(run_name=f"round_{round}" if round is not None else "steps"),
        result_format={"result_format": "COMPLETE", "unexpected_index_column_names": _INDEX_COLUMNS,
                       "partial_unexpected_count": MAX_EXAMPLES})

    results = []
    for item in validation.results:
        config = item.expectation_config
        column = config.kwargs.get("column")
        result = item.result or {}
        results.append({
            "name": config.description or "",
            "expectation_type": config.type,
            "column": column,
            "success": bool(item.success),
            "unexpected_count": int(result.get("unexpected_count") or 0),
            "examples": ([] if item.success and not result.get("unexpected_count")
                         else _examples(result, column, derived)),
        })
    return QualityReport(success=bool(validation.success), results=results, row_count=len(derived),
                         validation=validation)


_DOCS_SITE = "arlflow"
_DOCS_BATCH = "steps"
"""Names the validation result page (``<batch>.html``)."""


def write_data_docs(report: QualityReport, folder: Path) -> Path | None:
    """Publish ``report``'s validation as GX Data Docs: a static site in ``folder`` (index.html, the suite's page,
    the validation result page). Returns the result page, relative to ``folder``: it reads offline, where the site's
    index.html lists the run only with the scripts GX loads from a CDN. None, writing nothing, when no expectation
    ran (an empty step table)."""
    import great_expectations as gx
    from great_expectations.data_context.types.resource_identifiers import (ExpectationSuiteIdentifier,
                                                                             ValidationResultIdentifier)

    validation = report.validation
    if validation is None:
        return None
    context = _context()
    context.add_data_docs_site(_DOCS_SITE, {"class_name": "SiteBuilder", "show_how_to_buttons": False,
                                            "store_backend": {"class_name": "TupleFilesystemStoreBackend",
                                                              "base_directory": str(folder)}})
    suite_id = ExpectationSuiteIdentifier(name=validation.suite_name)
    result_id = ValidationResultIdentifier(suite_id, validation.meta["run_id"], _DOCS_BATCH)
    context.suites.add(gx.ExpectationSuite(name=validation.suite_name, expectations=[  # copies: no suite's ids
        copy.copy(result.expectation_config.to_domain_obj()) for result in validation.results]))
    context.validation_results_store.set(result_id, validation)
    context.build_data_docs(site_names=[_DOCS_SITE], resource_identifiers=[result_id, suite_id])
    for animation in (folder / "static" / "images").glob("*.gif"):
        animation.unlink()  # GX's help animations: no page of the site shows them, and they are 3.3 of its 4 MB
    page = next((folder / "validations").rglob(f"{_DOCS_BATCH}.html"))
    return page.relative_to(folder)


def drop_zero_variance_groups(df: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, int]]:
    """Drop every group whose trajectories all have the same episode_return (zero GRPO advantage signal).

    A group with a single trajectory has no variance and is dropped too. Returns (kept rows, stats with
    groups_total, groups_dropped, steps_dropped).
    """
    for name in ("group_id", "trajectory_id", "episode_return"):
        if name not in df.columns:
            raise ValueError(f"drop_zero_variance_groups: the step table lacks column {name!r}")
    zero = degenerate_group_ids(df)  # the one degenerate-group rule, shared with the train filters
    dropped = df["group_id"].isin(zero)
    stats = {"groups_total": int(df["group_id"].nunique(dropna=False)), "groups_dropped": len(zero),
             "steps_dropped": int(dropped.sum())}
    return df.loc[~dropped].reset_index(drop=True), stats
