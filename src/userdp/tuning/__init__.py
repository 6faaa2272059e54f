"""Hyperparameter tuning with its privacy accounted (``userdp tune``, docs/tuning.md).

:mod:`~userdp.accounting.selection` (the trial-count distributions and Papernot & Steinke's RDP
bounds), :mod:`~userdp.tuning.accounting` (per-trial curves, total epsilon, calibration),
:mod:`~userdp.tuning.space` (search spaces), :mod:`~userdp.tuning.job` (the trials, resume, release).
"""
