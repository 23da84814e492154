"""Moved: ``python -m decode.self_distill`` is ``python -m scripts.self_distill``
now; this shim says so on stderr and runs it (runpy: no import of scripts/)."""
import runpy
import sys

if __name__ == "__main__":
  print("note: python -m decode.self_distill moved to python -m scripts.self_distill",
        file=sys.stderr)
  runpy.run_module("scripts.self_distill", run_name="__main__", alter_sys=True)
