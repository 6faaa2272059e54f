"""The one DP training loop over privacy units (model-agnostic).

Public API::

    from userdp.engine import train, TrainConfig, ULS, ELS, FedAvg, FlatClip, SGD
    result = train(model, data, loss_fn, TrainConfig(algorithm=ULS(group_size=8, sampling_rate=0.1),
                                                     steps=100, target_epsilon=3.0))
"""

from userdp.engine.aggregation import ClippedDenominator, FixedDenominator
from userdp.engine.algorithms import ALGORITHMS, ELS, ULS, FedAvg, FedSGD, NonPrivate, register_algorithm
from userdp.engine.clipping import AdaptiveClip, FlatClip, PerLayerClip
from userdp.engine.data import DelegatingUserData, TensorUserData, UserData
from userdp.engine.ledger import PrivacyLedger
from userdp.engine.loop import TrainConfig, TrainingInterrupted, TrainResult, train
from userdp.engine.optimizers import SGD, Adafactor, Adam

__all__ = [
    "TrainingInterrupted",
    "DelegatingUserData",
    "train", "TrainConfig", "TrainResult",
    "ELS", "ULS", "FedAvg", "FedSGD", "NonPrivate", "ALGORITHMS", "register_algorithm",
    "FlatClip", "PerLayerClip", "AdaptiveClip",
    "FixedDenominator", "ClippedDenominator",
    "SGD", "Adam", "Adafactor",
    "UserData", "TensorUserData", "PrivacyLedger",
]
