"""bluevela: run an on-prem GPU supercomputer on Slurm.

This module stays import-light: `bv --help`, `bv submit` and the prolog's quick tier import it.
Never import torch, h5py, numpy or pynvml at module level anywhere on those paths.
"""

from __future__ import annotations

__version__ = "0.1.0"
