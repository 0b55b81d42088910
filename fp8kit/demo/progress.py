"""A small progress bar on stderr (no dependency): bar, step, loss, tokens/s and time left.

On a terminal the bar redraws in place (at most ``1 / min_interval`` times a second); when
stderr is not a terminal (logs, CI) it prints a plain line every 10% of the run instead.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar", "format_duration"]


def format_duration(seconds: float) -> str:
    """``75.2`` -> ``"1:15"``; ``3725`` -> ``"1:02:05"``."""
    seconds = max(0, round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressBar:
    """Progress of one training run of ``total`` steps.

    Args:
        label: shown in front of the bar (the variant's name).
        total: number of steps.
        stream: where to draw (default ``sys.stderr``).
        width: characters of the bar itself.
        min_interval: seconds between two redraws on a terminal.
    """

    def __init__(
        self,
        label: str,
        total: int,
        stream: TextIO | None = None,
        width: int = 24,
        min_interval: float = 0.1,
    ) -> None:
        self.label = label
        self.total = max(total, 1)
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.min_interval = min_interval
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._line = ""

    def _text(self, done: int, loss: float | None, tokens_per_s: float | None) -> str:
        frac = min(done / self.total, 1.0)
        filled = round(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        parts = [f"{self.label:<20} [{bar}] {done:>{len(str(self.total))}}/{self.total}"]
        if loss is not None:
            parts.append(f"loss {loss:6.3f}")
        if tokens_per_s is not None:
            parts.append(f"{tokens_per_s:8,.0f} tok/s")
        if 0 < done < self.total:
            parts.append(f"eta {format_duration(elapsed / done * (self.total - done))}")
        else:
            parts.append(f"{format_duration(elapsed)}")
        return "  ".join(parts)

    def update(
        self, done: int, loss: float | None = None, tokens_per_s: float | None = None
    ) -> None:
        """Report that ``done`` steps are finished (last loss and throughput if known)."""
        now = time.perf_counter()
        if self._tty:
            if now - self._last_draw < self.min_interval and done < self.total:
                return
            self._last_draw = now
            text = self._text(done, loss, tokens_per_s)
            pad = " " * max(0, len(self._line) - len(text))
            self.stream.write("\r" + text + pad)
            self._line = text
        else:
            decile = int(10 * done / self.total)
            if decile == self._last_decile or (decile == 10 and done < self.total):
                return
            self._last_decile = decile
            self.stream.write(self._text(done, loss, tokens_per_s) + "\n")
        self.stream.flush()

    def close(self, message: str = "") -> None:
        """Finish the bar's line (with an optional trailing message)."""
        if self._tty:
            self.stream.write(("  " + message if message else "") + "\n")
        elif message:
            self.stream.write(f"{self.label:<20} {message}\n")
        self.stream.flush()
