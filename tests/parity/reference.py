"""Runs the parity cases under Lightning's own ``ddp`` (2 CPU processes) and saves rank 0's records.

``python -m tests.parity.reference OUT [CASE ...]`` writes ``OUT/<case>.pt`` (a list of (label,
snapshot)) for each case, or ``OUT/<case>.error`` with the traceback when a case fails there.
Lightning's ``ddp`` starts rank 1 by running this same command again, so both ranks run the cases
in the same order, each case in its own folder ``OUT/ddp/<case>``.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch

from tests.parity.cases import CASES, Run


def main() -> None:
    out = Path(sys.argv[1])
    names = sys.argv[2:] or list(CASES)
    rank_zero = os.environ.get("LOCAL_RANK", "0") == "0"
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    # DataLoader workers start from a forkserver here (see Run.worker_start_method), with torch
    # loaded in it once: the case took 9.4-9.9 s so, 15.3-15.8 s without it, 7.2 s forked.
    multiprocessing.set_forkserver_preload(["torch", "tests.parity.cases"])
    for name in names:
        run = Run("ddp", out / "ddp" / name)
        try:
            CASES[name](run)
        except BaseException:
            if rank_zero:
                (out / f"{name}.error").write_text(traceback.format_exc())
            raise
        if rank_zero:
            torch.save(run.records, out / f"{name}.part")
            os.replace(out / f"{name}.part", out / f"{name}.pt")


if __name__ == "__main__":
    main()
