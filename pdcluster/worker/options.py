"""SGLang options from a worker's config file and command line, validated by SGLang's own argument parser
(pdcluster/common/sglang_args.py).

The YAML uses the keys `sglang.launch_server --config` accepts (long flag names without `--`), so every SGLang option
works unchanged. Options are kept as argv tokens grouped by destination: a later source (command line over file over
profile) replaces an earlier one for the same destination, and the final argv is what SGLang itself would parse.
"""

from __future__ import annotations

import argparse
import difflib
import json
from dataclasses import dataclass, field
from typing import Any

from pdcluster.common.config_file import ConfigError


@dataclass
class SGLangOptions:
    """Ordered SGLang options: destination -> the argv tokens that set it."""

    parser: argparse.ArgumentParser
    tokens: dict[str, list[str]] = field(default_factory=dict)
    _by_flag: dict[str, argparse.Action] = field(init=False)

    def __post_init__(self) -> None:
        self._by_flag = {
            flag: action
            for action in self.parser._actions
            for flag in action.option_strings
            if flag.startswith("--") and flag not in ("--config", "--help")
        }

    # --- lookup ---------------------------------------------------------------------------------------------
    def action_for(self, name: str) -> argparse.Action:
        flag = "--" + name.lstrip("-").replace("_", "-")
        action = self._by_flag.get(flag)
        if action is None:
            close = difflib.get_close_matches(flag, self._by_flag, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"unknown SGLang option {flag}{hint}")
        return action

    def is_set(self, dest: str) -> bool:
        return dest in self.tokens

    # --- sources --------------------------------------------------------------------------------------------
    def set_value(self, name: str, value: Any) -> None:
        """Set an option from a YAML-style value (the conversion SGLang's own --config uses)."""
        action = self.action_for(name)
        flag = _long_flag(action)
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise ConfigError(f"{flag} is a switch: use true or false, not {value!r}")
            self.tokens[action.dest] = [flag] if value else []
        elif isinstance(value, bool):
            self.tokens[action.dest] = [flag, str(value).lower()]
        elif isinstance(value, list):
            self.tokens[action.dest] = [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            self.tokens[action.dest] = [flag, json.dumps(value)]
        elif value is None:
            self.tokens.pop(action.dest, None)
        else:
            self.tokens[action.dest] = [flag, str(value)]

    def set_default(self, name: str, value: Any) -> None:
        """Set an option only when no source set it: how role and CPU profiles apply without overriding the user."""
        if not self.is_set(self.action_for(name).dest):
            self.set_value(name, value)

    def apply_argv(self, argv: list[str]) -> None:
        """Command-line overrides in SGLang's own syntax: `--key value`, `--key=value`, `--switch`."""
        i = 0
        while i < len(argv):
            token = argv[i]
            if not token.startswith("--"):
                raise ConfigError(f"unexpected argument {token!r}: options look like --name value")
            name, eq, inline = token.partition("=")
            action = self.action_for(name)
            values = [inline] if eq else []
            i += 1
            if not eq:
                while i < len(argv) and not argv[i].startswith("--"):
                    values.append(argv[i])
                    i += 1
            self.tokens[action.dest] = [_long_flag(action), *values]

    # --- results --------------------------------------------------------------------------------------------
    def argv(self) -> list[str]:
        return [token for group in self.tokens.values() for token in group]

    def parse(self) -> argparse.Namespace:
        """Everything SGLang will see, typed and checked by SGLang's parser (choices, types, arity)."""
        return self.parser.parse_args(self.argv())


def _long_flag(action: argparse.Action) -> str:
    return next(flag for flag in action.option_strings if flag.startswith("--"))
