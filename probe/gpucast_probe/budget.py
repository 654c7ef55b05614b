"""The probe's hard time budget: no job starts that could not finish, and a running job is
stopped at the deadline, so the whole run never exceeds --minutes."""

from __future__ import annotations

import time
from typing import Callable, Optional


class Budget:
    def __init__(self, minutes: float, reserve_seconds: float = 15.0, clock: Callable[[], float] = time.monotonic):
        if not minutes > 0:
            raise ValueError("--minutes must be positive")
        self._clock = clock
        self.reserve = reserve_seconds  # kept back for killing a child, writing and posting
        self.deadline = clock() + minutes * 60.0

    def remaining(self) -> float:
        return max(0.0, self.deadline - self._clock())

    def usable(self) -> float:
        """Seconds a new job may use in all, start-up included."""
        return max(0.0, self.remaining() - self.reserve)

    def plan_job(self, train_seconds: float, startup_seconds: float, min_train_seconds: float) -> Optional[tuple]:
        """(train, timeout) for the next job, or None when no worthwhile job fits any more.

        train: how long the child trains; timeout: when the parent kills it whatever it does.
        A job gets less training time near the end, but never less than min_train_seconds.
        """
        usable = self.usable()
        train = min(train_seconds, usable - startup_seconds)
        if train < min_train_seconds:
            return None
        return train, min(usable, train + startup_seconds)
