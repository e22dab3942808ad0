"""Parameter-server transports: round-trip latency, and what a dead worker does to the server.

Compares Gloo point-to-point messages (one receiving thread per worker on the server, as
``towers.engines.ps`` does) with ``torch.distributed.rpc`` (TensorPipe). Each client sends a
64-float message and waits for the reply, ``--rounds`` times; the server echoes. With
``--kill``, client 1 kills itself (SIGKILL) a third of the way through and the script reports
how the server noticed.

    python benchmarks/ps_transport.py --clients 1 4
    python benchmarks/ps_transport.py --clients 2 --kill
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

import towers

N = 64


def _client_rounds(rounds: int, kill: bool, exchange) -> float:
    buf = torch.zeros(N)
    began = time.perf_counter()
    for i in range(rounds):
        if kill and int(os.environ["RANK"]) == 1 and i == rounds // 3:
            os.kill(os.getpid(), signal.SIGKILL)
        buf = exchange(buf)
    return (time.perf_counter() - began) / rounds * 1e3


def p2p(rounds: int, kill: bool) -> dict[str, object] | None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    try:
        if rank != 0:

            def exchange(buf: torch.Tensor) -> torch.Tensor:
                dist.send(buf, 0)
                dist.recv(buf, 0)
                return buf

            ms = _client_rounds(rounds, kill, exchange)
            dist.send(torch.full((N,), -1.0), 0)
            return {"ms_per_round_trip": ms}
        inbox: queue.Queue = queue.Queue()

        def receive(src: int) -> None:
            buf = torch.zeros(N)
            try:
                while True:
                    dist.recv(buf, src)
                    inbox.put((src, buf.clone()))
                    if buf[0] < 0:
                        return
            except RuntimeError as exc:
                inbox.put((src, exc))

        for src in range(1, world):
            threading.Thread(target=receive, args=(src,), daemon=True).start()
        live, began, noticed = set(range(1, world)), time.perf_counter(), None
        while live:
            src, msg = inbox.get()
            if isinstance(msg, Exception):
                noticed = f"rank {src}: {str(msg).splitlines()[0][:90]}"
                live.discard(src)
            elif msg[0] < 0:
                live.discard(src)
            else:
                dist.send(msg, src)
        return {"dead_worker": noticed, "server_s": time.perf_counter() - began}
    finally:
        dist.destroy_process_group()


def _echo(t: torch.Tensor) -> torch.Tensor:
    return t


def rpc_bench(rounds: int, kill: bool) -> dict[str, object] | None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    began = time.perf_counter()
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world)
    init_s = time.perf_counter() - began
    out: dict[str, object] = {"init_s": init_s}
    if rank != 0:
        out["ms_per_round_trip"] = _client_rounds(
            rounds, kill, lambda buf: rpc.rpc_sync("w0", _echo, args=(buf,))
        )
    began = time.perf_counter()
    rpc.shutdown()  # graceful: waits for every worker
    out["shutdown_s"] = time.perf_counter() - began
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--kill", action="store_true")
    args = parser.parse_args()
    for clients in args.clients:
        for name, fn in (("gloo p2p", p2p), ("rpc", rpc_bench)):
            try:
                results = towers.spawn(
                    fn, clients + 1, args.rounds, args.kill, timeout=60,
                    failure_grace=20, tolerate=range(1, clients + 1),
                )  # fmt: skip
            except Exception as exc:  # a transport that cannot survive the kill
                print(f"{name:9} clients={clients}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            lat = [r["ms_per_round_trip"] for r in results[1:] if r is not None]
            mean = sum(lat) / len(lat) if lat else float("nan")
            agg = mean / clients
            print(
                f"{name:9} clients={clients}: {mean:.3f} ms per round trip per client, "
                f"{agg:.3f} ms per message at the server; server: {results[0]}",
                flush=True,
            )


if __name__ == "__main__":
    main()
