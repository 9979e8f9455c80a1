"""Driver side: every rank's stack, and a report of where a call that stopped moving stands.

The driver asks each worker for the stack of its training thread
(:mod:`ray_lightning_sgd._worker_group.stacks`, read by the worker's poll thread while the
training thread runs); :func:`report` writes them with each rank's node, its last completed
step and the Lightning hook it is in, and says which ranks wait in a collective and which do
not: in a hang, those that do not are usually the cause (a collective called on some ranks only,
a rank stuck in its DataLoader or in a callback).
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_lightning_sgd._worker_group.stacks import ThreadStack


@dataclass(frozen=True)
class RankStack:
    """One rank's training thread at one moment, as the driver got it."""

    rank: int
    #: The rank and where it runs (``rank 1 of 2 (node ..., 10.0.0.7, pid 4242)``).
    where: str
    #: The rank's last progress report: the stage and its step or batch (``training``, 41).
    last_progress: tuple[str, int] | None
    #: Its stack; None when the worker did not answer (lost, or busy beyond the wait).
    stack: ThreadStack | None
    #: Why there is no stack, when there is none.
    missing: str = ""

    @property
    def in_collective(self) -> bool:
        return self.stack is not None and self.stack.collective is not None

    def __str__(self) -> str:
        progress = (
            "no progress reported"
            if self.last_progress is None
            else f"last progress: {self.last_progress[0]} {self.last_progress[1]}"
        )
        head = f"--- {self.where}; {progress}"
        if self.stack is None:
            return f"{head}\n    (no stack: {self.missing})"
        notes = [f"in hook {self.stack.hook}" if self.stack.hook else "in no Lightning hook"]
        if self.stack.collective:
            notes.append(f"waiting in {self.stack.collective}")
        if self.stack.user_frame:
            notes.append(f"your code: {self.stack.user_frame}")
        return f"{head}; {'; '.join(notes)}\n{self.stack.text.rstrip()}"


#: Why a rank gave no stack when its worker answered that no call runs there: its call ended.
CALL_ENDED = "no call runs there"


def report(stacks: list[RankStack], why: str) -> str:
    """Every rank's stack under a summary: which ranks wait in a collective, which do not, and
    which ended their call (a collective the others wait in may be one these never called)."""
    waiting = [s.rank for s in stacks if s.in_collective]
    elsewhere = [s.rank for s in stacks if s.stack is not None and not s.in_collective]
    ended = [s.rank for s in stacks if s.stack is None and s.missing == CALL_ENDED]
    unknown = [s.rank for s in stacks if s.stack is None and s.missing != CALL_ENDED]
    lines = [why]
    if waiting:
        lines.append(f"ranks waiting in a collective: {_ranks(waiting)}")
        kinds: dict[str, list[int]] = {}
        for each in stacks:
            if each.stack is not None and each.stack.collective is not None:
                kinds.setdefault(each.stack.collective, []).append(each.rank)
        if len(kinds) > 1:
            lines.append(
                "the ranks wait in different collectives ("
                + "; ".join(f"{name} on ranks {_ranks(ranks)}" for name, ranks in kinds.items())
                + "): a collective called on some ranks only, or in another order on each"
            )
    if elsewhere:
        lines.append(
            f"ranks in no collective: {_ranks(elsewhere)}"
            + (" (the others wait for these: look there first)" if waiting else "")
        )
    if ended:
        lines.append(
            f"ranks whose call has ended: {_ranks(ended)}"
            + (
                " (the others may wait for these in a collective they never called)"
                if waiting
                else ""
            )
        )
    if unknown:
        lines.append(f"ranks that gave no stack: {_ranks(unknown)}")
    return "\n".join(lines + [str(s) for s in stacks])


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
