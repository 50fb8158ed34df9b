"""Run seed 003's consumer (section 2.3) unmodified against a document at another path.

The consumer hard-codes /config/fault.json, the path a pod mounts. A test cannot mount
there, so this harness points that one path at the file given on the command line and
then runs the consumer's code exactly as published (seed003_consumer.py, quotes restored
from the article's text).

usage: [CONSUMER_TRACE=FILE] run_consumer.py DOCUMENT
"""
import builtins
import os
import runpy
import sys

MOUNTED = '/config/fault.json'
target = sys.argv[1]

_open = builtins.open
_getmtime = os.path.getmtime


def _redirect(path):
    return target if path == MOUNTED else path


# CONSUMER_TRACE=FILE: each look at the mounted path is appended to FILE, `check` for
# its mtime and `read` for an open, so a test waits on the consumer's own progress.
TRACE = os.environ.get('CONSUMER_TRACE')


def _note(path, what):
    if TRACE and path == MOUNTED:
        with _open(TRACE, 'a') as t:
            t.write(what + '\n')


def _traced_open(path, *a, **kw):
    _note(path, 'read')
    return _open(_redirect(path), *a, **kw)


def _traced_getmtime(path):
    _note(path, 'check')
    return _getmtime(_redirect(path))


builtins.open = _traced_open
os.path.getmtime = _traced_getmtime
sys.stdout.reconfigure(line_buffering=True)
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'seed003_consumer.py'), run_name='__main__')
