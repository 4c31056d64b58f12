"""The spool of node reports and the per-job HDF5 run archive."""
