"""userdp: fine-tune language models with user-level differential privacy.

The privacy unit is a user: every guarantee userdp prints is for adding or removing *all*
of one person's records. See README.md for the guarantee and its assumptions.
"""

__version__ = "0.10.2"
