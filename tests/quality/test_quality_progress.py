"""The eval's progress on stderr: a redrawn bar on a terminal, plain periodic lines otherwise."""

from __future__ import annotations

import io

from service.quality.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_without_a_terminal_a_line_per_tenth_and_at_the_end() -> None:
    clock, out = Clock(), io.StringIO()
    progress = Progress(20, out, clock=clock)
    for _ in range(20):
        clock.now += 1.0
        progress.advance()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [line.split()[0] for line in lines] == [f"{n}/20" for n in range(2, 21, 2)]
    assert lines[0] == "2/20 samples 1.00/s ETA 0:00:18 (elapsed 0:00:02)"
    assert lines[-1] == "20/20 samples 1.00/s ETA 0:00:00 (elapsed 0:00:20)"


def test_without_a_terminal_a_slow_run_still_reports_every_30_s() -> None:
    clock, out = Clock(), io.StringIO()
    progress = Progress(1000, out, "questions", clock=clock)
    for _ in range(3):
        clock.now += 40.0
        progress.advance()
    assert out.getvalue().splitlines() == [
        "1/1000 questions 0.03/s ETA 11:06:00 (elapsed 0:00:40)",
        "2/1000 questions 0.03/s ETA 11:05:20 (elapsed 0:01:20)",
        "3/1000 questions 0.03/s ETA 11:04:40 (elapsed 0:02:00)",
    ]


def test_on_a_terminal_one_redrawn_bar() -> None:
    clock, out = Clock(), Terminal()
    progress = Progress(4, out, clock=clock)
    for _ in range(4):
        clock.now += 0.5
        progress.advance()
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # one line, ended when the last sample is done
    frames = text.rstrip("\n").split("\r")[1:]
    assert len(frames) == 4
    assert frames[0].startswith("[" + "#" * 6 + "." * 18 + "] 1/4 samples 2.00/s ETA 0:00:02")
    assert frames[-1].startswith("[" + "#" * 24 + "] 4/4 samples")


def test_on_a_terminal_fast_samples_are_not_all_drawn() -> None:
    clock, out = Clock(), Terminal()
    progress = Progress(100, out, clock=clock)
    for _ in range(100):
        clock.now += 0.01
        progress.advance()
    frames = out.getvalue().rstrip("\n").split("\r")[1:]
    assert 4 <= len(frames) <= 6  # one per 0.2 s of a 1 s run, and the last
    assert "100/100" in frames[-1]
