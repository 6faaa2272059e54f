"""The one DP training loop over privacy units (model-agnostic).

Public API::

    from userdp.engine import train, TrainConfig, ULS, ELS, FedAvg, FlatClip, SGD
    result = train(model, data, loss_fn, TrainConfig(algorithm=ULS(group_size=8, sampling_rate=0.1),
                                                     steps=100, target_epsilon=3.0))

or, in the caller's own loop (docs/engine.md, "Your own loop")::

    private = make_private(model, optimizer, data, loss_fn, config)
    for step in private:
        optimizer.zero_grad(); step.backward(); optimizer.step()
"""

from userdp.engine.aggregation import ClippedDenominator, FixedDenominator
from userdp.engine.algorithms import ALGORITHMS, ELS, ULS, FedAvg, FedSGD, NonPrivate, register_algorithm
from userdp.engine.batch_unit import BatchPerUnit  # registers per_unit: batch (the non-private baseline's)
from userdp.engine.clipping import AdaptiveClip, FlatClip, PerLayerClip
from userdp.engine.ledger import PrivacyLedger
from userdp.engine.noise.bandmf import BandMF  # registers noise: bandmf
from userdp.engine.optimizers import SGD, Adafactor, Adam
from userdp.engine.performance import Performance
from userdp.engine.privacy_record import PrivacyRecord
from userdp.engine.private_loop import PrivateTraining, make_private
from userdp.engine.run.loop import TrainConfig, TrainingInterrupted, TrainResult, train
from userdp.engine.run.options import RunOptions
from userdp.engine.user_data import DelegatingUserData, TensorUserData, UserData

__all__ = [
    "TrainingInterrupted",
    "BandMF",
    "DelegatingUserData",
    "train",
    "RunOptions",
    "TrainConfig",
    "Performance",
    "TrainResult",
    "PrivacyRecord",
    "make_private",
    "PrivateTraining",
    "ELS",
    "ULS",
    "FedAvg",
    "FedSGD",
    "NonPrivate",
    "ALGORITHMS",
    "register_algorithm",
    "FlatClip",
    "PerLayerClip",
    "AdaptiveClip",
    "FixedDenominator",
    "ClippedDenominator",
    "SGD",
    "Adam",
    "Adafactor",
    "UserData",
    "TensorUserData",
    "PrivacyLedger",
    "BatchPerUnit",
]
