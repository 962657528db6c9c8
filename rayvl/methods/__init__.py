"""Each paper's method in one place, registered with the core below (``rayvl.plugins``): one ``register`` line a
method. A method fills the core's interfaces with what it changes at each stage of a run; the config check, the
data pipeline and the training loop iterate over the registered methods and name none of them.

- ``<method>/config.py``: its sections of the config tree (dataclasses; ``sections`` in its ``register`` line).
- ``<method>/check.py``: ``check(cfg)`` — its config constraints, each error naming the dotted key (torch-free).
- ``<method>/rows.py``: ``data_part(cfg, train, evalset)`` — its ``rayvl.data.parts.DataPart`` (what the driver
  resolves for its data before and after Ray starts) and row transform (``RowTransform``, run inside Ray Data's read
  tasks); torch-free.
- ``<method>/train.py``: its ``rayvl.train.parts.TrainPart``: a batch source, the loss targets or loss, a
  train-state component, metrics and what it does after a step, on every worker.
- ``<method>/report.py``: ``statistics(counts)`` and ``lines(report)`` — its part of the run's data report; and in
  the ``register`` line, the progress line's fields, the metrics that count data, the streams it reads.

Papers: [BoW] Bag-of-Words captions and the memory bank, [TOnICS] ontology-bucketed curriculum minibatches,
[UniCL] image-label data in the contrastive loss, [Paraphrase] text strategies (rayvl.models.text_strategies) and
paraphrase metrics (rayvl.eval.paraphrase), whose config constraints live here.
"""
from rayvl.methods.bow import check as bow
from rayvl.methods.bow.config import BowConfig, MemoryBankConfig, PseudoLabelConfig
from rayvl.methods.paraphrase import check as paraphrase
from rayvl.methods.tonics import check as tonics
from rayvl.methods.tonics.config import TonicsConfig
from rayvl.methods.unicl import check as unicl
from rayvl.methods.unicl.config import ImageLabelConfig
from rayvl.plugins import Method, register

# the order counts (rayvl.plugins): a caption is deformed ([BoW]) before its nouns make rows ([TOnICS]);
# image-label data is a stream of its own ([UniCL]). Checks are imported here (the config runs them); data and
# training parts by name, where a run needs them
register(Method("paraphrase", paraphrase.check))
register(Method("bow", bow.check, "rayvl.methods.bow.rows:data_part", "rayvl.methods.bow.train:MemoryBankPart",
                report="rayvl.methods.bow.report", data_metrics=("bow_",), negatives=bow.negatives,
                commands="rayvl.methods.bow.commands:add_commands",
                sections=(("bow", BowConfig), ("memory_bank", MemoryBankConfig), ("pseudo_label", PseudoLabelConfig))))
register(Method("tonics", tonics.check, "rayvl.methods.tonics.rows:data_part", "rayvl.methods.tonics.train:TonicsPart",
                report="rayvl.methods.tonics.report", data_metrics=("tonics_rows",),
                # [TOnICS] §3: the curriculum's probability of a root-node (random) batch
                progress=(("tonics_p_root", "P_S(root) {:.3f}"),), sections=(("tonics", TonicsConfig),)))
register(Method("unicl", unicl.check, "rayvl.methods.unicl.rows:data_part", "rayvl.methods.unicl.train:UniclPart",
                report="rayvl.methods.unicl.report", streams=unicl.streams,
                # [UniCL] eq. (1)–(3): label-aware targets; eq. (4): cross-entropy over learned class embeddings
                loss_kinds=("unicl", "ce"), sections=(("image_label", ImageLabelConfig),)))
