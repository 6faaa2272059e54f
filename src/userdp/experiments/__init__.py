"""Synthetic experiments of SPEC §7.1 (ELS/ULS noise-variance comparison) and §7.2 (mean
estimation), run by ``userdp experiment variance`` and ``userdp experiment mean-estimation``."""
