"""The two processes of bench.kv_handoff: a "decode" that owns the destination KV pool and a "prefill" that writes
into it, each with its own Mooncake TransferEngine set up as SGLang's MooncakeTransferEngine does
(`initialize(host, "P2PHANDSHAKE", "tcp", "")`, `batch_register_memory` of every per-layer K and V tensor). The
same prefill also sends the same blocks over one plain loopback TCP socket (sendall per block; the decode
recv_into's each block where it belongs and answers one byte when a whole prompt has landed). Each process applies
its configuration's environment (MC_* knobs) before it imports Mooncake: the engine reads them once."""

from __future__ import annotations

import ctypes
import os
import socket
import statistics
import time
import zlib

HOST = "127.0.0.1"


def _engine(env: dict):
    os.environ.update(env)
    from mooncake.engine import TransferEngine

    t0 = time.perf_counter()
    engine = TransferEngine()
    if engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("TransferEngine.initialize failed")
    return engine, time.perf_counter() - t0


def _pool(engine, tensors: int, nbytes: int, fill) -> tuple[list, list[int], float]:
    """Per-layer K and V tensors (K of every layer, then V), every page touched; registered in one batch."""
    import numpy as np

    bufs = []
    for i in range(tensors):
        buf = np.empty(nbytes, dtype=np.uint8)
        buf[:] = fill(i)
        bufs.append(buf)
    ptrs = [b.ctypes.data for b in bufs]
    t0 = time.perf_counter()
    if engine.batch_register_memory(ptrs, [nbytes] * tensors) != 0:
        raise RuntimeError("batch_register_memory failed")
    return bufs, ptrs, time.perf_counter() - t0


def _view(addr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_ubyte * n).from_address(addr)).cast("B")


def _digest(blocks) -> int:
    crc = 0
    for addr, n in blocks:
        crc = zlib.crc32(_view(addr, n), crc)
    return crc


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def decode(conn, env: dict, tensors: int, nbytes: int) -> None:
    engine, init_s = _engine(env)
    _bufs, ptrs, register_s = _pool(engine, tensors, nbytes, lambda i: 0)  # held: the registered memory
    server = socket.create_server((HOST, 0))
    conn.send({"session": f"{HOST}:{engine.get_rpc_port()}", "ptrs": ptrs, "pid": os.getpid(), "init_s": init_s,
               "register_s": register_s, "threads": _threads(), "sock_port": server.getsockname()[1]})
    sock, _ = server.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        op, *args = conn.recv()
        if op == "zero":
            for addr, n in args[0]:
                ctypes.memset(addr, 0, n)
            conn.send(None)
        elif op == "digest":
            conn.send(_digest(args[0]))
        elif op == "sock_recv":
            blocks, repeats = args
            views = [_view(addr, n) for addr, n in blocks]
            conn.send(None)
            for _ in range(repeats):
                for view in views:
                    got = 0
                    while got < len(view):
                        got += sock.recv_into(view[got:])
                sock.sendall(b"k")
        elif op == "stop":
            conn.send(None)
            return


def _stats(times: list[float], nbytes: int) -> dict:
    steady = sorted(times[1:])  # the first of each size is kept apart: a warm-up
    median = statistics.median(steady)
    p90 = steady[max(0, -(-9 * len(steady) // 10) - 1)]
    return {"first_s": round(times[0], 5), "median_s": round(median, 5), "p90_s": round(p90, 5),
            "gb_per_s": round(nbytes / median / 1e9, 3), "runs_s": [round(t, 5) for t in times[1:]]}


def _cpu_of(proc) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _mooncake(engine, session: str, args: list) -> dict | None:
    """One prompt: every batch, as SGLang sends them; None, or the failure (SGLang would fail the request)."""
    t0 = time.perf_counter()
    for srcs, dsts, lens in args:
        ret = engine.batch_transfer_sync_write(session, srcs, dsts, lens)
        if ret != 0:  # e.g. more transfers in one batch than the peer's queue admits
            return {"error": ret, "failed_after_s": round(time.perf_counter() - t0, 4)}
    return None


def prefill(conn, out, env: dict, tensors: int, nbytes: int, item: int, cells: list[dict], repeats: int,
            max_batch_pages: int) -> None:
    import psutil

    from bench.kv_handoff.plan import page_indices, plan

    engine, init_s = _engine(env)
    _bufs, src_ptrs, register_s = _pool(engine, tensors, nbytes, lambda i: (i * 7 + 1) % 251)
    peer = conn.recv()
    session, dst_ptrs, pool_pages = peer["session"], peer["ptrs"], nbytes // item
    decode_proc = psutil.Process(peer["pid"])

    def call(op, *args):
        conn.send((op, *args))
        return conn.recv()

    t0 = time.perf_counter()  # first contact: one page, which makes the engine's P2P handshake with the peer
    if engine.batch_transfer_sync_write(session, [src_ptrs[0]], [dst_ptrs[0]], [item]) != 0:
        raise RuntimeError("first transfer failed")
    first_s = time.perf_counter() - t0
    page_runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.batch_transfer_sync_write(session, [src_ptrs[0]], [dst_ptrs[0]], [item])
        page_runs.append(time.perf_counter() - t0)
    mc_conns = sum(1 for c in psutil.Process().net_connections("tcp") if c.status == "ESTABLISHED")
    sock = socket.create_connection((HOST, peer["sock_port"]))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    result = {"env": env, "max_batch_pages": max_batch_pages, "cells": [],
              "prefill": {"init_s": round(init_s, 4), "register_s": round(register_s, 4), "threads": _threads(),
                          "tcp_connections_after_first_contact": mc_conns,
                          "first_contact_one_page_s": round(first_s, 5),
                          "one_page_steady_median_s": round(statistics.median(page_runs), 6)},
              "decode": {k: peer[k] for k in ("init_s", "register_s", "threads")}}
    for spec in cells:
        sp, dp = page_indices(spec["pages"], pool_pages, spec["layout"], seed=spec["tokens"])
        t0 = time.perf_counter()
        batches = plan(src_ptrs, dst_ptrs, item, sp, dp, max_batch_pages)
        plan_s = time.perf_counter() - t0
        blocks = [b for batch in batches for b in batch]
        args = [([s for s, _, _ in b], [d for _, d, _ in b], [n for _, _, n in b]) for b in batches]
        total = sum(n for _, _, n in blocks)
        dst_blocks, src_blocks = [(d, n) for _, d, n in blocks], [(s, n) for s, _, n in blocks]
        want = _digest(src_blocks)
        cell = {**spec, "bytes": total, "transfers": len(blocks), "batches": len(batches), "plan_s": round(plan_s, 5)}
        # Mooncake alone first: its warm-up run, landing checked. Then the two transports take turns run by run, so
        # that both see the same background load (this machine is shared); the decode sits in its socket loop
        # meanwhile, which Mooncake's one-sided writes do not need.
        call("zero", dst_blocks)
        t0, failed = time.perf_counter(), _mooncake(engine, session, args)
        first_s = time.perf_counter() - t0
        mc_ok = call("digest", dst_blocks) == want
        views = [_view(s, n) for s, n in src_blocks]
        runs = {"mooncake": [first_s], "socket": []}
        cpu = {t: [0.0, 0.0] for t in runs}  # prefill, decode CPU seconds over the steady runs
        call("sock_recv", dst_blocks, repeats + 1)
        for i in range(repeats + 1):
            for transport in ("socket", "mooncake"):
                if transport == "mooncake" and (failed or i == repeats):
                    continue
                c0, d0, t0 = _cpu(), _cpu_of(decode_proc), time.perf_counter()
                if transport == "mooncake":
                    failed = _mooncake(engine, session, args)
                else:
                    for view in views:
                        sock.sendall(view)
                    sock.recv(1)
                runs[transport].append(time.perf_counter() - t0)
                if i or transport == "mooncake":  # the socket's first run is its warm-up
                    cpu[transport][0] += _cpu() - c0
                    cpu[transport][1] += _cpu_of(decode_proc) - d0
        verified = call("digest", dst_blocks) == want  # the socket wrote last
        for transport, times in runs.items():
            if transport == "mooncake" and failed:
                cell[transport] = {**failed, "verified": False}
                continue
            stats = _stats(times, total)
            stats["prefill_cpu_s_per_run"] = round(cpu[transport][0] / repeats, 5)
            stats["decode_cpu_s_per_run"] = round(cpu[transport][1] / repeats, 5)
            stats["verified"] = mc_ok if transport == "mooncake" else verified
            cell[transport] = stats
        ok = "median_s" in cell["mooncake"]
        cell["ratio_mooncake_over_socket"] = (round(cell["mooncake"]["median_s"] / cell["socket"]["median_s"], 3)
                                              if ok else None)
        result["cells"].append(cell)
        mc = f"{cell['mooncake']['median_s'] * 1e3:7.1f} ms" if ok else f"FAILED ({cell['mooncake']['error']})"
        print(f"  {spec['layout']:10} {spec['tokens']:5} tokens {len(blocks):5} transfers: mooncake {mc}, "
              f"socket {cell['socket']['median_s'] * 1e3:7.1f} ms, x{cell['ratio_mooncake_over_socket']}", flush=True)
    # Mooncake opens its lanes (TCP connections per peer) as work needs them: count them once all is sent.
    result["prefill"]["tcp_connections_to_decode_at_end"] = sum(
        1 for c in psutil.Process().net_connections("tcp") if c.status == "ESTABLISHED") - 1  # minus the socket's
    call("stop")
    out.send(result)
