"""Progress lines for the data preparation stages: documents, tokens, MB/s, tokens/s."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Counts documents, tokens and input bytes and reports them on stderr about once per interval.

    Args:
        stage: name printed at the start of each line.
        interval: seconds between progress lines.
        stream: where to print (stderr by default, so stdout stays clean for pipes).
    """

    def __init__(self, stage: str, interval: float = 2.0, stream: TextIO | None = None):
        self.stage = stage
        self.interval = interval
        self.stream = stream if stream is not None else sys.stderr
        self.documents = 0
        self.tokens = 0
        self.bytes = 0
        self.start = time.perf_counter()
        self._last = self.start

    def update(self, documents: int = 0, tokens: int = 0, num_bytes: int = 0) -> None:
        """Add to the counters; print a line if `interval` seconds have passed since the last."""
        self.documents += documents
        self.tokens += tokens
        self.bytes += num_bytes
        now = time.perf_counter()
        if now - self._last >= self.interval:
            self._last = now
            print(self.line(), file=self.stream, flush=True)

    def line(self, prefix: str = "") -> str:
        """The current counters and rates as one line."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        parts = [f"{self.documents:,} documents"]
        if self.tokens:
            parts.append(f"{self.tokens:,} tokens")
        parts.append(f"{self.bytes / 1e6:,.1f} MB in {elapsed:.1f} s")
        parts.append(f"{self.bytes / 1e6 / elapsed:.2f} MB/s")
        if self.tokens:
            parts.append(f"{self.tokens / elapsed:,.0f} tokens/s")
        return f"[{self.stage}] {prefix}" + ", ".join(parts)

    def finish(self) -> str:
        """Print and return the final summary line."""
        line = self.line("done: ")
        print(line, file=self.stream, flush=True)
        return line
