"""Synthetic experiments of Charles et al. 2024, §3, App. B (ELS/ULS noise-variance comparison) and §7.2 (mean
estimation), run by ``userdp experiment variance`` and ``userdp experiment mean-estimation``."""
