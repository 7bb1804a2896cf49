"""A progress bar for long work (compiles, captures) that stays out of the way
when nobody is watching: a live bar on a terminal, otherwise one log line at the
end."""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType

__all__ = ["Progress"]

logger = logging.getLogger("kiln")


class Progress:
    def __init__(self, total: int, desc: str, enabled: bool | None = None) -> None:
        self.total = max(total, 1)
        self.desc = desc
        self.done = 0
        self.label = ""
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.t0 = time.perf_counter()

    def __enter__(self) -> "Progress":
        self._draw()
        return self

    def update(self, label: str = "", n: int = 1) -> None:
        self.done += n
        self.label = label
        self._draw()

    def _draw(self) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * self.done / self.total)
        bar = "#" * filled + "-" * (width - filled)
        elapsed = time.perf_counter() - self.t0
        sys.stderr.write(
            f"\r{self.desc} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {self.label[:40]:<40}"
        )
        sys.stderr.flush()

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        elapsed = time.perf_counter() - self.t0
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
        if exc is None:
            logger.info("%s: %d/%d in %.1fs", self.desc, self.done, self.total, elapsed)
