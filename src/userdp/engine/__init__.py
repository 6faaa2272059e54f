"""The one DP training loop over privacy units (model-agnostic)."""

from userdp.engine.data import TensorUserData, UserData

__all__ = ["UserData", "TensorUserData"]
