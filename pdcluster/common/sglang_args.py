"""SGLang's own command-line parser, its errors as ConfigError (one line from the CLI, not argparse's usage and exit):
how the worker launcher checks the SGLang options of a config (pdcluster/worker/options.py), and how the KV store's
launch step reads back the options SGLang will get (pdcluster/kvstore/launch.py)."""

from __future__ import annotations

import argparse

from pdcluster.common.config_file import ConfigError

# Each SGLang worker picks the port of its scheduler's TCPStore (PortArgs' nccl_port) at random in 22000-29999, below
# the kernel's ephemeral range (sglang.srt.utils.network.get_free_port_below_ephemeral), and binds it only once its
# scheduler starts: a port of ours in this range can be taken by a worker that started before it on the same host.
SGLANG_RANDOM_PORTS = range(22000, 30000)


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit; we want one line from the CLI.
        raise ConfigError(message)


def sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs  # heavy import: only when a worker is really configured

    parser = _RaisingParser(prog="sglang", add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser
