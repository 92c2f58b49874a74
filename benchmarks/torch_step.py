#!/usr/bin/env python3
"""PyTorch's training step for the models of cpd-train, timed the way bench_train_step times
CPD's: forward + cross-entropy + backward + SGD (momentum 0.9, weight decay 5e-4) on one fixed
random batch, median over --steps after --warmup. Prints one line: `torch <arch> <batch>
<threads> <ms/step>`.

    torch_step.py --arch lenet5|mlp|resnet<6n+2>|gpt|lstm --batch 128 --threads 2 [--steps 30]
                  [--device cuda] [--block-size 128]

(resnet<6n+2>: the CIFAR ResNets of cpd-train, e.g. resnet20, resnet56.)

gpt and lstm are cpd-train's default language models (4 layers, 4 heads, width 128, byte-level
vocabulary 256, tied head; nanoGPT's GPT with exact GELU and biases, and an LSTM language model)
on --batch windows of --block-size random tokens, trained with AdamW (lr 1e-3, weight decay 0.1
on the matrices) as bench_train_step does. Attention is torch's fused
F.scaled_dot_product_attention where the installed PyTorch has it (2.0 and later), else the
masked-softmax formulation (PyTorch 1.13 has no other).

Debian's python3-torch (PyTorch 1.13, CPU) is the CPU reference. With --device cuda the step runs
on the GPU in float32 with TF32 off (as CPD's CUDA path computes), timed until the GPU has
finished it (torch.cuda.synchronize); without a GPU the script prints one line starting with
"SKIP:" and exits 0.
"""
import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class LeNet5(nn.Module):
    def __init__(self, in_ch=1, size=28, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, 6, 5, padding=2 if size == 28 else 0)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetCifar(nn.Module):
    def __init__(self, depth=20, in_ch=3, classes=10):
        super().__init__()
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(in_ch, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        layers, cin = [], 16
        for stage, cout in enumerate([16, 32, 64]):
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                layers.append(BasicBlock(cin, cout, stride))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layers(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if hasattr(F, "scaled_dot_product_attention"):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = (q @ k.transpose(-2, -1)) * (1.0 / (k.size(-1) ** 0.5))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            o = F.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v
        return self.c_proj(o.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    def __init__(self, vocab=256, block=128, n_layer=4, n_head=4, n_embd=128):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        self.h = nn.Sequential(*[Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        return self.lm_head(self.ln_f(self.h(self.wte(idx) + self.wpe(pos))))


class LstmLm(nn.Module):
    def __init__(self, vocab=256, n_layer=4, n_embd=128):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.lstm = nn.LSTM(n_embd, n_embd, n_layer, batch_first=True)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        return self.lm_head(self.lstm(self.wte(idx))[0])


def build(arch, block=128):
    if arch == "gpt":
        return Gpt(block=block), None
    if arch == "lstm":
        return LstmLm(), None
    if arch == "lenet5":
        return LeNet5(), (1, 28, 28)
    if arch == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256),
                             nn.ReLU(), nn.Linear(256, 10)), (1, 28, 28)
    if arch.startswith("resnet"):
        return ResNetCifar(int(arch[6:])), (3, 32, 32)
    raise SystemExit(f"torch_step.py: unknown --arch {arch}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="lenet5")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--block-size", type=int, default=128)
    a = ap.parse_args()
    cuda = a.device == "cuda"
    if cuda:
        if not torch.cuda.is_available():
            print(f"SKIP: torch_step.py --device cuda: PyTorch {torch.__version__} (CUDA "
                  f"{torch.version.cuda}) sees no GPU")
            return
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model, shape = build(a.arch, a.block_size)
    model.train()
    if shape is None:  # a language model: token windows, a label per position
        x = torch.randint(0, 256, (a.batch, a.block_size))
        y = torch.randint(0, 256, (a.batch * a.block_size,))
    else:
        x = torch.randn(a.batch, *shape)
        y = torch.randint(0, 10, (a.batch,))
    if cuda:
        model, x, y = model.cuda(), x.cuda(), y.cuda()
    if shape is None:
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        others = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                                 {"params": others, "weight_decay": 0.0}], lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    times = []
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        if i >= a.warmup:
            times.append((t1 - t0) * 1e3)
    print(f"torch {a.arch} {a.batch} {a.threads} {statistics.median(times):.3f}")


if __name__ == "__main__":
    main()
