"""Proof on this machine: kernel self-checks and their verdict, the first-use model probe, checks across ranks."""
