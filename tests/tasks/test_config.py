"""params.yaml loader: the library configs are the config; every bad value is refused by name before anything runs."""
import ast
import dataclasses
import inspect
import math
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from flows.dvc_sync import render_dvc_yaml
from models.advantages import ADVANTAGES, AdvantageConfig
from models.aux_losses import AUX_LOSSES
from models.build import ARCHITECTURES
from models.config import TINY_ARCHITECTURES
from models.losses import LOSSES, LossConfig
from models.registry import Registry
from tasks.config import Params, ParamsError, load_params, params_to_dict, params_to_yaml, parse_params, read_yaml
from tasks.layout import Layout

REPO = Path(__file__).resolve().parents[2]


def config_classes(cls: type = Params, seen: dict | None = None) -> dict[str, type]:
    """Every config dataclass reachable from Params, by its params.yaml path."""
    seen = {} if seen is None else seen
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            path = f.name if cls is Params else f"{[k for k, v in seen.items() if v is cls][0]}.{f.name}"
            seen[path] = hints[f.name]
            config_classes(hints[f.name], seen)
    return seen


def test_repo_params_yaml_spells_out_exactly_the_defaults():
    """params.yaml holds every knob at its default, so `dvc params diff` sees every change and nothing drifts:
    the file itself, not only what loads from it (a knob left out would load at its default unseen)."""
    assert yaml.safe_load((REPO / "params.yaml").read_text()) == params_to_dict(Params())
    assert load_params(REPO / "params.yaml") == parse_params({})


@pytest.mark.parametrize("profile", sorted((REPO / "configs").glob("*.yaml")), ids=lambda path: path.name)
def test_every_shipped_profile_loads_and_each_of_its_keys_lands(profile):
    """A profile in configs/ is checked like params.yaml (unknown keys and bad values refused: a typo in a shipped
    profile fails here, not in a user's `arlflow use-profile`), and every value it sets is the loaded value."""
    loaded = params_to_dict(load_params(profile))

    def leaves(tree: dict, prefix: str = "") -> list[tuple[str, object]]:
        return [leaf for key, value in tree.items()
                for leaf in (leaves(value, f"{prefix}{key}.") if isinstance(value, dict) and value
                             else [(f"{prefix}{key}", value)])]

    def get(tree: dict, dotted: str):
        for key in dotted.split("."):
            tree = tree[key]
        return tree

    keys = leaves(read_yaml(profile.read_text(), profile.name))
    assert keys, f"{profile.name} sets nothing"
    assert {key: get(loaded, key) for key, _ in keys} == dict(keys)


def test_every_settable_field_is_documented_once_in_its_dataclass():
    """A docstring right under each field (STYLE.md): the only place a knob is described."""
    def has_docstring(cls: type) -> bool:
        return ast.get_docstring(ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]) is not None

    undocumented = []
    for path, cls in {"": Params, **config_classes()}.items():
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        body = tree.body[0].body
        documented = {node.target.id for node, nxt in zip(body, body[1:] + [None])
                      if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                      and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)}
        hints = typing.get_type_hints(cls)
        undocumented += [f"{path}.{f.name}".lstrip(".") for f in dataclasses.fields(cls)
                         if f.metadata.get("params", True) and f.name not in documented
                         and not (dataclasses.is_dataclass(hints[f.name]) and has_docstring(hints[f.name]))]
    assert not undocumented, f"add a docstring under these fields: {undocumented}"


def test_library_configs_are_the_sections():
    """The sections are the dataclasses the library takes (no copies wired by hand)."""
    params = parse_params({"train": {"loss": {"clip_high": 0.3}}})
    assert isinstance(params.train.loss, LossConfig) and params.train.loss.clip_high == 0.3
    paths = config_classes()
    assert paths["train.advantage"] is AdvantageConfig  # defined torch-free in models/config.py, re-exported there
    assert paths["train.filters"].__module__ == "datapool.filters"
    assert paths["skills.retrieval"].__module__ == "skills.retrieval"
    assert paths["rollout.sampling"].__module__ == "models.engine"


def test_a_nested_key_keeps_the_other_defaults_and_a_name_alone_selects():
    params = parse_params({"train": {"loss": {"clip_low": 0.1}, "advantage": "gigpo"}})
    assert params.train.loss == dataclasses.replace(Params().train.loss, clip_low=0.1)
    assert params.train.advantage.name == "gigpo" and params.train.advantage.gamma == 0.95
    assert parse_params({"mine": "mdl"}).mine.method == "mdl"


def test_every_section_is_a_frozen_dataclass():
    params = parse_params({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.train.optimizer.lr = 1.0  # type: ignore[misc]


BAD_VALUES = [  # (params.yaml override, fragments the one-line error must hold)
    ({"train": {"optimizer": {"lr_schedule": "cosine"}, "internalize": {"coef": 0.5}}},
     ["train.optimizer.min_lr_ratio = 0.0", "internalization runs after the decay"]),
    ({"train": {"update": {"micro_batch_size": 0}}}, ["train.update.micro_batch_size = 0", "> 0"]),
    ({"rollout": {"scenarios_per_round": 0}}, ["rollout.scenarios_per_round = 0", "> 0"]),
    ({"rollout": {"scenarios_per_round": -1}}, ["rollout.scenarios_per_round = -1"]),
    ({"rollout": {"sampling": {"temperature": -1}}}, ["rollout.sampling.temperature = -1.0", ">= 0"]),
    ({"rollout": {"sampling": {"temperature": math.nan}}}, ["rollout.sampling.temperature", "finite"]),
    ({"rollout": {"sampling": {"top_p": 0}}}, ["rollout.sampling.top_p = 0.0", "in (0, 1]"]),
    ({"rollout": {"sampling": {"seed": 3}}}, ["unknown key(s) ['seed']", "rollout.sampling"]),
    ({"train": {"optimizer": {"lr": -1}}}, ["train.optimizer.lr = -1.0", "> 0"]),
    ({"train": {"optimizer": {"lr": math.inf}}}, ["train.optimizer.lr", "finite"]),
    ({"train": {"optimizer": {"zero_stage": 4}}}, ["train.optimizer.zero_stage = 4", "[0, 1, 2, 3]"]),
    ({"train": {"update": {"epochs": -1}}}, ["train.update.epochs = -1", "> 0"]),
    ({"train": {"loss": {"clip_low": -1}}}, ["train.loss.clip_low = -1.0", "in [0, 1)"]),
    ({"train": {"loss": {"dual_clip": 0.5}}}, ["train.loss.dual_clip = 0.5", "> 1"]),
    ({"train": {"loss": {"aggregation": "mean"}}}, ["train.loss.aggregation = 'mean'", "token-mean"]),
    ({"bootstrap": {"vocab_size": 0}}, ["bootstrap.vocab_size = 0", ">= 257"]),
    ({"bootstrap": {"tiny": {"num_heads": 3}}}, ["bootstrap.tiny.num_heads = 3", "divisor of hidden_size (128)"]),
    ({"bootstrap": {"tiny": {"num_kv_heads": 3}}}, ["bootstrap.tiny.num_kv_heads = 3", "divisor of num_heads"]),
    ({"bootstrap": {"heldout_scenarios": -5}}, ["bootstrap.heldout_scenarios = -5", "> 0"]),
    ({"validate": {"reward_min": 2.0}}, ["validate.reward_min = 2.0", "< reward_max (1.0)"]),
    ({"validate": {"max_response_tokens": 2}}, ["validate.max_response_tokens (2)", "max_new_tokens (4)"]),
    ({"mine": {"min_support": 5}}, ["mine.min_support = 5.0", "in (0, 1]"]),
    ({"mine": {"method": "llm"}}, ["mine.method = 'llm'", "registered miner", "mdl"]),
    ({"skills": {"retrieval": {"k": -1}}}, ["skills.retrieval: k must be >= 0"]),
    ({"skills": {"versions": {"gamma": 0.5}}}, ["skills.versions", "gamma = 0.5"]),
    ({"skills": {"llm": {"miner": "ftp://x"}}}, ["skills.llm.miner = 'ftp://x'", "http(s)"]),
    ({"skills": {"llm": {"api_key_env": "sk-123 secret"}}}, ["skills.llm.api_key_env", "NAME of an environment"]),
    ({"train": {"advantage": "grpoo"}}, ["train.advantage.name = 'grpoo'", "registered advantage", "gigpo"]),
    ({"train": {"advantage": {"gamma": 1.5}}}, ["train.advantage.gamma = 1.5", "in [0, 1]"]),
    ({"train": {"filters": {"names": ["nosuch"]}}}, ["train.filters.names = 'nosuch'", "registered filter"]),
    ({"train": {"filters": ["truncated"]}}, ["train.filters must be a mapping of keys"]),
    ({"train": {"aux": {"names": ["echo"]}}}, ["train.aux.names", "layout: concatenated"]),
    ({"train": {"layout": "rows"}}, ["train.layout = 'rows'", "step_rows"]),
    ({"train": {"lr": 0.1}}, ["unknown key(s) ['lr'] in train", "(train.lr is now train.optimizer.lr)"]),
    ({"evaluate": {"skills_k": 2}}, ["evaluate.skills_k is now skills.retrieval.k"]),
    ({"train": {"optimizer": {"lr": "fast"}}}, ["train.optimizer.lr must be float", "'fast'"]),
    ({"rollout": {"group_size": True}}, ["rollout.group_size must be int"]),
    ({"rollout": {"group_size": 1}}, ["rollout.group_size = 1", ">= 2"]),
    ({"rollout": {"pool_url": "data/pool.db"}}, ["rollout.pool_url", "SQLAlchemy URL"]),
    ({"harness": {"context": "zip"}}, ["harness.context = 'zip'", "fold", "window"]),
    ({"harness": {"tool_format": "xml"}}, ["harness.tool_format = 'xml'", "openai"]),
    ({"harness": {"step_timeout_s": 0}}, ["harness.step_timeout_s = 0.0", "> 0"]),
    ({"trian": {}}, ["'trian'", "valid sections", "'train'"]),
    ({"train": [1, 2]}, ["params.yaml: train must be a mapping of keys"]),
    ({"env": {"kwargs": {"frozenlake": {"sise": 4}}}}, ["env.kwargs.frozenlake", "'sise'", "size"]),
    ({"env": {"kwargs": {"frozenlake": {"size": 1}}}}, ["env.kwargs.frozenlake", "size must be >= 2"]),
    ({"env": {"mix": {"nope": 3}}}, ["'nope'", "registered envs", "household"]),
    ({"env": {"mix": {"sokoban": 0}}}, ["env.mix", ">= 1"]),
    ({"env": {"name": "nope"}}, ["env.name = 'nope'", "frozenlake"]),
    ({"pipeline": {"rounds": 0}}, ["pipeline.rounds = 0", "> 0"]),
    ({"rollout": {"scenarios_per_round": 600}}, ["rollout.scenarios_per_round (600)", "512 train scenarios"]),
]


@pytest.mark.parametrize("raw, fragments", BAD_VALUES, ids=[str(i) for i in range(len(BAD_VALUES))])
def test_bad_params_are_rejected_with_a_one_line_error_naming_the_key(raw, fragments):
    with pytest.raises(ParamsError) as err:
        parse_params(raw)
    message = str(err.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_duplicate_keys_empty_files_and_yaml_12_floats(tmp_path):
    with pytest.raises(ParamsError, match=r"line 4: duplicate key 'epochs' \(first at line 3\)"):
        read_yaml("train:\n  update:\n    epochs: 2\n    epochs: 3\n")
    with pytest.raises(ParamsError, match="line 3: duplicate key 'train'"):
        read_yaml("train: {}\nmine: {}\ntrain: {}\n")
    (tmp_path / "params.yaml").write_text("# nothing but a comment\n")
    with pytest.raises(ParamsError, match="is empty"):
        load_params(tmp_path / "params.yaml")
    assert read_yaml("lr: 1e-3\n") == {"lr": 0.001}  # YAML 1.1 would read the string "1e-3"
    with pytest.raises(ParamsError, match="not valid YAML"):
        read_yaml("train: [\n")


def write_project(root: Path, raw: dict, rounds_in_dvc_yaml: int | None = None) -> Path:
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    if rounds_in_dvc_yaml is not None:
        dvc_params = parse_params({"pipeline": {"rounds": rounds_in_dvc_yaml}})
        (root / "dvc.yaml").write_text(render_dvc_yaml(dvc_params, Layout(root)))
    return root


@pytest.mark.parametrize("raw, fragments", BAD_VALUES[:20], ids=[str(i) for i in range(20)])
def test_check_params_exits_2_on_every_bad_value(tmp_path, raw, fragments):
    result = CliRunner().invoke(app, ["check-params", "--root", str(write_project(tmp_path, raw, 5))])
    assert result.exit_code == 2, result.output
    assert fragments[0] in result.output


def test_check_params_refuses_a_dvc_yaml_with_another_round_count_and_prints_yaml(tmp_path):
    project = write_project(tmp_path, {"pipeline": {"rounds": 3}}, rounds_in_dvc_yaml=5)
    result = CliRunner().invoke(app, ["check-params", "--root", str(project)])
    assert result.exit_code == 2 and "pipeline.rounds = 3" in result.output and "arlflow dvc-yaml" in result.output
    write_project(tmp_path, {"pipeline": {"rounds": 3}}, rounds_in_dvc_yaml=3)
    result = CliRunner().invoke(app, ["check-params", "--root", str(project)])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.output) == params_to_dict(parse_params({"pipeline": {"rounds": 3}}))
    defaults = CliRunner().invoke(app, ["check-params", "--defaults"])
    assert defaults.output == params_to_yaml(Params())


def test_cli_exits_2_before_writing_anything(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"train": {"update": {"micro_batch_size": 0}}}))
    before = sorted(p.name for p in tmp_path.iterdir())
    result = subprocess.run([sys.executable, "-m", "flows.cli_main", "stage", "train", "--round", "1",
                             "--root", str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2
    assert "train.update.micro_batch_size = 0" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_use_profile_writes_the_profile_over_the_defaults_and_a_bad_one_changes_nothing(tmp_path):
    """`arlflow use-profile`: params.yaml becomes the defaults with the profile's keys on top, dvc.yaml follows its
    round count, and the replaced params.yaml is kept as params.yaml.bak. A profile with a typo exits 2 naming the
    profile's file and the key, and leaves params.yaml and dvc.yaml as they were."""
    mine = "# my edits\n" + params_to_yaml(parse_params({"pipeline": {"rounds": 2}}))
    (tmp_path / "params.yaml").write_text(mine)
    profile = REPO / "configs" / "frozenlake-4x4-6x6-budget.yaml"
    done = CliRunner().invoke(app, ["use-profile", str(profile), "--root", str(tmp_path)])
    assert done.exit_code == 0, done.output
    written = load_params(tmp_path / "params.yaml")
    assert written == load_params(profile) and written.harness.max_turns == 8 and written.pipeline.rounds == 5
    assert (tmp_path / "params.yaml.bak").read_text() == mine
    assert "round_5" in (tmp_path / "dvc.yaml").read_text()

    bad = tmp_path / "typo.yaml"
    bad.write_text("harness:\n  max_turn: 8\n")
    before = {name: (tmp_path / name).read_text() for name in ("params.yaml", "dvc.yaml", "params.yaml.bak")}
    done = CliRunner().invoke(app, ["use-profile", str(bad), "--root", str(tmp_path)])
    assert done.exit_code == 2
    assert f"{bad}: unknown key(s) ['max_turn'] in harness" in done.output and "Traceback" not in done.output
    assert {name: (tmp_path / name).read_text() for name in before} == before


def test_loading_and_printing_params_imports_no_torch():
    """`arlflow check-params` took 9-10 s: the sections' dataclasses lived in the torch modules they configure, so
    reading params.yaml imported torch and transformers. Registry names (a skill estimator, a loss, an aux loss)
    are checked against the names the registries declare, without importing their functions' modules."""
    heavy = ["torch", "transformers", "tokenizers", "deepspeed", "peft", "great_expectations", "prefect", "mlflow"]
    probe = ("import sys\n"
             "from tasks.config import Params, load_params, params_to_yaml, parse_params\n"
             "params_to_yaml(load_params('params.yaml')); params_to_yaml(Params())\n"
             "parse_params({'train': {'advantage': 'skillc', 'loss': 'vanilla_pg', 'layout': 'concatenated',"
             " 'aux': {'names': ['echo', 'seal']}}})\n"
             f"print([m for m in {heavy!r} if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.parametrize("registry", [ADVANTAGES, LOSSES, AUX_LOSSES], ids=lambda r: r.kind)
def test_each_module_registers_exactly_the_names_declared_for_it(registry):
    """params.yaml is checked against the declared names (models/config.py); a function registered in models/ but
    not declared, or declared but registered elsewhere, would make the check and the lookup disagree."""
    import models.skill_advantages  # noqa: F401  (registers skillc and d2skill)

    assert registry.names() == sorted(registry.builtin)
    assert {name: registry[name].__module__ for name in registry.builtin} == registry.builtin


def test_a_declared_name_is_valid_before_its_module_registers_it():
    registry = Registry("square", builtin={"models.squares": ("plain",)})
    assert "plain" in registry and "cube" not in registry and registry.names() == ["plain"]
    with pytest.raises(KeyError, match="square 'plain' is registered by models.squares: import it"):
        registry["plain"]
    registry.register("plain")(lambda x: x * x)
    assert registry["plain"](3) == 9


def test_the_declared_tiny_architectures_are_those_build_model_makes():
    assert TINY_ARCHITECTURES == tuple(sorted(ARCHITECTURES))
