"""params.yaml: loading, checking and writing the config (the sections themselves are in tasks/sections.py).

Loading validates everything before any stage runs or writes: YAML syntax, duplicate keys, an empty file, unknown
sections and keys, types, value ranges (each config's ``__post_init__``), registry names (a field whose metadata
names a registry), env kwargs (each env's constructor), and cross-section consistency (`check_params`). Every
problem is a one-line ``ParamsError`` that names the key and says what is valid. A dataclass with a ``name`` or
``method`` field also accepts that string alone (``train.advantage: gigpo`` is ``{name: gigpo}``).
"""
from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from envs.base import ENVS
from models.checks import ConfigValueError
from tasks.sections import SECTIONS, Params  # noqa: F401 - Params: part of the config API (from tasks.config)


class ParamsError(ValueError):
    """params.yaml is malformed: the message says which key and what is valid."""


MOVED_KEYS: dict[str, str] = {
    **{f"bootstrap.{k}": f"bootstrap.tiny.{k}" for k in ("arch", "hidden_size", "num_layers", "num_heads",
                                                          "num_kv_heads", "intermediate_size",
                                                          "max_position_embeddings")},
    **{f"warmstart.{k}": f"warmstart.update.{k}" for k in ("epochs", "micro_batch_size")}, "warmstart.lr":
        "warmstart.optimizer.lr",
    **{f"rollout.{k}": f"rollout.sampling.{k}" for k in ("temperature", "top_p", "max_new_tokens")},
    **{f"rollout.{k}": f"harness.{k}" for k in ("context", "history_turns", "process_alpha", "tool_format",
                                                "step_timeout_s")},
    **{f"train.{k}": f"train.loss.{k}" for k in ("clip_low", "clip_high", "dual_clip", "aggregation", "kl_beta",
                                                 "kl_kind", "entropy_coef")},
    **{f"train.{k}": f"train.advantage.{k}" for k in ("gamma", "omega", "process_weight", "anchor_mode")},
    **{f"train.{k}": f"train.update.{k}" for k in ("epochs", "micro_batch_size", "mini_batch_size", "token_budget",
                                                   "checkpoint_every")},
    **{f"train.{k}": f"train.optimizer.{k}" for k in ("lr", "zero_stage")},
    "train.echo_weight": "train.aux.echo_weight", "train.seal_weight": "train.aux.seal_weight",
    "train.lora_r": "train.lora.r", "train.internalize_coef": "train.internalize.coef",
    "train.internalize_w_max": "train.internalize.w_max",
    "train.overlong_max_tokens": "train.filters.overlong_max_tokens",
    "train.overlong_buffer_tokens": "train.filters.overlong_buffer_tokens",
    "evaluate.temperature": "evaluate.sampling.temperature", "evaluate.skills_k": "skills.retrieval.k",
    "evaluate.skills_alpha": "skills.retrieval.alpha", "evaluate.skills_floor": "skills.retrieval.floor",
    "evaluate.skills_per_step": "skills.retrieval.mode (per_step | per_episode)",
    "skills.ucb_c": "skills.retrieval.ucb_c", "skills.tau": "skills.validation.tau",
    "skills.t_min": "skills.validation.t_min", "skills.versions_gamma": "skills.versions.gamma",
    "skills.versions_min_uses": "skills.versions.min_uses", "skills.llm_miner": "skills.llm.miner",
    "skills.llm_model": "skills.llm.model", "skills.llm_api_key_env": "skills.llm.api_key_env",
    "skills.prune_min_utility": "skills.prune.min_utility",
    "skills.prune_max_idle_rounds": "skills.prune.max_idle_rounds",
    "skills.max_bank_size": "skills.prune.max_bank_size",
    **{f"transfer.{k}": f"transfer.model.{k}" for k in ("arch", "hidden_size", "num_layers", "num_heads",
                                                         "num_kv_heads", "intermediate_size")},
}
"""Keys of the params.yaml layout before the sections were the library's configs -> where they live now (the error
for an unknown key says so)."""
SHORTHAND_FIELDS = ("name", "method")
"""A mapping section whose dataclass has one of these fields may be written as that field's value alone."""


# ------------------------------------------------------------------------------------------------- the loader

def _settable(cls: type) -> list[dataclasses.Field]:
    """The fields params.yaml may set (a field with metadata ``params: False`` is derived by the stages)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("params", True)]


def _type_name(expected: Any) -> str:
    origin = typing.get_origin(expected)
    if origin is tuple:
        return "a list of strings"
    if origin is dict:
        return "a mapping"
    if origin is typing.Literal:
        return f"one of {list(typing.get_args(expected))}"
    if dataclasses.is_dataclass(expected):
        return "a mapping of keys"
    return getattr(expected, "__name__", str(expected))


def _wrong(path: str, expected: Any, value: Any) -> ParamsError:
    return ParamsError(f"params.yaml: {path} must be {_type_name(expected)}, got {value!r} ({type(value).__name__})")


def _check_registry(path: str, spec: dataclasses.Field, value: Any) -> None:
    registry = spec.metadata.get("registry")
    if registry is None:
        return
    names = registry.names() if hasattr(registry, "names") else sorted(registry)
    kind = getattr(registry, "kind", spec.name)
    for item in (value if isinstance(value, tuple) else (value,)):
        if item not in registry:
            raise ParamsError(f"params.yaml: {path} = {item!r} is not a registered {kind}; valid: {names}")


def _coerce(path: str, expected: Any, value: Any, default: Any) -> Any:
    """``value`` checked against the annotation ``expected`` (int is accepted for float, bool never for int);
    nested dataclasses are built on top of ``default``."""
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(expected) if a is not type(None)]
        if value is None and len(options) < len(typing.get_args(expected)):
            return None
        return _coerce(path, options[0], value, default)
    if dataclasses.is_dataclass(expected):
        return build_config(expected, value, path, default)
    if expected is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif expected is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif expected is bool or expected is str:
        if isinstance(value, expected):
            return value
    elif origin is typing.Literal:
        if value in typing.get_args(expected):
            return value
    elif origin is tuple:  # tuple[str, ...]: a YAML list of strings
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return tuple(value)
    elif origin is dict:  # dict[str, int] or dict[str, dict[str, Any]]: a YAML mapping
        inner = typing.get_args(expected)[1]
        check = ((lambda v: isinstance(v, int) and not isinstance(v, bool)) if inner is int
                 else (lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v)))
        if isinstance(value, dict) and all(isinstance(k, str) and check(v) for k, v in value.items()):
            return {k: dict(v) if isinstance(v, dict) else v for k, v in value.items()}
    else:
        raise TypeError(f"tasks/config.py: unsupported annotation {expected!r} for {path}")
    raise _wrong(path, expected, value)


def build_config(cls: type, raw: Any, path: str, default: Any = None) -> Any:
    """An instance of the config dataclass ``cls`` from its parsed YAML ``raw``: the keys given replace those of
    ``default`` (``cls()`` when None). Every problem raises ParamsError naming ``path.key``."""
    base = default if default is not None else cls()
    fields = {f.name: f for f in _settable(cls)}
    if isinstance(raw, str):
        shorthand = [name for name in SHORTHAND_FIELDS if name in fields]
        if shorthand:
            raw = {shorthand[0]: raw}
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise _wrong(path, cls, raw)
    unknown = sorted(str(key) for key in raw if key not in fields)
    if unknown:
        moved = [f"{path}.{key} is now {MOVED_KEYS[f'{path}.{key}']}" for key in unknown if f"{path}.{key}" in MOVED_KEYS]
        hint = f" ({'; '.join(moved)})" if moved else ""
        raise ParamsError(f"params.yaml: unknown key(s) {unknown} in {path}; valid keys: {list(fields)}{hint}")
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in raw.items():
        values[key] = _coerce(f"{path}.{key}", hints[key], value, getattr(base, key))
        _check_registry(f"{path}.{key}", fields[key], values[key])
    try:
        return dataclasses.replace(base, **values)
    except ConfigValueError as err:
        raise ParamsError(f"params.yaml: {path}.{err}") from err
    except (ValueError, TypeError, KeyError) as err:
        raise ParamsError(f"params.yaml: {path}: {err}") from err


def parse_params(raw: Any) -> Params:
    """Build Params from a parsed YAML mapping; every problem raises ParamsError naming the key."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError(f"params.yaml must be a mapping of sections {list(SECTIONS)}, got {type(raw).__name__}")
    unknown = sorted(str(key) for key in raw if key not in SECTIONS)
    if unknown:
        raise ParamsError(f"params.yaml: unknown section(s) {unknown}; valid sections: {list(SECTIONS)}")
    defaults = Params()
    sections = {name: build_config(type(getattr(defaults, name)), raw.get(name), name, getattr(defaults, name))
                for name in SECTIONS}
    params = Params(**sections)
    check_params(params)
    return params


def check_params(params: Params) -> None:
    """Cross-section consistency: combinations that cannot run, each with how to fix it."""
    train, rollout = params.train, params.rollout
    if train.aux.names and train.layout != "concatenated":
        raise ParamsError(f"params.yaml: train.aux.names {list(train.aux.names)} needs train.layout: concatenated "
                          "(the auxiliary losses read observation tokens inside whole-trajectory sequences)")
    if train.advantage.process_weight > 0 and params.harness.context != "fold":
        raise ParamsError("params.yaml: train.advantage.process_weight > 0 needs harness.context: fold (the process "
                          "rewards come from subgoal folding); set it to 0 or use the fold context")
    if params.validate.max_response_tokens < rollout.sampling.max_new_tokens:
        raise ParamsError(f"params.yaml: validate.max_response_tokens ({params.validate.max_response_tokens}) is below "
                          f"rollout.sampling.max_new_tokens ({rollout.sampling.max_new_tokens}): every response that "
                          "uses its budget would fail the data gate; raise it")
    tiny = params.bootstrap.tiny
    longest = params.validate.max_prompt_tokens + params.validate.max_response_tokens
    if not params.bootstrap.model and tiny.max_position_embeddings < longest:
        raise ParamsError(f"params.yaml: bootstrap.tiny.max_position_embeddings ({tiny.max_position_embeddings}) is "
                          f"below validate.max_prompt_tokens + max_response_tokens ({longest}): the model could not "
                          "read the longest step the gate lets through")
    check_env_params(params)
    train_total = sum(params.env.mix.values()) if params.env.mix else params.bootstrap.train_scenarios
    if rollout.scenarios_per_round > train_total:
        raise ParamsError(f"params.yaml: rollout.scenarios_per_round ({rollout.scenarios_per_round}) exceeds the "
                          f"{train_total} train scenarios (bootstrap.train_scenarios, or the sum of env.mix); lower it "
                          "or raise those")
    if params.warmstart.enabled and params.warmstart.demo_scenarios > train_total:
        raise ParamsError(f"params.yaml: warmstart.demo_scenarios ({params.warmstart.demo_scenarios}) exceeds the "
                          f"{train_total} train scenarios; lower it or raise bootstrap.train_scenarios")


def check_env_params(params: Params) -> None:
    """Env names, mix counts and kwargs against the env registry and each env's constructor signature."""
    named = set(params.env.names) | set(params.env.kwargs)
    unknown = sorted(name for name in named if name not in ENVS)
    if unknown:
        raise ParamsError(f"params.yaml: env {unknown} not registered (in env.name, env.mix or env.kwargs); "
                          f"registered envs: {sorted(ENVS)}")
    bad_counts = {name: n for name, n in params.env.mix.items() if n < 1}
    if bad_counts:
        raise ParamsError(f"params.yaml: env.mix counts must be >= 1, got {bad_counts}; drop the env instead")
    for name, kwargs in params.env.kwargs.items():
        signature = inspect.signature(ENVS[name])
        accepted = [p.name for p in signature.parameters.values() if p.kind is p.KEYWORD_ONLY or
                    p.kind is p.POSITIONAL_OR_KEYWORD]
        wrong = sorted(set(kwargs) - set(accepted))
        if wrong:
            raise ParamsError(f"params.yaml: env.kwargs.{name} has unknown key(s) {wrong}; {name} accepts {accepted}")
        try:  # constructing an env is cheap (no reset): its own checks judge the values
            ENVS[name](**kwargs)
        except (TypeError, ValueError) as err:
            raise ParamsError(f"params.yaml: env.kwargs.{name} is not accepted by the env: {err}") from err


# ------------------------------------------------------------------------------------------------------ YAML

class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and reads YAML 1.2 floats such as ``1e-3`` (YAML 1.1 needs a dot)."""


def _no_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise ParamsError(f"params.yaml line {line}: duplicate key {key!r} (first at line {seen[key]}); keep one")
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                                    list("-+0123456789."))


def read_yaml(text: str, source: str = "params.yaml") -> Any:
    """Parse params YAML strictly (duplicate keys refused); ParamsError on bad syntax."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise ParamsError(f"{source} is not valid YAML: {' '.join(str(err).split())}") from err


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate params.yaml (missing, empty or bad YAML -> ParamsError saying so)."""
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"{path} not found: run from the repository root or pass --root PATH")
    raw = read_yaml(path.read_text(), str(path))
    if raw is None:
        raise ParamsError(f"{path} is empty: it must hold the pipeline's sections {list(SECTIONS)} (restore it with "
                          "`git checkout params.yaml`; `arlflow check-params --defaults` prints the defaults)")
    try:
        return parse_params(raw)
    except ParamsError as err:  # the checks name params.yaml; a profile's errors name the profile's file
        message = str(err)
        if path.name == "params.yaml" or not message.startswith("params.yaml"):
            raise
        raise ParamsError(f"{path}{message[len('params.yaml'):]}") from err


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in _settable(type(value))}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def params_to_dict(params: Params) -> dict[str, Any]:
    """Plain YAML-ready values of every settable key (tuples become lists, nested configs mappings)."""
    return _plain(params)


def params_to_yaml(params: Params) -> str:
    """The resolved config as params.yaml would spell it."""
    return yaml.safe_dump(params_to_dict(params), sort_keys=False, width=120)
