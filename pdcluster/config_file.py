"""Load a component's YAML config into its pydantic model; a bad file is one line on stderr and exit status 2."""

from __future__ import annotations

import sys
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)


def load_model(model: type[Model], path: str | None, overrides: dict[str, Any], prog: str) -> Model:
    try:
        data: dict[str, Any] = {}
        if path:
            with open(path, encoding="utf-8") as handle:
                data = yaml.safe_load(handle) or {}
            if not isinstance(data, dict):
                raise ValueError(f"{path} must hold a mapping")
        data.update({key: value for key, value in overrides.items() if value is not None})
        return model.model_validate(data)
    except ValidationError as exc:
        problem = exc.errors()[0]
        field = ".".join(str(part) for part in problem["loc"])
        _fail(prog, f"{path or 'config'}: {field}: {problem['msg']}")
    except (OSError, ValueError, yaml.YAMLError) as exc:
        _fail(prog, str(exc).splitlines()[0])


def _fail(prog: str, message: str):
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)
