"""SGLang's own command-line parser, its errors as ConfigError (one line from the CLI, not argparse's usage and exit):
how the worker launcher checks the SGLang options of a config (pdcluster/worker/options.py), and how the KV store's
launch step reads back the options SGLang will get (pdcluster/kvstore/launch.py)."""

from __future__ import annotations

import argparse

from pdcluster.common.config_file import ConfigError


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit; we want one line from the CLI.
        raise ConfigError(message)


def sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs  # heavy import: only when a worker is really configured

    parser = _RaisingParser(prog="sglang", add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser
