"""Holds bv's `sitecustomize.py` for the training processes (bluevela/integrations/boot.py)."""
