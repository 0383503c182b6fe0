"""Typed readers for environment variables that fail loudly on bad values."""

import os
from pathlib import Path
from typing import overload


class ConfigError(RuntimeError):
    """A setting from the environment is missing or malformed."""


@overload
def env_str(name: str, default: str) -> str: ...
@overload
def env_str(name: str, default: None = None) -> str | None: ...
def env_str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value


def env_required(name: str) -> str:
    value = env_str(name)
    if value is None:
        raise ConfigError(f"{name} must be set")
    return value


def env_int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    raw = env_str(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name} must be <= {maximum}, got {value}")
    return value


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    raw = env_str(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_bool(name: str, default: bool) -> bool:
    raw = env_str(name)
    if raw is None:
        return default
    lowered = raw.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(f"{name} must be a boolean (true/false), got {raw!r}")


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = env_str(name, default)
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def env_list(name: str, default: list[str]) -> list[str]:
    raw = env_str(name)
    if raw is None:
        return list(default)
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_map(name: str) -> dict[str, str]:
    """`key:value,key:value` as a dict; an item without both sides is an error, not skipped
    (a mapping that silently loses an entry sends its users elsewhere)."""
    mapping = {}
    for item in env_list(name, []):
        key, sep, value = item.partition(":")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(f"{name} must look like key:value,key:value; {item!r} has no key:value")
        mapping[key.strip()] = value.strip()
    return mapping


def env_path(name: str, default: Path) -> Path:
    raw = env_str(name)
    return Path(raw).expanduser().resolve() if raw else default


_WINDOWS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}


def env_rate(name: str, default: str) -> tuple[int, int]:
    """`N/unit` (unit: second, minute, hour, day) as (limit, window seconds). `0` disables."""
    raw = (env_str(name) or default).strip().lower()
    if raw in ("0", "off"):
        return 0, 60
    count, _, unit = raw.partition("/")
    try:
        limit = int(count)
    except ValueError:
        raise ConfigError(f"{name} must look like 60/minute or 0, got {raw!r}") from None
    if unit not in _WINDOWS or limit < 0:
        raise ConfigError(f"{name} must look like 60/minute (units: {', '.join(_WINDOWS)}), got {raw!r}")
    return limit, _WINDOWS[unit]
