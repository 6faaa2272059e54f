"""The fixed sentences of every private statement (the setting, the adjacency, what is covered):
written by :mod:`userdp.lm.statement`, and required word for word by :mod:`userdp.lm.report`, so a
record that rewrites them is refused, not printed."""

SETTING = (
    "central: a trusted aggregator (this process) sees the raw records, computes and "
    "clips each sampled user's update, and releases only the noised sum"
)
ADJACENCY = (
    "add/remove one user: the two datasets differ in all records of one user (ADD_OR_REMOVE_ONE in dp_accounting)"
)
COVERAGE = (
    "every step of training: the mechanism's output is the full sequence of noised "
    "aggregated updates, so every checkpoint and the final model are covered by the same "
    "(epsilon, delta) (post-processing)"
)
