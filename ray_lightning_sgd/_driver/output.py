"""Driver side: the workers' output lines, printed here tagged with their rank."""

from __future__ import annotations

import os
import sys
from collections import OrderedDict

#: How many distinct output lines the driver remembers for printing each one once across ranks.
_MAX_DISTINCT_LINES = 10_000


class OutputPrinter:
    """Driver side: prints the workers' lines, each tagged ``[rank R]``; a line that several ranks
    print alike (a warning every rank emits) is printed once. With ``folder``, every line of
    rank R is also appended to ``<folder>/rank-<R>.log`` (the strategy's ``debug``)."""

    def __init__(self, folder: str | None = None) -> None:
        self.folder = folder
        if folder is not None:
            os.makedirs(folder, exist_ok=True)
        # per distinct line, how often each rank printed it; the least recently printed lines
        # are forgotten first (a long run that prints per step would otherwise grow it for ever)
        self._counts: OrderedDict[tuple[str, str], dict[int, int]] = OrderedDict()

    def note(self, rank: int, text: str) -> None:
        """Adds ``text`` (a header) to rank ``rank``'s file, where there are files."""
        if self.folder is not None:
            with open(os.path.join(self.folder, f"rank-{rank}.log"), "a") as file:
                file.write(text.rstrip("\n") + "\n")

    def write(self, rank: int, lines: list[tuple[str, str]]) -> None:
        if self.folder is not None:
            self.note(rank, "\n".join(line for _, line in lines))
        for stream, line in lines:
            counts = self._counts.setdefault((stream, line), {})
            self._counts.move_to_end((stream, line))
            if len(self._counts) > _MAX_DISTINCT_LINES:
                self._counts.popitem(last=False)
            seen_elsewhere = max((n for r, n in counts.items() if r != rank), default=0)
            counts[rank] = counts.get(rank, 0) + 1
            if counts[rank] > seen_elsewhere:
                target = sys.stdout if stream == "stdout" else sys.stderr
                target.write(f"[rank {rank}] {line}\n")
        sys.stdout.flush()
        sys.stderr.flush()


__all__ = ["OutputPrinter"]
