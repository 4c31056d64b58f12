"""Deploying bluevela on a node from the installed package: the package data (hook shims,
systemd units, Prometheus files, slurm.conf additions, logrotate) and `bv install`."""
