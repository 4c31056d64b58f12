"""Transitional: the job series is now `series_layout` (the HDF5 file), `series_checks` (the
side-file checks) and `series_ingest`. Only report/efficiency.py (being reworked this round)
still imports `series_path` from here; this module goes when it switches."""

from bluevela.archive.series_layout import series_path

__all__ = ["series_path"]
