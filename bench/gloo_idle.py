"""What torch's gloo event loops cost an idle process: `python -m bench.gloo_idle [--groups 9] [--seconds 20]`.

SGLang creates gloo process groups even for one rank (a device and a CPU group per parallel group: 9 in a CPU worker
of SGLang 0.5.23), and each gloo group runs a `gloo_tcp_loop` thread that wakes from epoll_wait every 10 ms. This
process makes the same number of one-rank groups, does nothing for `--seconds`, and prints its own CPU use with its
thread kinds: the floor bench/README's idle section cites, without SGLang. `GLOO_DEVICE_TRANSPORT=UV` may be tried
(torch's Linux wheel refuses it)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from collections import Counter
from pathlib import Path

import psutil
import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=9)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    groups = [dist.new_group([0], backend="gloo") for _ in range(args.groups - 1)]  # + the world group
    dist.all_reduce(torch.ones(1), group=groups[0] if groups else None)
    me = psutil.Process()
    before = me.cpu_times()
    time.sleep(args.seconds)
    after = me.cpu_times()
    used = (after.user + after.system - before.user - before.system) / args.seconds
    kinds = Counter(Path(f"/proc/{os.getpid()}/task/{tid}/comm").read_text().strip()
                    for tid in os.listdir(f"/proc/{os.getpid()}/task"))
    print(json.dumps({"gloo_groups": args.groups, "idle_cores": round(used, 4), "threads": dict(kinds),
                      "torch": torch.__version__}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
