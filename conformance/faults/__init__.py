"""The fault matrix: signals, kills, exceptions, stalls and restarts sent to a 2-rank fit, and how every rank ends.

- ``fit``: the small real ``custom_ddp`` fit the faults are injected into.
- ``rows``: what fault, on which rank, when, and what each row measures.
- ``injection``: one fit run from outside: the fault sent at the row's moment, every rank watched until gone.
- ``messages``: what rank 0 (or each rank) said when a fault ended the fit.
- ``matrix``: ``python -m conformance.faults.matrix`` runs the rows and writes the record.
- ``report``: the table, from the record, and its generated block in the manual.

Nothing is imported here.
"""
