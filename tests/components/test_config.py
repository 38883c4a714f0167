from pathlib import Path

import pytest

from components.config import ConfigError, SpeclineConfig
from components.confload import available_confs, flatten, load, load_cli, parse_cli, to_dict


def test_defaults_and_default_conf_load():
    assert isinstance(load(), SpeclineConfig)
    cfg = load("dspark.yaml")
    assert cfg.target.name_or_path == "embedded"
    assert cfg.drafter.name == "dspark"
    assert "dspark.yaml" in available_confs()


def test_overrides_are_typed_and_win_over_the_file():
    cfg = load("dspark.yaml", ["train.lr=1e-3", "target.tiny.num_layers=3", "stages=[target]"])
    assert cfg.train.lr == pytest.approx(1e-3) and isinstance(cfg.train.lr, float)
    assert cfg.target.tiny.num_layers == 3
    assert cfg.stages == ["target"]


def test_cli_parsing_splits_conf_from_overrides():
    assert parse_cli(["conf=dspark.yaml", "a.b=1"]) == ("dspark.yaml", ["a.b=1"])
    cfg = load_cli(["conf=dspark", "seed=7"])
    assert cfg.seed == 7


def test_interpolation_of_run_dir():
    cfg = load(None, ["run_dir=/tmp/xyz"])
    assert cfg.data.output_dir == "/tmp/xyz/data"


def test_unknown_key_on_command_line_names_the_key():
    with pytest.raises(ConfigError, match=r"command line: unknown key 'train.lrr'"):
        load("dspark.yaml", ["train.lrr=1"])


def test_unknown_key_in_file_names_key_and_file(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochs: 2\n  optimiser: adam\n")
    with pytest.raises(ConfigError) as err:
        load(bad)
    assert "train.optimiser" in str(err.value) and str(bad) in str(err.value)


def test_wrong_type_in_file_names_key_and_value(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("serve:\n  port: eighty\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: key 'serve.port' has a wrong type or value \('eighty'\)"):
        load(bad)


def test_missing_conf_lists_available():
    with pytest.raises(ConfigError, match=r"'nope.yaml' not found.*available: .*dspark.yaml"):
        load("nope.yaml")


def test_invalid_yaml_and_malformed_override(tmp_path: Path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load(bad)
    with pytest.raises(ConfigError, match="'train.lr' is not a key=value override"):
        load(None, ["train.lr"])


def test_flatten_for_logging():
    flat = flatten(to_dict(load()))
    assert flat["target.tiny.hidden_size"] == 256
    assert all("." in k or k in ("run_dir", "seed", "stages", "force", "log_level") for k in flat)
