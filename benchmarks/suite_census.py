"""Where the test suite's time goes: a pytest plugin, for developers (Linux only).

    PYTHONPATH=benchmarks python -m pytest -p suite_census [pytest arguments]

At the end it writes ``suite_census.txt`` (or the path in ``SUITE_CENSUS_OUT``) with, per test
file and for the slowest tests: wall seconds, the machine's idle core-seconds while they ran
(from /proc/stat: the time the tests spent waiting, not computing), the worker groups the driver's
pool started and why it could not reuse the idle one, and the Python processes that appeared (Ray's
workers, drivers in subprocesses) with the CPU seconds they used. A process is sampled every 0.2 s:
one that lived less than that is missed, and a process's last fraction of a second is not counted.
A process's CPU seconds all count for the test during which it appeared (a warm worker's later
calls included), and idle core-seconds are the machine's: run it with nothing else running.

What it showed (2026-12-06, the README's newest environment, 2 cores, the whole suite serially in
about 12 minutes): the machine was idle a third of the time (the waits of fault, hang and node
tests); 330 new Python processes used 900 CPU-seconds, 650 of them in about 170 worker processes
of our groups, each of which imports torch and Lightning (about 4 CPU-seconds) before its first
step; the driver's pool started 67 groups, most of them after a test that killed or failed its
workers, or for settings that a test is about. After the reordering of that day, 64 (the plugin's
own output for the whole suite, 910 s on 2026-12-06 at 04:27: ``suite_census_last_run.txt``).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from typing import Any

import pytest

from ray_lightning_sgd._executor import pool
from ray_lightning_sgd._executor.executor import BackendExecutor

_TICK = os.sysconf("SC_CLK_TCK")
_ME = os.getpid()
_current = {"test": "(collection)"}
_procs: dict[int, dict[str, Any]] = {}
#: Processes that were running when the session began (a CI harness, say): never counted.
_before: set[int] = set()
_rows: list[dict[str, Any]] = []
_starts: list[dict[str, Any]] = []


def _idle_core_s() -> float:
    with open("/proc/stat") as stat:
        fields = stat.readline().split()
    return (int(fields[4]) + int(fields[5])) / _TICK  # idle + iowait, all cores


def _sample() -> None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == _ME:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                command = file.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{entry}/stat") as file:
                stat = file.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        cpu = (int(stat[11]) + int(stat[12])) / _TICK
        pid = int(entry)
        if pid in _before:
            continue
        known = _procs.get(pid)
        if known is None:
            if "python" not in command and not command.startswith("ray::"):
                continue
            _procs[pid] = {"kind": _kind(command), "cpu": cpu, "test": _current["test"]}
        else:
            known["cpu"] = cpu
            if command.startswith("ray::"):  # an idle worker takes its actor's name
                known["kind"] = _kind(command)


def _kind(command: str) -> str:
    if command.startswith("ray::"):
        return command.split()[0].split("(")[0]
    return command[:60]


def _sampler() -> None:
    while True:
        _sample()
        time.sleep(0.2)


def _differences(a: Any, b: Any) -> list[str]:
    if type(a) is not type(b):
        return [f"class ({type(a).__name__}, not {type(b).__name__})"]
    return [
        f.name
        for f in dataclasses.fields(a)
        if f.compare and getattr(a, f.name) != getattr(b, f.name)
    ]


_find_or_start = pool._find_or_start


def _counted_find_or_start(backend_config, worker_group_config, reuse):
    with pool._lock:
        idle = [(i.backend_config, i.worker_group_config) for i in pool._idle]
    executor, warm = _find_or_start(backend_config, worker_group_config, reuse)
    if not isinstance(executor, BackendExecutor):  # a pure test's fake: no group started
        return executor, warm
    if not warm:
        why = [] if reuse else ["reuse_workers=False"]
        if not idle:
            why.append("no idle group")
        for backend, group in idle:
            differs = _differences(backend, backend_config) + _differences(
                group, worker_group_config
            )
            why.append(
                "idle group differs in " + ", ".join(differs)
                if differs
                else "idle group not usable"
            )
        _starts.append(
            {"test": _current["test"], "workers": worker_group_config.num_workers, "why": why}
        )
    return executor, warm


def pytest_configure(config: pytest.Config) -> None:
    _before.update(int(entry) for entry in os.listdir("/proc") if entry.isdigit())
    pool._find_or_start = _counted_find_or_start
    threading.Thread(target=_sampler, daemon=True, name="suite-census").start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _current["test"] = item.nodeid
    started, idle = time.monotonic(), _idle_core_s()
    yield
    _rows.append(
        {"test": item.nodeid, "wall": time.monotonic() - started, "idle": _idle_core_s() - idle}
    )


def pytest_sessionfinish(session: pytest.Session) -> None:
    _sample()
    by_file: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0, 0, 0.0])
    for row in _rows:
        totals = by_file[row["test"].split("::")[0]]
        totals[0] += row["wall"]
        totals[1] += row["idle"]
    for start in _starts:
        by_file[start["test"].split("::")[0]][2] += 1
    for process in _procs.values():
        totals = by_file[process["test"].split("::")[0]]
        totals[3] += 1
        totals[4] += process["cpu"]
    wall = sum(r["wall"] for r in _rows)
    idle = sum(r["idle"] for r in _rows)
    cores = os.cpu_count() or 1
    lines = [
        f"tests {len(_rows)}, wall {wall:.0f} s, idle {idle:.0f} core-s "
        f"({idle / (cores * wall or 1):.0%} of {cores} cores), group starts {len(_starts)}, "
        f"new Python processes {len(_procs)} using {sum(p['cpu'] for p in _procs.values()):.0f} CPU-s",
        "",
        "| file | wall s | idle core-s | group starts | new processes | their CPU-s |",
        "|---|---|---|---|---|---|",
    ]
    for name, (w, i, s, n, c) in sorted(by_file.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {name} | {w:.1f} | {i:.1f} | {s} | {n} | {c:.1f} |")
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for process in _procs.values():
        kinds[process["kind"]][0] += 1
        kinds[process["kind"]][1] += process["cpu"]
    lines += ["", "| process | count | CPU-s |", "|---|---|---|"]
    for kind, (n, c) in sorted(kinds.items(), key=lambda kv: -kv[1][1])[:15]:
        lines.append(f"| {kind} | {n:.0f} | {c:.1f} |")
    lines += ["", "Slowest tests: wall s, idle core-s", ""]
    for row in sorted(_rows, key=lambda r: -r["wall"])[:25]:
        lines.append(f"{row['wall']:6.1f} {row['idle']:6.1f}  {row['test']}")
    lines += ["", "Group starts, in order: workers, why the idle group was not reused, test", ""]
    for start in _starts:
        lines.append(f"{start['workers']}  {'; '.join(start['why'])}  {start['test']}")
    out = os.environ.get("SUITE_CENSUS_OUT", "suite_census.txt")
    with open(out, "w") as file:
        file.write("\n".join(lines) + "\n")
