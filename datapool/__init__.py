"""Step/trajectory records, the durable data pool, Parquet export and the data quality gate.

Import the heavier parts from their modules so importing the records stays cheap:
``datapool.store`` (DataPool, SQLAlchemy), ``datapool.parquet`` (export_steps/read_steps, pyarrow) and
``datapool.quality`` (validate_steps, great-expectations, ~2 s to import).
"""
from datapool.records import TRAJECTORY_STATUSES, StepRecord, TrajectoryRecord

__all__ = ["TRAJECTORY_STATUSES", "StepRecord", "TrajectoryRecord"]
