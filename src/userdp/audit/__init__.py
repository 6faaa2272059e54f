"""Empirical privacy audits (``userdp audit``, docs/audit.md): canary users, membership scores,
the one-run epsilon lower bound (Steinke, Nasr & Jagielski 2023) and user inference.

Modules: :mod:`~userdp.audit.bounds` (the statistics, no model code), :mod:`~userdp.audit.canaries`
(synthetic users and the training view that appends them), :mod:`~userdp.audit.scores`,
:mod:`~userdp.audit.session` (the train job's hooks), :mod:`~userdp.audit.faults` (broken builds
that prove the audit's power; tests and benchmarks only).
"""
