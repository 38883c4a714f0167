"""Loading a :class:`~components.config.SpeclineConfig`: schema defaults ← ``conf/<name>.yaml``
← ``key=value`` overrides, checked against the schema (OmegaConf), and turning one back into a
dict, YAML or flat ``a.b`` keys for logging.

Unknown keys and wrong types are a :class:`~components.config.ConfigError` naming the key and
the file (or the command line) it came from. omegaconf and yaml are imported here only, when a
config is loaded. Knows the schema and OmegaConf; nothing about stages, models or MLflow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from components.config import CONF_DIR, ConfigError, SpeclineConfig

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from omegaconf.errors import OmegaConfBaseException


def available_confs(conf_dir: Path = CONF_DIR) -> list[str]:
    """Names of the YAML files in the conf directory."""
    return sorted(p.name for p in conf_dir.glob("*.yaml"))


def resolve_conf_path(conf: str | Path) -> Path:
    """A conf name (``dspark.yaml``, ``dspark``) or path → an existing file, or ConfigError."""
    raw = Path(conf).expanduser()
    candidates = [raw, CONF_DIR / raw]
    if raw.suffix not in (".yaml", ".yml"):
        candidates += [raw.with_suffix(".yaml"), CONF_DIR / raw.with_suffix(".yaml").name]
    for path in candidates:
        if path.is_file():
            return path.resolve()
    raise ConfigError(
        f"conf file '{conf}' not found (looked in . and {CONF_DIR}); "
        f"available: {', '.join(available_confs()) or 'none'}"
    )


def _explain(err: OmegaConfBaseException, origin: str) -> ConfigError:
    from omegaconf.errors import ConfigKeyError, ValidationError

    key = getattr(err, "full_key", None) or "?"
    if isinstance(err, ConfigKeyError):
        return ConfigError(f"{origin}: unknown key '{key}' (check the spelling; see components/config.py)")
    if isinstance(err, ValidationError):
        value = getattr(err, "value", None)
        return ConfigError(f"{origin}: key '{key}' has a wrong type or value ({value!r}): {str(err.msg).splitlines()[0]}")
    return ConfigError(f"{origin}: {err}")


def _merge(base: DictConfig, layer: DictConfig, origin: str) -> DictConfig:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.merge(base, layer)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        raise _explain(err, origin) from None


def parse_overrides(overrides: Sequence[str]) -> DictConfig:
    """``["train.lr=3e-4", ...]`` → a DictConfig; a malformed item names itself."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"command line: '{item}' is not a key=value override")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as err:
        raise ConfigError(f"command line: cannot parse overrides {list(overrides)}: {err}") from None


def load(conf: str | Path | None = None, overrides: Sequence[str] = ()) -> SpeclineConfig:
    """Schema defaults ← conf YAML ← overrides, checked against the schema."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    merged: DictConfig = OmegaConf.structured(SpeclineConfig)
    if conf is not None:
        path = resolve_conf_path(conf)
        try:
            file_cfg = OmegaConf.load(path)
        except (OSError, yaml.YAMLError) as err:  # yaml errors carry line numbers in their text
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        merged = _merge(merged, file_cfg, str(path))
    merged = _merge(merged, parse_overrides(overrides), "command line")
    try:
        OmegaConf.resolve(merged)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise _explain(err, str(conf or "defaults")) from None
    assert isinstance(cfg, SpeclineConfig)
    return cfg


def parse_cli(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Split ``conf=x.yaml a.b=c`` into the conf name and the remaining overrides."""
    conf, rest = None, []
    for arg in argv:
        if arg.startswith("conf="):
            conf = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return conf, rest


def load_cli(argv: Sequence[str]) -> SpeclineConfig:
    conf, overrides = parse_cli(argv)
    return load(conf, overrides)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain nested dict of a config dataclass (for logging)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Any) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} → {"a.b": 1}; lists stay values."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out
