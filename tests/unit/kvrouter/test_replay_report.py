"""What a replay prints: the progress, a redrawn bar on a real terminal (a pty) and a few plain
lines anywhere else; a table with ``-`` where a row has no value, never ``None``."""

from __future__ import annotations

import io
import os
import select
import time

from kvrouter.replay.report import Progress, format_table


def test_on_a_terminal_the_bar_is_redrawn_and_ends_with_the_total() -> None:
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as tty:
            bar = Progress("kvrouter", 20, tty)
            for _ in range(20):
                bar()
        got = _read_until(master, "20/20\r\n")
    finally:
        os.close(master)
        os.close(slave)
    assert got.count("\r") >= 20  # each redraw returns to the line's start
    assert got.endswith("[" + "#" * 30 + "] 20/20\r\n")  # (the pty's newline is \r\n)


def _read_until(fd: int, tail: str, timeout_s: float = 10.0) -> str:
    """What the pty gave until ``tail`` arrived: one ``read`` may return only part of what was
    written (the line discipline hands it over in pieces)."""
    got, deadline = "", time.monotonic() + timeout_s
    while not got.endswith(tail):
        left = deadline - time.monotonic()
        assert left > 0, f"the pty gave {got!r}, never {tail!r}"
        if select.select([fd], [], [], left)[0]:
            got += os.read(fd, 65536).decode()
    return got


def test_elsewhere_it_prints_a_plain_line_at_each_quarter() -> None:
    out = io.StringIO()  # a file or a pipe: not a terminal
    bar = Progress("kvrouter", 300, out)
    for _ in range(300):
        bar()
    assert "\r" not in out.getvalue()
    assert out.getvalue().splitlines() == [
        f"kvrouter: {n}/300 requests done" for n in (75, 150, 225, 300)
    ]
    few = io.StringIO()
    bar = Progress("oracle", 3, few)
    for _ in range(3):
        bar()
    assert few.getvalue().splitlines() == [f"oracle: {n}/3 requests done" for n in (1, 2, 3)]


def test_a_missing_value_is_a_dash() -> None:
    rows = [
        {"policy": "kvrouter", "hit_%": 20.6, "of_ideal_%": None, "cpu_s/1k": 38.1},
        {"policy": "round_robin", "hit_%": 6.0, "of_ideal_%": 28},  # no cpu_s/1k column
    ]
    lines = format_table("t", rows).splitlines()
    assert "None" not in "\n".join(lines)
    assert lines[2].split() == ["kvrouter", "20.6", "-", "38.1"]
    assert lines[3].split() == ["round_robin", "6.0", "28", "-"]
