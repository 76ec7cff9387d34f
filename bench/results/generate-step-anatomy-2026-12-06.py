# The demo GPT decoder of tgw-bench generate (gen_model.DIMS), one torch thread: one step at 64 rows
# with every row at one position vs spread over 8..150 (continuous batching mixes positions; the
# attention reads keys up to the furthest row), and the same without the gather of the rows' KV
# (rows in slots 0..63, views). Run: .venv/bin/python bench/results/generate-step-anatomy-2026-12-06.py
import time, torch, os, tempfile
from tgw.bench.harness import gen_model
torch.set_num_threads(1)
d = tempfile.mkdtemp()
w = gen_model.save_weights(gen_model.DIMS, 1, os.path.join(d, "w.pt"))
m = gen_model.load(w); cfg = m.cfg
from tgw.workers.demo_generator import kv_shape
kv = torch.zeros([64, *kv_shape(cfg)])
def t(f, n=20):
    f(); t0 = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t0) / n * 1000
with torch.inference_mode():
    tok = torch.randint(0, cfg.vocab, (64,))
    slots = torch.arange(64)
    for desc, pos in (("uniform 72", torch.full((64,), 72)), ("spread 8..150", torch.linspace(8, 150, 64).long()), ("max 150", torch.full((64,), 150))):
        print(desc, "step ms", round(t(lambda: m.step_tokens(tok, kv, pos, slots)), 2))
    shuffled = torch.randperm(64)
    print("spread, shuffled slots", round(t(lambda: m.step_tokens(tok, kv, torch.linspace(8, 150, 64).long(), shuffled)), 2))
    p = torch.randint(0, cfg.vocab, (1, 36))
    print("prefill 1x36 ms", round(t(lambda: m.forward_tokens(p, kv, torch.zeros(1, dtype=torch.long), torch.tensor([3]))), 2))
    p8 = torch.randint(0, cfg.vocab, (8, 64))
    print("prefill 8x64 ms", round(t(lambda: m.forward_tokens(p8, kv, torch.zeros(8, dtype=torch.long), torch.arange(8))), 2))
import tgw.workers.demo_generator as dg
src = open(dg.__file__).read()
# variant: no gather when the slots are 0..rows-1 in order (a view)
def hidden2(self, tokens, kv, start, slots=None):
    cfg = self.cfg
    rows, steps = tokens.shape
    pos = start.reshape(rows, 1) + torch.arange(steps)
    length = int(pos.max()) + 1
    x = self.tok(tokens) + self.pos(pos)
    visible = (torch.arange(length) <= pos[:, :, None])[:, None]
    heads, hd = cfg.n_heads, cfg.head_dim
    for i, layer in enumerate(self.layers):
        q, k, v = layer.qkv(layer.ln1(x)).view(rows, steps, 3, heads, hd).unbind(2)
        cache = kv[:rows, i]
        r = torch.arange(rows)
        cache[:, 0].transpose(1, 2)[r[:, None], pos] = k
        cache[:, 1].transpose(1, 2)[r[:, None], pos] = v
        keys, values = cache[:, 0, :, :length], cache[:, 1, :, :length]
        att = (q.transpose(1, 2) @ keys.transpose(-1, -2)) * hd ** -0.5
        att = att.masked_fill(~visible, float("-inf")).softmax(-1)
        x = x + layer.proj((att @ values).transpose(1, 2).reshape(rows, steps, cfg.d_model))
        x = x + layer.mlp(x)
    return self.ln_f(x)
with torch.inference_mode():
    for desc, pos in (("uniform 72", torch.full((64,), 72)), ("spread 8..150", torch.linspace(8, 150, 64).long())):
        print("no-gather", desc, round(t(lambda: m.logits(hidden2(m, tok.reshape(-1, 1), kv, pos))), 2))
