#!/usr/bin/python3
"""PyTorch as the reference of CPD's AdamW and gradient clipping (runtime/nn/optimizer.h).

    optimizer_torch_test.py DUMP_EXE WORK_DIR

Runs DUMP_EXE (tests/runtime/nn/optimizer_reference_dump.cc), which writes six steps of CPD's
AdamW (with and without clipping by the global gradient norm) and of clipping alone, on fixed
params and gradients, to WORK_DIR/optimizer_reference.json. Replays them in PyTorch from the same
values: torch.nn.utils.clip_grad_norm_ on the gradients, then torch.optim.AdamW with two param
groups as nanoGPT builds them (the decayed params at the case's weight decay, the others at 0),
the lr of each step set in both groups, float32 on the CPU. The same replay in float64 shows how
far float32 itself is from the exact result.

Compared per step: the pre-clip norm, the clipped gradients and the params; at the end AdamW's
m (exp_avg), v (exp_avg_sq) and step count. Params are compared by their change from the start,
||dw_cpd - dw_torch|| / ||dw_torch||, so that the update itself is measured and not hidden
under the params' size. Both sides round every operation to float32 (u = 6e-8) in nearly the
same order (torch may fuse a product into its add), so CPD must stay within 1e-5 of torch's
float32 (the update m / (sqrt(v) + eps) divides by small denominators: a few hundred u), and
within 10 times torch's own float32 error against float64 plus 1e-6. A wrong rule (coupled
decay, no bias correction, eps inside the sqrt, the clipping coefficient unclamped) shows as
errors of 1e-3 and more. Clipping at a max_norm above the norm must leave the gradients as they
were bit for bit, as in torch (a multiplication by 1.0).

Torch is Debian's python3-torch, as in torch_reference_test.py (exit 77, skipped, without it).
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference_test import ensure_torch  # noqa: E402

BOUND_VS_TORCH = 1e-5
BOUND_VS_FLOAT64_FACTOR = 10.0
BOUND_VS_FLOAT64_FLOOR = 1e-6


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    exe, work = sys.argv[1], sys.argv[2]
    ensure_torch()
    import torch

    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, "optimizer_reference.json")
    subprocess.run([exe, path], check=True)
    with open(path) as f:
        cases = json.load(f)["cases"]

    def tensor(t, dtype):
        return torch.tensor(t["data"], dtype=dtype).reshape(t["shape"])

    def replay(case, dtype):
        """The case in torch at `dtype`: per step (norm, clipped grads, params); final state."""
        names = list(case["params"])
        p = {k: tensor(case["params"][k], dtype).requires_grad_() for k in names}
        decay = [p[k] for k in names if case["decay"][k]]
        rest = [p[k] for k in names if not case["decay"][k]]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": case["weight_decay"]},
             {"params": rest, "weight_decay": 0.0}],
            lr=1.0, betas=(case["beta1"], case["beta2"]), eps=case["eps"])
        steps = []
        for st in case["steps"]:
            for k in names:
                p[k].grad = tensor(st["grads"][k], dtype)
            norm = torch.nn.utils.clip_grad_norm_([p[k] for k in names],
                                                  case["max_norm"] or float("inf"))
            clipped = {k: p[k].grad.clone() for k in names}
            if case["update"]:
                for group in opt.param_groups:
                    group["lr"] = st["lr"]
                opt.step()
            steps.append((float(norm), clipped, {k: p[k].detach().clone() for k in names}))
        state = {}
        for k in names:
            s = opt.state.get(p[k], {})
            if s:
                state["adamw_m/" + k] = s["exp_avg"]
                state["adamw_v/" + k] = s["exp_avg_sq"]
                state["step"] = int(s["step"])
        return steps, state

    def rel(a, b):
        a, b = a.double(), b.double()
        return float((a - b).norm() / max(float(b.norm()), 1e-30))

    failures = 0

    def check(name, key, ours, t32, t64):
        nonlocal failures
        e_torch, e_64, e_t64 = rel(ours, t32), rel(ours, t64), rel(t32, t64)
        bound_64 = BOUND_VS_FLOAT64_FACTOR * e_t64 + BOUND_VS_FLOAT64_FLOOR
        if not (e_torch <= BOUND_VS_TORCH and e_64 <= bound_64):
            failures += 1
            print(f"FAIL {name} {key}: vs torch float32 {e_torch:.2e} (bound "
                  f"{BOUND_VS_TORCH:.0e}), vs float64 {e_64:.2e} (bound {bound_64:.2e}; torch "
                  f"float32 vs float64 {e_t64:.2e})")
        return e_torch

    for case in cases:
        name = case["name"]
        s32, state32 = replay(case, torch.float32)
        s64, state64 = replay(case, torch.float64)
        init = {k: tensor(v, torch.float64) for k, v in case["params"].items()}
        worst = (0.0, "")
        for i, st in enumerate(case["steps"]):
            norm = torch.tensor([st["norm"]], dtype=torch.float64)
            e = check(name, f"step {i} norm", norm, torch.tensor([s32[i][0]]),
                      torch.tensor([s64[i][0]], dtype=torch.float64))
            worst = max(worst, (e, f"step {i} norm"))
            clips = s64[i][0] > case["max_norm"] > 0
            for k in case["params"]:
                ours = tensor(st["clipped"][k], torch.float32)
                if not clips and not torch.equal(ours, tensor(st["grads"][k], torch.float32)):
                    failures += 1
                    print(f"FAIL {name} step {i} {k}: no clipping at norm {st['norm']:.4g} <= "
                          f"{case['max_norm']} changed the gradient")
                key = f"step {i} grad {k}"
                worst = max(worst, (check(name, key, ours, s32[i][1][k], s64[i][1][k]), key))
                if case["update"]:
                    key = f"step {i} dw {k}"
                    dw = tensor(st["params"][k], torch.float64) - init[k]
                    e = check(name, key, dw, s32[i][2][k].double() - init[k],
                              s64[i][2][k] - init[k])
                    worst = max(worst, (e, key))
        if case["update"]:
            if case["adam_steps"] != state32["step"]:
                failures += 1
                print(f"FAIL {name}: {case['adam_steps']} steps, torch {state32['step']}")
            for key, t in case["state"].items():
                if key == "adamw_step":
                    continue
                e = check(name, key, tensor(t, torch.float64), state32[key], state64[key])
                worst = max(worst, (e, key))
        print(f"{name}: worst relative error vs torch float32 {worst[0]:.2e} ({worst[1]})")
    if failures:
        print(f"{failures} value(s) out of bounds")
        sys.exit(1)
    print("all within bounds")


if __name__ == "__main__":
    main()
