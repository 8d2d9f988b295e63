"""Imported once, first, by the fork server that local ranks are forked from (its preload list,
``forkserver.context``): the server dies with the launcher that started it, and the ranks die
with the server (``launch._rank_main``), so a launcher killed outright (SIGKILL, the OOM killer,
a closed terminal) leaves no process behind. Ctrl-C at a terminal reaches the whole process
group: a rank forked a moment ago, still reading what to run, ignores it from its first
instruction (the server's children start with the handlers the server had before its own loop,
these), and the launcher stops it. Nothing else imports this module."""

import signal

from .launch import die_with_parent

die_with_parent(signal.SIGTERM)
signal.signal(signal.SIGINT, signal.SIG_IGN)
