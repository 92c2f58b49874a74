#!/usr/bin/python3
"""PyTorch as the reference of CPD's language-model layers (runtime/nn/transformer.h, recurrent.h).

    torch_reference_test.py DUMP_EXE WORK_DIR

Runs DUMP_EXE (tests/runtime/nn/transformer_reference_dump.cc), which writes the forward and
backward of LayerNorm, GELU, CausalSelfAttention, TransformerBlock, a two-layer LSTM, two two-block
GPTs and two LSTM language models with their per-token cross-entropy, with their weights and
inputs, to WORK_DIR/transformer_reference.json. Recomputes each case in PyTorch (nanoGPT's
formulation; torch.nn.LSTM itself, batch_first, for the LSTM; float32 on the CPU) from the same
weights and inputs, and compares the output (or loss), dL/dx and every parameter gradient.

The bound: each tensor's error is measured norm-wise, ||cpd - torch|| / ||torch|| (2-norms). Both
sides round every operation to float32 (unit roundoff u = 2^-24 = 6e-8) but sum in different
orders, so each differs from the exact result by a few u times the condition of the computation
(sums of up to ~100 terms here, softmax and LayerNorm divisions, two blocks deep, 16 timesteps of
a recurrence). The same
computation in float64 shows how large that is for PyTorch itself: its own float32 error is
printed beside CPD's, and CPD must stay within 1e-5 (~170 u) of PyTorch, and within 10 times
PyTorch's own error against float64 plus 1e-6 of float64. A wrong formula (a missing mask, the
tanh GELU, a biased/unbiased variance mix-up, LSTM gates in another order) shows as errors of 1e-3
and more.

Torch is Debian's python3-torch (1.13, CPU), installed with apt-get on first use when this runs
as root with a network; otherwise the test exits 77 (ctest: skipped).
"""
import json
import math
import os
import shutil
import subprocess
import sys

SKIP = 77
BOUND_VS_TORCH = 1e-5
BOUND_VS_FLOAT64_FACTOR = 10.0
BOUND_VS_FLOAT64_FLOOR = 1e-6


def import_torch():
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


def ensure_torch():
    if import_torch():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        print("SKIP: python3-torch is not installed (apt-get install python3-torch, as root)")
        sys.exit(SKIP)
    res = subprocess.run(["apt-get", "install", "-y", "python3-torch"], capture_output=True,
                         text=True)
    if res.returncode != 0 or not import_torch():
        # Retry once after refreshing the package lists (a fresh container has none).
        subprocess.run(["apt-get", "update"], capture_output=True, text=True)
        res = subprocess.run(["apt-get", "install", "-y", "python3-torch"], capture_output=True,
                             text=True)
    if res.returncode != 0 or not import_torch():
        print(f"SKIP: could not install python3-torch: {res.stderr.strip()[-300:]}")
        sys.exit(SKIP)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    exe, work = sys.argv[1], sys.argv[2]
    ensure_torch()
    import torch
    import torch.nn.functional as F

    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, "transformer_reference.json")
    subprocess.run([exe, path], check=True)
    with open(path) as f:
        cases = json.load(f)["cases"]

    def tensor(t, dtype):
        return torch.tensor(t["data"], dtype=dtype).reshape(t["shape"])

    def linear(p, name, x):
        bias = p.get(name + ".bias")
        return F.linear(x, p[name + ".weight"], bias)

    def attention(p, name, x, heads):
        b, t, c = x.shape
        d = c // heads
        q, k, v = linear(p, name + ".c_attn", x).split(c, dim=2)
        q, k, v = (z.view(b, t, heads, d).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return linear(p, name + ".c_proj", y)

    def layer_norm(p, name, x):
        return F.layer_norm(x, (x.shape[-1],), p[name + ".weight"], p[name + ".bias"], 1e-5)

    def block(p, name, x, heads):
        x = x + attention(p, name + ".attn", layer_norm(p, name + ".ln_1", x), heads)
        h = layer_norm(p, name + ".ln_2", x)
        h = linear(p, name + ".mlp.c_proj", F.gelu(linear(p, name + ".mlp.c_fc", h)))
        return x + h

    def lstm(p, name, x, cfg, modules):
        """torch.nn.LSTM over x [B, T, C] with the weights p[NAME.weight_ih_l0] ... (its own
        parameters, copied in: their gradients are copied back to p after the backward)."""
        m = torch.nn.LSTM(cfg["input"], cfg["hidden"], cfg["layers"], batch_first=True)
        m = m.to(x.dtype)
        with torch.no_grad():
            for k, v in m.named_parameters():
                v.copy_(p[name + "." + k])
        modules.append((name, m))
        return m(x)[0]

    def lstm_lm(p, case, modules):
        cfg = case["config"]
        ids = tensor(case["ids"], torch.float64).long()
        y = lstm(p, "lstm", p["wte.weight"][ids], cfg, modules)
        head = p["wte.weight"] if cfg["tied"] else p["lm_head.weight"]
        logits = F.linear(y, head)
        labels = torch.tensor(case["labels"], dtype=torch.long)
        return F.cross_entropy(logits.view(-1, cfg["vocab"]), labels), logits

    def gpt(p, case, dtype):
        cfg = case["config"]
        ids = tensor(case["ids"], torch.float64).long()
        t = ids.shape[1]
        x = p["wte.weight"][ids] + p["wpe.weight"][:t]
        for i in range(cfg["layers"]):
            x = block(p, f"h{i}", x, cfg["heads"])
        x = layer_norm(p, "ln_f", x)
        head = p["wte.weight"] if cfg["tied"] else p["lm_head.weight"]
        logits = F.linear(x, head)
        labels = torch.tensor(case["labels"], dtype=torch.long)
        return F.cross_entropy(logits.view(-1, cfg["vocab"]), labels), logits

    def run(case, dtype):
        """The case's outputs and gradients in torch, at `dtype`."""
        p = {k: tensor(v, dtype).requires_grad_() for k, v in case["params"].items()}
        out = {}
        modules = []  # (name, torch module) whose parameters stand in for p's
        if case["kind"] in ("gpt", "lstm_lm"):
            loss, logits = (gpt(p, case, dtype) if case["kind"] == "gpt" else
                            lstm_lm(p, case, modules))
            loss.backward()
            out["loss"] = loss.detach().reshape(1)
            out["logits"] = logits.detach()
        else:
            x = tensor(case["x"], dtype).requires_grad_()
            heads = case["config"].get("heads")
            kind = case["kind"]
            if kind == "lstm":
                y = lstm(p, "lstm", x, case["config"], modules)
            elif kind == "layernorm":
                y = layer_norm(p, "ln", x)
            elif kind == "gelu":
                y = F.gelu(x)
            elif kind == "attention":
                y = attention(p, "attn", x, heads)
            else:
                y = block(p, "h0", x, heads)
            (y * tensor(case["dy"], dtype)).sum().backward()
            out["y"] = y.detach()
            out["dx"] = x.grad
        for name, m in modules:
            for k, v in m.named_parameters():
                p[name + "." + k].grad = v.grad
        for k, v in p.items():
            out["grad " + k] = v.grad
        return out

    def cpd(case):
        out = {}
        if case["kind"] in ("gpt", "lstm_lm"):
            out["loss"] = torch.tensor([case["loss"]], dtype=torch.float64)
            out["logits"] = tensor(case["logits"], torch.float64)
        else:
            out["y"] = tensor(case["y"], torch.float64)
            out["dx"] = tensor(case["dx"], torch.float64)
        for k, v in case["grads"].items():
            out["grad " + k] = tensor(v, torch.float64)
        return out

    def rel(a, b):
        a, b = a.double(), b.double()
        return float((a - b).norm() / max(float(b.norm()), 1e-30))

    failures = 0
    for case in cases:
        name = case["kind"] + (("-tied" if case["config"]["tied"] else "-untied")
                               if case["kind"] in ("gpt", "lstm_lm") else "")
        ours, t32, t64 = cpd(case), run(case, torch.float32), run(case, torch.float64)
        if set(ours) != set(t32):
            print(f"FAIL {name}: CPD reports {sorted(set(ours) ^ set(t32))} differently")
            failures += 1
            continue
        worst = (0.0, "")
        for key in sorted(ours):
            e_torch, e_64, e_t64 = rel(ours[key], t32[key]), rel(ours[key], t64[key]), rel(
                t32[key], t64[key])
            bound_64 = BOUND_VS_FLOAT64_FACTOR * e_t64 + BOUND_VS_FLOAT64_FLOOR
            ok = e_torch <= BOUND_VS_TORCH and e_64 <= bound_64
            if not ok:
                failures += 1
                print(f"FAIL {name} {key}: vs torch float32 {e_torch:.2e} (bound "
                      f"{BOUND_VS_TORCH:.0e}), vs float64 {e_64:.2e} (bound {bound_64:.2e}; "
                      f"torch float32 vs float64 {e_t64:.2e})")
            worst = max(worst, (e_torch, key))
        print(f"{name}: {len(ours)} tensors, worst relative error vs torch float32 "
              f"{worst[0]:.2e} ({worst[1]})")
    if failures:
        print(f"{failures} tensor(s) out of bounds")
        sys.exit(1)
    print("all within bounds")


if __name__ == "__main__":
    main()
