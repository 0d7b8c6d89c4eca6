"""A reward whose module is slow to import (like one loading a heavy library). A fresh worker process imports it
when it unpickles its first task: before that import counted against the per-call limit, a short limit timed out
every call of a fresh worker."""
import time

IMPORT_S = 1.5
time.sleep(IMPORT_S)


def constant(response, answer, example):
    return 1.0
