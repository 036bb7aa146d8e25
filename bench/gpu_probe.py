import sys, numpy as np, halstm
H, B, T = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
tgt = sys.argv[4]
m = halstm.LSTM(H, H, target=tgt, seed=0)
x = np.ones((T, B, H), np.float32)
y, _ = m(x)
print("fwd ok", float(np.asarray(y).sum()), flush=True)
g = m.backward(np.ones_like(y))
print("bwd ok", flush=True)
