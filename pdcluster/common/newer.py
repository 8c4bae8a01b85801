"""Reading a message that a newer pdcluster may have sent (a rolling upgrade): the fields this version does not know
are dropped and named, the rest checked as strictly as ever. Apart from the messages themselves
(pdcluster/common/protocol.py, which re-exports `from_newer`), so that the contract there has room to grow."""

from __future__ import annotations

import types
from typing import Any, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The message models a field holds: itself, or inside a list or an optional."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) in (list, Union, types.UnionType):
        return [m for arg in get_args(annotation) for m in _models_in(arg)]
    return []


def _known(model: type[BaseModel], data: Any, where: str, dropped: list[str]) -> Any:
    if not isinstance(data, dict):
        return data
    kept = {}
    renamed: dict[str, str] = getattr(model, "RENAMED", {})
    for key, value in data.items():
        field = model.model_fields.get(renamed.get(key) or key)
        if field is None:
            dropped.append(f"{where}{key}")
            continue
        for inner in _models_in(field.annotation):  # one level of message nesting per model (no unions of models)
            value = ([_known(inner, v, f"{where}{key}[].", dropped) for v in value] if isinstance(value, list)
                     else _known(inner, value, f"{where}{key}.", dropped))
        kept[key] = value
    return kept


def from_newer(model: type[M], data: Any) -> tuple[M, list[str]]:
    """Validate a message that a newer version of pdcluster may have sent: the fields this version does not know
    are dropped (and returned, for a log line); everything it knows is checked as strictly as by model_validate.
    So the bootstrap service, the router and the launchers can be upgraded in any order."""
    dropped: list[str] = []
    return model.model_validate(_known(model, data, "", dropped)), sorted(set(dropped))
