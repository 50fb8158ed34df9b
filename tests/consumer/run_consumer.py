"""Run seed 003's consumer (section 2.3) unmodified against a document at another path.

The consumer hard-codes /config/fault.json, the path a pod mounts. A test cannot mount
there, so this harness points that one path at the file given on the command line and
then runs the consumer's code exactly as published (seed003_consumer.py, quotes restored
from the article's text).

usage: run_consumer.py DOCUMENT
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


builtins.open = lambda path, *a, **kw: _open(_redirect(path), *a, **kw)
os.path.getmtime = lambda path: _getmtime(_redirect(path))
sys.stdout.reconfigure(line_buffering=True)
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'seed003_consumer.py'), run_name='__main__')
