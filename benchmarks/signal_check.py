"""Benchmark: what Ray's signal check costs a worker that trains in a thread other than its main one.

A Ray worker's main thread runs Ray's event loop; for an actor with concurrency groups (this
package's workers: the driver's polls are answered while a call runs) every call runs in another
thread, and the main thread wakes every 10 ms to check for signals (Ray's
``CoreWorker.CheckSignal``, which takes the GIL). A plain actor runs its calls in the main thread,
where the check waits for the call to end. Two actors on one embedded Ray do the same CPU work
(a small MLP's forward and backward, one torch thread), one after the other, 30 times each; the
other core is kept busy by a process that spins, at Ray workers' niceness (15, as the other rank
of a fit) or at 0 (another program). Medians of the pairs' ratios (other thread / main thread).

    python benchmarks/signal_check.py [--pairs 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


class Work:
    def setup(self) -> int:
        import torch

        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)])
        self.x = torch.randn(128, 512)
        return os.getpid()

    def work(self, steps: int = 40) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            self.net(self.x).square().mean().backward()
            for p in self.net.parameters():
                p.grad = None
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=30)
    args = parser.parse_args()
    import ray

    from ray_lightning_sgd import _compat

    _compat.bind_local_ray_to_loopback()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    main_thread = ray.remote(num_cpus=1)(Work).remote()
    other_thread = ray.remote(num_cpus=1, concurrency_groups={"poll": 1})(Work).remote()
    ray.get([main_thread.setup.remote(), other_thread.setup.remote()])
    print(f"# {args.pairs} pairs each; ratio: the other thread's time / the main thread's\n")
    print("| the other core | main thread ms | other thread ms | ratio (median of pairs) |")
    print("|---|---|---|---|")
    for niceness in (15, 0, 15, 0):
        spinner = subprocess.Popen(
            ["nice", "-n", str(niceness), sys.executable, "-c", "while True: pass"]
        )
        try:
            for _ in range(3):  # warm-up
                ray.get([main_thread.work.remote(), other_thread.work.remote()])
            pairs = []
            for _ in range(args.pairs):
                a = ray.get(main_thread.work.remote())
                b = ray.get(other_thread.work.remote())
                pairs.append((a, b))
        finally:
            spinner.kill()
            spinner.wait()
        print(
            f"| spinning at niceness {niceness} "
            f"| {statistics.median(a for a, _ in pairs) * 1000:.0f} "
            f"| {statistics.median(b for _, b in pairs) * 1000:.0f} "
            f"| {statistics.median(b / a for a, b in pairs):.3f}x |",
            flush=True,
        )
    ray.shutdown()


if __name__ == "__main__":
    main()
