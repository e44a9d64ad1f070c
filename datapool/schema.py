"""The vocabulary the step and trajectory records are written in: field kinds and per-field metadata.

``datapool.records`` declares every field of StepRecord and TrajectoryRecord once, with ``column(kind, doc, ...)``;
everything else is derived from those declarations: the SQL columns, row encoders/decoders and migrations
(``datapool.tables``), the Arrow schema and the defaults older Parquet files get (``datapool.parquet``), the
conversion of a Parquet row back to a record and the validation of each field's kind (``datapool.records``).
A backend maps each KIND to its own type; a kind it lacks fails at import, not at the first write.

Pure module (numpy only): no SQLAlchemy, no pyarrow.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


class _NoDefault:
    def __repr__(self) -> str:
        return "NO_DEFAULT"


NO_DEFAULT: Any = _NoDefault()
"""The ``default`` of a field every record must set (only fields of the first schema version may lack one)."""


@dataclass(frozen=True)
class FieldSpec:
    """One field of a record (or of an exported step row): its kind and what storage needs to know about it."""

    name: str
    kind: str
    """One of KINDS."""
    doc: str
    """One line: what the field holds."""
    since: int = 1
    """The pool schema version that added the field; the Parquet layout has moved in step with it so far."""
    default: Any = NO_DEFAULT
    """The record's default, and what rows and files written before ``since`` get."""
    nullable: bool = False
    """None is a valid value (stored as NULL)."""
    nonempty: bool = False
    """A str field that must not be empty."""
    finite: bool = False
    """A float field that must be finite (others may be +-inf, never NaN)."""
    index: bool = False
    """The pool keeps an SQL index on the column."""
    on_step_rows: bool = False
    """A trajectory field repeated on every row of ``DataPool.steps_frame`` and of steps.parquet."""

    @property
    def has_default(self) -> bool:
        return self.default is not NO_DEFAULT


# ------------------------------------------------------------------------------------------------ kinds

def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _ids_problem(value: Any) -> str | None:
    if isinstance(value, list) and not value:  # the common empty skill trace: no numpy round trip
        return None
    arr = np.asarray(value)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        return f"must be a flat list of ints, got dtype {arr.dtype} with shape {arr.shape}"
    if arr.size and (arr.min() < INT32_MIN or arr.max() > INT32_MAX):
        return "holds an id outside the int32 range"
    return None


def _logprobs_problem(value: Any) -> str | None:
    arr = np.asarray(value)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iuf"):
        return "must be a flat list of floats"
    return None


def _id_lists_problem(value: Any) -> str | None:
    if isinstance(value, list) and not value:
        return None
    if not isinstance(value, (list, tuple)):
        return f"must be a list of id lists, got {type(value).__name__}"
    for position, ids in enumerate(value):
        if not isinstance(ids, (list, tuple, np.ndarray)):
            return f"item {position} must be a list of ints, got {type(ids).__name__}"
        problem = _ids_problem(ids)
        if problem is not None:
            return f"item {position} {problem}"
    return None


def _str_problem(value: Any, spec: FieldSpec) -> str | None:
    if not isinstance(value, str):
        return f"must be a{' non-empty' if spec.nonempty else ''} str, got {type(value).__name__}"
    if spec.nonempty and not value:
        return "must be a non-empty str"
    return None


def _int_problem(value: Any) -> str | None:
    if not is_int(value) or not 0 <= value <= INT32_MAX:
        return f"must be an int >= 0 (int32), got {value!r}"
    return None


def _float_problem(value: Any, spec: FieldSpec) -> str | None:
    if spec.finite:
        if not is_real(value) or not math.isfinite(value):
            return f"must be a finite real number; got {value!r}"
    elif not is_real(value) or math.isnan(value):
        # SQL backends cannot round-trip NaN faithfully (SQLite stores it as NULL)
        return f"must be a real number, not NaN; got {value!r}"
    return None


def _json_problem(value: Any) -> str | None:
    if not isinstance(value, dict):
        return "must be a dict"
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        return f"is not JSON-serializable ({exc})"
    return None


@dataclass(frozen=True)
class Kind:
    """What values of a kind look like in Python: the check a record's value must pass, and the conversion of a
    value read back from a table or file (numpy arrays, numpy scalars) to the record's plain Python value."""

    python: str
    problem: Callable[[Any, FieldSpec], str | None]
    """None when the value is valid, else what is wrong with it (completes "field 'x' ...")."""
    to_python: Callable[[Any], Any]


def _id_list(value: Any) -> list[int]:
    return [int(i) for i in value]


KINDS: dict[str, Kind] = {
    "ids": Kind("list[int] (token ids, int32)", lambda v, s: _ids_problem(v), _id_list),
    "logprobs": Kind("list[float] (stored as float32)", lambda v, s: _logprobs_problem(v),
                     lambda v: [float(x) for x in v]),
    "id_lists": Kind("list[list[int]] (token id lists)", lambda v, s: _id_lists_problem(v),
                     lambda v: [_id_list(ids) for ids in v]),
    "text": Kind("str (model-generated: may hold anything, NUL included)", _str_problem, str),
    "str": Kind("str (an identifier or name)", _str_problem, str),
    "int": Kind("int >= 0 (int32)", lambda v, s: _int_problem(v), int),
    "float": Kind("float (never NaN)", _float_problem, float),
    "bool": Kind("bool", lambda v, s: None if isinstance(v, (bool, np.bool_)) else "must be a bool", bool),
    "strs": Kind("list[str]", lambda v, s: None if isinstance(v, (list, tuple)) and all(
        isinstance(x, str) for x in v) else "must be a list of str", lambda v: [str(x) for x in v]),
    "json": Kind("dict (JSON-serializable)", lambda v, s: _json_problem(v), dict),
}
"""kind name -> its Python contract. Backends map every kind they store to a type (tables.SQL_KINDS,
parquet.ARROW_TYPES)."""


def problem(spec: FieldSpec, value: Any) -> str | None:
    """What is wrong with ``value`` as the value of field ``spec`` (None: nothing)."""
    if value is None and spec.nullable:
        return None
    return KINDS[spec.kind].problem(value, spec)


def checker(spec: FieldSpec) -> Callable[[Any], str | None]:
    """``problem`` for one field as a one-argument function (what a validation loop calls per record)."""
    check = KINDS[spec.kind].problem
    if spec.nullable:
        return lambda value: None if value is None else check(value, spec)
    return lambda value: check(value, spec)


def to_python(spec: FieldSpec, value: Any) -> Any:
    """``value`` (as read back from a table or file) as the record's Python value."""
    if value is None and spec.nullable:
        return None
    return KINDS[spec.kind].to_python(value)


# ------------------------------------------------------------------------------------ declaring fields

_SPEC = "arlflow.schema"  # key of the FieldSpec in a dataclass field's metadata


def spec(name: str, kind: str, doc: str, **options: Any) -> FieldSpec:
    """A checked FieldSpec (also for columns that are no record's field, e.g. ``excluded``)."""
    if kind not in KINDS:
        raise ValueError(f"field {name!r} has unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
    made = FieldSpec(name, kind, doc, **options)
    if made.since > 1 and not made.has_default:
        raise ValueError(f"field {name!r} was added in version {made.since}: give it a default (what older rows get)")
    if isinstance(made.default, (list, dict)) and made.default:
        raise ValueError(f"field {name!r}: a list or dict default must be empty")
    return made


def column(kind: str, doc: str, **options: Any) -> Any:
    """A record field of ``kind`` (a ``dataclasses.field`` carrying its FieldSpec); see FieldSpec for options."""
    made = spec("", kind, doc, **options)  # the name is the dataclass field's, filled in by field_specs
    metadata = {_SPEC: made}
    if not made.has_default:
        return dataclasses.field(metadata=metadata)
    if isinstance(made.default, (list, dict)):
        return dataclasses.field(default_factory=type(made.default), metadata=metadata)
    return dataclasses.field(default=made.default, metadata=metadata)


def field_specs(cls: type, *, relations: tuple[str, ...] = ()) -> tuple[FieldSpec, ...]:
    """The FieldSpecs of dataclass ``cls``, in field order. Every field must be declared with ``column``, except
    the ``relations`` (e.g. a trajectory's ``steps``): TypeError at import otherwise."""
    out = []
    for item in dataclasses.fields(cls):
        if item.name in relations:
            continue
        if _SPEC not in item.metadata:
            raise TypeError(f"{cls.__name__}.{item.name} has no schema: declare it with datapool.schema.column(kind, "
                            f"doc, ...) so storage and export know it")
        out.append(dataclasses.replace(item.metadata[_SPEC], name=item.name))
    return tuple(out)
