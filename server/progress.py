"""Progress of the long steps an operator waits on: model loading, vLLM start-up, checkpoint saves.

On a terminal (stderr is a tty) a step is one tqdm line redrawn in place: a bar when its size is
known, else the elapsed seconds and a note (vLLM's last log line). Anywhere else (a log file, a
container's stdout) it is log lines: `event=NAME_started`, `event=NAME_progress` every
LOG_EVERY_SECONDS while it runs, and the caller's own end line. Knows nothing about what the steps do.
"""

import logging
import sys
import threading
import time

from tqdm import tqdm

LOG_EVERY_SECONDS = 30.0
TERMINAL_REFRESH_SECONDS = 0.5


def on_terminal() -> bool:
    """Whether progress is drawn (stderr is a terminal) rather than logged."""
    return sys.stderr.isatty()


class Progress:
    """One long step; `with Progress(...) as step:` then `step.advance(n)` / `step.note(text)` as it goes.

    A ticker thread keeps the elapsed time moving (terminal) or writes a line every LOG_EVERY_SECONDS
    (log), so a step with no natural increments (one safetensors write, vLLM's start) still shows life.
    """

    def __init__(self, event: str, description: str, logger: logging.Logger, *, total: int | None = None,
                 unit: str = "B", delay: float = 0.0, **fields):
        """
        Args:
            delay: seconds before anything is shown; a step that ends sooner (most checkpoint saves)
                leaves only the caller's end line.
        """
        self.event, self.description, self.logger, self.total, self.fields = event, description, logger, total, fields
        self.done, self._note = 0, ""
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._bar = None
        if on_terminal():
            self._bar = tqdm(desc=description, total=total, unit=unit, unit_scale=True, unit_divisor=1024,
                             leave=False, file=sys.stderr, dynamic_ncols=True, delay=delay,
                             bar_format=None if total else "{desc}: {elapsed} {postfix}")
        elif not delay:
            self.logger.info("event=%s_started %s", event, self._fields())
        self._ticker = threading.Thread(target=self._tick, name=f"progress-{event}", daemon=True)
        self._ticker.start()

    def advance(self, amount: int) -> None:
        self.done += amount
        if self._bar is not None:
            self._bar.update(amount)

    def note(self, text: str) -> None:
        """A short word on where the step is (shown after the bar, or in the next progress line)."""
        self._note = text.strip()[-100:]
        if self._bar is not None:
            self._bar.set_postfix_str(self._note, refresh=False)

    @property
    def seconds(self) -> float:
        return time.monotonic() - self._started

    def close(self) -> None:
        self._stop.set()
        self._ticker.join()
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _fields(self) -> str:
        return " ".join(f"{key}={value}" for key, value in self.fields.items())

    def _tick(self) -> None:
        interval = TERMINAL_REFRESH_SECONDS if self._bar is not None else LOG_EVERY_SECONDS
        while not self._stop.wait(interval):
            if self._bar is not None:
                self._bar.refresh()
                continue
            done = f" done={self.done}/{self.total}" if self.total else ""
            note = f" note={self._note!r}" if self._note else ""
            self.logger.info("event=%s_progress %s seconds=%.0f%s%s", self.event, self._fields(), self.seconds,
                             done, note)
