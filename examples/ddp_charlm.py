"""A char-level language model built from halstm.torch layers, trained
data-parallel with torch's DistributedDataParallel (NCCL on GPUs, process
r on cuda:r of its machine; gloo on CPUs), launched by torchrun:

    torchrun --standalone --nproc_per_node=2 examples/ddp_charlm.py --steps 200
    python examples/ddp_charlm.py --steps 200          # one process, no torchrun

Every step draws one global batch of --batch sequences from a seeded
generator shared by all processes; process r of w trains on rows
[r*batch/w, (r+1)*batch/w), so the averaged gradients equal one process's
on the whole batch. --dump-grads FILE writes the first step's gradients
(after DDP's averaging) from process 0 and is how tests/test_ddp.py checks
that equality.
"""
import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import halstm.torch as hnn
from halstm.model import data


class CharLM(torch.nn.Module):
    """Embedding -> halstm.torch.LSTM -> linear head over the vocabulary."""

    def __init__(self, vocab: int, embed: int, hidden: int, layers: int, dropout: float):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, embed)
        self.rnn = hnn.LSTM(embed, hidden, layers, dropout=dropout, batch_first=True)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, ids):                 # ids (B, T) -> logits (B, T, vocab)
        y, _ = self.rnn(self.embed(ids))
        return self.head(y)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", help="a UTF-8 text file (default: the Shakespeare corpus)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--embed", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dump-grads", help="write the first step's gradients here (.npz)")
    a = ap.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":                    # a GPU a process: torchrun's LOCAL_RANK
        local = int(os.environ.get("LOCAL_RANK", 0))
        if local >= torch.cuda.device_count():
            raise SystemExit(f"LOCAL_RANK {local}: this machine has "
                             f"{torch.cuda.device_count()} GPU(s); expected at most one "
                             f"process a GPU (--nproc_per_node)")
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if distributed:
        dist.init_process_group("gloo" if device == "cpu" else "nccl")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    if a.batch % world:
        raise SystemExit(f"--batch {a.batch}: expected a multiple of the {world} processes")
    text, source = data.load(a.text)
    vocab = data.Vocab.from_text(text)
    ids = torch.from_numpy(vocab.encode(text).astype(np.int64))

    torch.manual_seed(a.seed)               # the same initial weights everywhere
    model = CharLM(len(vocab), a.embed, a.hidden, a.layers, a.dropout).to(device)
    if distributed:
        model = DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    batches = torch.Generator().manual_seed(a.seed + 1)
    rows = slice(rank * a.batch // world, (rank + 1) * a.batch // world)
    start = time.perf_counter()
    for step in range(1, a.steps + 1):
        first = torch.randint(0, len(ids) - a.seq - 1, (a.batch,), generator=batches)
        window = torch.stack([ids[i:i + a.seq + 1] for i in first[rows].tolist()]).to(device)
        logits = model(window[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, len(vocab)),
                                                 window[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        if step == 1 and a.dump_grads and rank == 0:
            inner = model.module if distributed else model
            np.savez(a.dump_grads, **{n: p.grad.detach().cpu().numpy()
                                      for n, p in inner.named_parameters()})
        opt.step()
        if rank == 0 and (step % 20 == 0 or step == a.steps):
            chars = step * a.batch * a.seq / (time.perf_counter() - start)
            print(f"step {step}: loss {loss.item():.3f} ({chars:,.0f} chars/s over {world} "
                  f"process{'es' if world > 1 else ''}, {device}; {source})", flush=True)
    if distributed:
        dist.destroy_process_group()
        # torch's gloo teardown can deadlock at interpreter exit: the
        # process group's destructor joins gloo's thread while holding the
        # GIL, and that thread may be freeing work that needs the GIL. The
        # run is over and its output flushed, so leave without teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
