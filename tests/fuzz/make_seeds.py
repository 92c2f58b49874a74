#!/usr/bin/env python3
"""Writes the seed corpus of every fuzz target into tests/fuzz/corpus/<target>/ (small, valid
inputs and a few near misses, so that the fuzzer starts past the first checks). Run from the
repository root: python3 tests/fuzz/make_seeds.py. Needs protoc (protobuf-compiler) for the
coordinator's requests, which it encodes from text with protoc --encode."""
import gzip
import json
import os
import struct
import subprocess
import zlib

ROOT = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(ROOT, "corpus")


def put(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def floats(values):
    return b"".join(struct.pack("<f", v) if not isinstance(v, int) else struct.pack("<I", v)
                    for v in values)


# ---- format_fuzz: mode, u64 channels, u32 seed, spec NUL, float32 data ---------------------------
DATA = [0.0, -0.0, 1.0, -1.5, 3.14159, -1000.0, 1e30, -1e-30, 448.0, 0.0625, 7.5e-8, -2.0,
        0x7fc00000, 0xffc00000, 0x7f800000, 0xff800000]
SPECS = ["fp32", "bf16", "fp16", "e4m3", "e4m3:inf", "e5m2:inf", "e3m2", "e2m1", "e3m0:inf",
         "e2m5:nosub", "fp134", "fp143:room=3:ch", "log4", "int8", "int4:ch", "uint4:minmax",
         "uint8:minmax:ch", "mxfp8", "mxfp4", "bfp8:16", "bfp4:7"]
for i, spec in enumerate(SPECS):
    for rounding in (0, 1):
        head = struct.pack("<BQI", rounding | (i % 4) << 2, 4, 7 + i)
        put("format_fuzz", "%s-%d" % (spec.replace(":", "_").replace("=", ""), rounding),
            head + spec.encode() + b"\0" + floats(DATA))
put("format_fuzz", "huge-channels", struct.pack("<BQI", 0x80, 1 << 62, 1) + b"int8:ch\0")

# ---- checkpoints: the tiny model of checkpoint_fuzz.cc (fc1 4->3, fc2 3->2, SGD momentum,
# log4 weights with hysteresis), 64 samples in batches of 16: 4 batches per epoch --------------
TENSORS = [("param/fc1.weight", [3, 4]), ("param/fc1.bias", [3]), ("param/fc2.weight", [2, 3]),
           ("param/fc2.bias", [2]), ("momentum/fc1.weight", [3, 4]), ("momentum/fc1.bias", [3]),
           ("momentum/fc2.weight", [2, 3]), ("momentum/fc2.bias", [2]), ("hyst/fc1", [12]),
           ("hyst/fc2", [6])]


def checkpoint_parts(step=5, epoch=1, it=(1, 1)):
    meta = {"version": 1, "step": step, "epoch": epoch,
            "iterator": {"epoch": it[0], "next_batch": it[1]}, "arch": "tiny",
            "dataset": "synthetic", "global_batch": 16, "seed": 1}
    entries, payload, offset = [], b"", 0
    for k, (name, shape) in enumerate(TENSORS):
        count = 1
        for d in shape:
            count *= d
        entries.append({"name": name.replace("momentum/", "opt/momentum/"), "shape": shape,
                        "offset": offset, "count": count})
        payload += floats([0.125 * ((k + j) % 7) - 0.25 for j in range(count)])
        offset += 4 * count
    header = json.dumps({"meta": meta, "tensors": entries}, separators=(",", ":")).encode()
    return header, payload


def checkpoint_file(header, payload):
    body = b"CPDCKPT1" + struct.pack("<Q", len(header)) + header + payload
    return body + struct.pack("<I", zlib.crc32(body) & 0xffffffff)


header, payload = checkpoint_parts()
put("checkpoint_fuzz", "valid", header + b"\0" + payload)
put("checkpoint_fuzz", "epoch-end", checkpoint_parts(8, 2, (1, 4))[0] + b"\0" + payload)
put("checkpoint_fuzz", "start", checkpoint_parts(0, 0, (0, 0))[0] + b"\0" + payload)
put("checkpoint_raw_fuzz", "valid", checkpoint_file(header, payload))
put("checkpoint_raw_fuzz", "truncated", checkpoint_file(header, payload)[:90])
put("checkpoint_raw_fuzz", "bad-crc", checkpoint_file(header, payload)[:-1] + b"\0")


# ---- idx_fuzz: mode (bit 0: gzip images, bit 1: gzip labels), u16 split, images + labels ------
def idx_images(n, rows, cols):
    return struct.pack(">IIII", 0x803, n, rows, cols) + bytes((i * 37) % 256
                                                              for i in range(n * rows * cols))


def idx_labels(n):
    return struct.pack(">II", 0x801, n) + bytes(i % 10 for i in range(n))


img, lab = idx_images(3, 4, 5), idx_labels(3)
for mode in range(4):
    put("idx_fuzz", "pair-%d" % mode, struct.pack("<BH", mode, len(img)) + img + lab)
put("idx_fuzz", "gzip-bytes", struct.pack("<BH", 0, 40) + gzip.compress(img)[:40] + lab)

# ---- token_stream_fuzz: a GPT-2 token file (nanoGPT raw uint16, or llm.c's header + tokens) ---
toks = struct.pack("<12H", *[(i * 4099) % 50257 for i in range(12)])
put("token_stream_fuzz", "nanogpt", toks)
put("token_stream_fuzz", "llmc", struct.pack("<256i", 20240520, 1, 12, *([0] * 253)) + toks)
put("token_stream_fuzz", "llmc-truncated",
    struct.pack("<256i", 20240520, 1, 13, *([0] * 253)) + toks)
put("token_stream_fuzz", "out-of-vocab", struct.pack("<3H", 1, 50257, 2))

# ---- cifar_fuzz: mode (bit 0: CIFAR-100, bit 1: gzip), records --------------------------------
rec10 = bytes([3]) + bytes((i * 13) % 256 for i in range(3072))
rec100 = bytes([7, 42]) + bytes((i * 11) % 256 for i in range(3072))
put("cifar_fuzz", "cifar10", b"\0" + rec10)
put("cifar_fuzz", "cifar100", b"\1" + rec100)
put("cifar_fuzz", "cifar10-gzip", b"\2" + rec10)
put("cifar_fuzz", "short", b"\0" + rec10[:100])

# ---- train_config_fuzz: YAML ----------------------------------------------------------------
configs = {
    "basic": "dataset: synthetic\narch: mlp\nmax-steps: 9\nstats-every: 1\nquiet: true\n",
    "precision": "w-format: e4m3\na-format: fp134\ne-format: e5m2\ne-rounding: stochastic\n"
                 "layer-format: [conv1.W=fp32, fc1.A=int8]\nkeep-fp32: first,last\n",
    "cpt": "preset: cpt\ncyclic-bits: [3, 8]\ncyclic-periods: 8\ngrad-bits: 6\nepochs: 2\n",
    "parallel": "emulate-ranks: 4\nglobal-batch: 128\nallreduce: packed\n"
                "allreduce-format: e4m3\naps: true\nbucket-mb: 4\nmax-skipped-steps: 3\n",
    "control": "coordinator: 127.0.0.1:50051\njob-name: run-1\nreport-interval: 0.5\n",
    "bad": "epochs: [1, 2]\nlr: fast\n",
}
for name, text in configs.items():
    put("train_config_fuzz", name, text)

# ---- coordinator_validate_fuzz: a request byte, then the message's wire form ------------------
PROTO = os.path.join(ROOT, "..", "..", "proto")
requests = [
    (0, "RegisterJobRequest",
     'job_name: "lenet-1" world_size: 2 emulated_workers_per_rank: 1 '
     'workers { rank: 0 host: "h0" pid: 11 } workers { rank: 1 host: "h1" pid: 12 } '
     'layers { name: "fc1" kind: "Linear" quantizable: true params: 100 } '
     'schedule { formats { site: SITE_W spec: "e4m3" rounding: "nearest" } grad_bits: 8 } '
     'arch: "lenet5" dataset: "fashion-mnist" total_steps: 100 epochs: 1 allreduce: "fp32"'),
    (1, "StatsReport",
     'job_id: 1 step: 10 epoch: 1 loss: 0.5 lr: 0.05 bits: 8 images_per_s: 100 ranks_alive: 2 '
     'train_accuracy: -1 test_accuracy: 0.9 time_ms: 1700000000000 '
     'layers { layer: "fc1" site: SITE_W format: "e4m3" bits: 8 max_abs: 1.5 saturated: 0.01 '
     'flushed: 0.2 rel_error: 0.03 } layers { layer: "fc1" site: SITE_COMM aps_shift: 9 }'),
    (2, "SetScheduleRequest",
     'job { job_name: "lenet-1" } schedule { effective_from_step: 40 '
     'cyclic { min_bits: 3 max_bits: 8 periods: 8 } grad_bits: 6 '
     'overrides { layer: "fc2" site: SITE_E spec: "fp16" } keep_fp32: "last" } '
     'expected_version: 1'),
    (3, "SetScheduleRequest",
     'job { job_id: 3 } schedule { formats { site: SITE_A spec: "fp134:room=2" } '
     'overrides { layer: "fc1" site: SITE_W spec: "log4" } hysteresis: true }'),
    (4, "LayerStatsRequest", 'job { job_name: "lenet-1" } from_step: 5 to_step: 50 limit: 10'),
    (5, "JobHistoryRequest", 'job { job_id: 7 } from_step: 0 to_step: 100 with_layers: true'),
    (6, "JobRef", 'job_name: "lenet-1"'),
    (8, None, "lenet-1.run_2"),
]
for kind, message, text in requests:
    if message is None:
        data = text.encode()
    else:
        data = subprocess.run(["protoc", "-I", PROTO, "--encode=cpd.v1." + message,
                               "cpd/v1/coordinator.proto"], input=text.encode(),
                              stdout=subprocess.PIPE, check=True).stdout
    put("coordinator_validate_fuzz", "%d-%s" % (kind, message or "name"), bytes([kind]) + data)

# ---- format_search_partial_fuzz: a mode byte, then the partial file's rows (bit 0: the target
# writes this search's settings line and header first; bits 1-3: site sets A, E, A+E; bits 4-5:
# layers), or with bit 6 a --candidates-file -----------------------------------------------------
def search_row(spec, bits, family, angles, base=1.5):
    values = ["%.17g" % (base + 0.25 * i if i % 2 == 0 else 0.125) for i in range(angles)]
    return '"%s",%d,%s,%s\n' % (spec, bits, family, ",".join(values))


a_two_layers = 0x01 | (2 << 4)           # site set A, layers fc1 and conv2: 2 * 3 angles
all_one_layer = 0x01 | 0x0e | (1 << 4)   # A, E and A+E, layer fc1: 2 * 3 * 2 angles
rows = search_row("int8", 8, "int", 6) + search_row("binades:4x7,3,2,1,0", 8, "float", 6, 3.0)
put("format_search_partial_fuzz", "rows", bytes([a_two_layers]) + rows.encode())
put("format_search_partial_fuzz", "all-sites",
    bytes([all_one_layer]) + (search_row("e4m3", 8, "float", 12) +
                              search_row("fp32", 32, "fp32", 12, 0.0) +
                              search_row("bfp8:16", 8, "block", 12)).encode())
put("format_search_partial_fuzz", "torn", bytes([a_two_layers]) + rows.encode()[:-9])
put("format_search_partial_fuzz", "negative",
    bytes([a_two_layers]) + search_row("int8", 8, "int", 6, -1.0).encode())
put("format_search_partial_fuzz", "nan", bytes([a_two_layers]) +
    search_row("int8", 8, "int", 6).replace("1.5", "nan").encode())
put("format_search_partial_fuzz", "twice", bytes([a_two_layers]) + (rows + rows).encode())
put("format_search_partial_fuzz", "old-file",
    b'\0# cpd-format-search: {"batches":2,"checkpoint":"ck.cpd","seed":1}\n'
    b'spec,bits,family,A_deg,A_std\n"int8",8,int,1.5,0.125\n')
put("format_search_partial_fuzz", "candidates",
    b"\x40# a list\nbinades:4x7,3,2,1,0\n  e4m3  # fp8\r\n\nint8:ch\n")


# ---- token_file_fuzz: a token file's bytes (the first line is the token) -------------------------
TOKENS = [
    ("plain", b"s3cret-token\n"),
    ("spaces", b"  s3cret token with spaces \r\nsecond line\n"),
    ("no-newline", b"abc"),
    ("empty-line", b"   \ntoken-on-line-2\n"),
    ("tab", b"s3cret\ttoken\n"),
    ("control", b"s3cret\x01token\n"),
    ("non-ascii", "s3cr\u00e9t\n".encode()),
    ("nul", b"s3cret\x00token\n"),
    ("del", b"s3cret\x7f"),
    ("max", b"t" * 4096 + b"\n"),
    ("too-long", b"t" * 4097 + b"\n"),
]
for name, data in TOKENS:
    put("token_file_fuzz", name, data)


# ---- study_file_fuzz: a cpd-study study file (YAML) --------------------------------------------
studies = {
    "basic": "name: s\nbase:\n  arch: mlp\n  dataset: synthetic\n  max-steps: 4\n"
             "grid:\n  lr: [0.05, 0.1]\nseeds: [1, 2]\n",
    "full": "name: aps-large-batch\nranks: 2\nbase:\n  arch: lenet5\n  epochs: 10\n"
            "  optimizer: lars\n  allreduce: emulate\ngrid:\n  global-batch: [512, 2048]\n"
            "  workers: [8, 32]\n  allreduce-format: [fp32, e4m3]\n  aps: [false, true]\n"
            "seeds: [1, 2, 3]\nexclude:\n  - {allreduce-format: fp32, aps: true}\n",
    "lists": "name: cpt\nbase:\n  preset: cpt\ngrid:\n  cyclic-bits: [[3, 8], [4, 8]]\n"
             "  layer-format: [[conv1.W=fp32], [fc1.A=int8]]\n",
    "repeated": "name: s\ngrid:\n  lr: [0.1]\n  lr: [0.2]\n",
    "dotdot": "name: ..\ngrid:\n  lr: [0.1]\n",
    "print-model": "name: s\nbase:\n  print-model: true\ngrid:\n  lr: [0.1]\n",
    "bad": "name: s\ngrid:\n  optimizer: [sgd, adam]\n  epochs: [1, abc]\n",
}
for name, text in studies.items():
    put("study_file_fuzz", name, text)
# The input that found yaml-cpp's message quoting a newline (an unknown escape) in the refusal.
put("study_file_fuzz", "bad-escape", b"\n l[\x1a\xe6: 0.2]\x02\x00\n")
# The input (CI's fuzz stage) that found CLI11 echoing a value spread over lines by a YAML flow
# scalar in cpd-train's config error (launcher/train_flags.cc ApplyConfigEntries).
put("study_file_fuzz", "multi-line-value",
    b"name: s\nbase:\n  max-steps: 2\ngrid:\n  lr: [0.0~." + b"\n" * 21 + b"  2\xff\xff]\n")
put("study_file_fuzz", "multi-line-layer-format",
    b"name: cpt\nbase:\n  preset: cpt\ngrid:\n  cyclic-bits: [[3, 8], [4, 8]]\n"
    b"  layer-format: [[conv1.W.=fpc1.DA=i" + b"\xa1" * 12 + b"\n\nt8]]\n")

# ---- run_state_fuzz: a run's state.json ---------------------------------------------------------
states = {
    "done": {"state": "done", "exit_code": 0, "start_ms": 1700000000000, "end_ms": 1700000005000,
             "wall_s": 5.0, "total_wall_s": 7.5, "attempts": 2, "host": "node1", "pid": 0},
    "running": {"state": "running", "exit_code": -1, "start_ms": 1700000000000, "end_ms": 0,
                "wall_s": 0, "total_wall_s": 0, "attempts": 1, "host": "node1", "pid": 4242},
    "diverged": {"state": "diverged", "exit_code": 3, "start_ms": 1, "end_ms": 2, "wall_s": 0.5,
                 "total_wall_s": 0.5, "attempts": 1, "host": "h", "pid": 0, "diverged_step": 12,
                 "diverged_loss": 7.6e10, "diverged_reason": "the loss is NaN"},
    "failed-3": {"state": "failed", "exit_code": 3, "attempts": 1},
}
for name, j in states.items():
    put("run_state_fuzz", name, json.dumps(j, indent=1) + "\n")
put("run_state_fuzz", "truncated", json.dumps(states["done"])[:40])
put("run_state_fuzz", "float-count", '{"state": "done", "attempts": 1e300}\n')
