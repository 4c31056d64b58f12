"""bv's start-up hook in each training process of a `bv submit` job.

The node agent puts this directory first on torchrun's PYTHONPATH (bluevela/runtime/world.py
`training_env`), so Python's `site` imports this module at every interpreter start under that
torchrun: torchrun itself and its ranks (the ddtrace-run and newrelic-admin pattern). It runs
bv's integrations in the ranks only (LOCAL_RANK set, BV_INTEGRATIONS=1), then the
`sitecustomize` this one shadows, if any, so a site's or a virtualenv's own still runs. It never
raises: a failure is one warning line and the script runs as if bv were not there.
"""

import os
import sys


def _start() -> None:
    if os.environ.get("BV_INTEGRATIONS") != "1" or "LOCAL_RANK" not in os.environ:
        return
    try:
        from bluevela.integrations import boot

        boot.start()
    except Exception as exc:  # noqa: BLE001 - the training must start whatever happens here
        sys.stderr.write(f"bv: integrations off in this process ({type(exc).__name__}: {exc})\n")


def _chain() -> None:
    """Import the next `sitecustomize` on the path (the one this module shadows)."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved = sys.path[:]
    mine = sys.modules.pop("sitecustomize", None)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
        import sitecustomize  # noqa: F401
    except ImportError:
        pass
    except Exception as exc:  # noqa: BLE001 - as site.py itself does for a broken one
        sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                         f"{type(exc).__name__}: {exc}\n")
    finally:
        sys.path[:] = saved
        if mine is not None:
            sys.modules["sitecustomize"] = mine


_start()
_chain()
