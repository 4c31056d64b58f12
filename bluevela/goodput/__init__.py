"""The goodput record, a room of its own below the launch side and below its readers: how a
step ended and why a node was lost (`outcome`: the record's kinds), the record itself (`events`:
its fields and bounds, fold, validate, merge, read), where its files lie on a node and why root
may trust them (`events_dir`), and root's reading of one attempt's files in the epilog
(`events_epilog`). The supervisor's writer and the keeper's copy stay in launch/ (`events_log`,
`events_copy`); the hooks, the archive and the report read the record from here.

Standard library only; of bluevela it imports only `protocol` (the wire's bounds and names)
and `util`.
"""
