"""hakmem.progress: a bar on a terminal, nothing but the lines on anything
else (pipes, logs, CI), so `--json` output and logs never carry one."""
import fcntl
import io
import os
import select
import struct
import termios

import pytest

from hakmem import progress as P


def test_silent_when_the_stream_is_not_a_terminal(monkeypatch):
    monkeypatch.delenv("HAKMEM_PROGRESS", raising=False)
    out = io.StringIO()
    bar = P.progress(range(5), desc="x", stream=out)
    assert not P.enabled(out)
    assert list(bar) == [0, 1, 2, 3, 4] and bar.n == 5 and len(bar) == 5
    with P.progress(total=3, desc="y", stream=out) as b:
        b.update(2)
        b.set_postfix_str("ignored")
        b.write("a line")
    assert out.getvalue() == "a line\n"          # the line, no bar, no carriage return


def test_a_bar_on_a_terminal_and_the_switch(monkeypatch):
    monkeypatch.delenv("HAKMEM_PROGRESS", raising=False)
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))   # a terminal 100 columns wide
    tty = os.fdopen(slave, "w")
    try:
        assert P.enabled(tty)
        with P.progress(total=3, desc="bench", unit="run", stream=tty) as b:
            for _ in range(3):
                b.update(1)
        tty.flush()
        drawn = b""
        while select.select([master], [], [], 0.2)[0]:       # all of it: a read may return a part
            drawn += os.read(master, 65536)
        drawn = drawn.decode(errors="replace")
        assert "bench" in drawn and "3/3" in drawn and "\r" in drawn, drawn
        monkeypatch.setenv("HAKMEM_PROGRESS", "0")         # off, even on a terminal
        assert not P.enabled(tty) and isinstance(P.progress(total=1, stream=tty), P._Silent)
    finally:
        tty.close()
        os.close(master)
    monkeypatch.setenv("HAKMEM_PROGRESS", "1")             # on, whatever the stream says
    out = io.StringIO()
    with P.progress(total=2, desc="forced", stream=out) as b:
        b.update(2)
    assert "2/2" in out.getvalue()
