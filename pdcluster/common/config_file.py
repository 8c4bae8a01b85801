"""What every component's configuration goes through: its YAML file, pydantic's verdict on it, secrets it may leave to
the environment. A bad config is one line naming the file and the setting, never a traceback."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

if TYPE_CHECKING:  # the type only: workers import this module, and need no FastAPI
    from fastapi.exceptions import RequestValidationError

Model = TypeVar("Model", bound=BaseModel)

# Parts of an error location that name what pydantic tried, not a field: a union member ("SamplingParams",
# "list[str]", "int"), or FastAPI's "body" in front of a request's fields. Users know only field names.
_NOT_A_FIELD = re.compile(r"^[A-Z]|\[|^[a-z]+-[a-z-]+$|^(str|int|float|bool|body|nullable)$")


class ConfigError(Exception):
    """A configuration problem reported to the user as one line; the command exits with status 2."""


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A config file's top-level mapping (empty for an empty file)."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of names to values, not a {type(data).__name__}")
    return data


def first_problem(exc: ValidationError | RequestValidationError) -> tuple[str, str]:
    """(dotted field path, message) of the first problem pydantic found; the path is empty for the model as a whole.
    `exc`: pydantic's ValidationError, or FastAPI's RequestValidationError for a request body
    (pdcluster/common/http.py)."""
    problem = exc.errors()[0]
    return field_path(problem.get("loc", ())), problem.get("msg", "invalid value")


def field_path(loc: tuple) -> str:
    """`a.b[2].c` from a pydantic error location, without the parts that name what pydantic tried."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _NOT_A_FIELD.search(str(part)):
            path += f".{part}" if path else str(part)
    return path


def validation_message(exc: ValidationError, where: str = "", section: str = "") -> str:
    """`where: section.field: message`, the one line a config's first problem is reported as (`where`: the file)."""
    field, message = first_problem(exc)
    return ": ".join(part for part in (where, ".".join(filter(None, (section, field))), message) if part)


def secret_or_env(configured: str | None, env_var: str) -> str | None:
    """A secret from the config, else from the environment variable `env_var`; None when neither sets one (an empty
    string counts as unset). Secrets are resolved when used, never stored in the model, so --dry-run never prints one
    that came from the environment."""
    return configured or os.environ.get(env_var) or None


def load_model(model: type[Model], path: str | Path | None, overrides: dict[str, Any], prog: str,
               context: dict[str, Any] | None = None) -> Model:
    """A component's config: its YAML file (none: every default) with the command line's non-None `overrides` on
    top, validated by `model` (given `context`: what its validators need of the component, the router's policy
    names). On a problem: `<prog>: error: <one line>` on stderr and exit status 2."""
    try:
        data = load_yaml(path) if path else {}
        data.update({key: value for key, value in overrides.items() if value is not None})
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        fail(prog, validation_message(exc, str(path or "config")))
    except ConfigError as exc:
        fail(prog, str(exc))


def fail(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)
