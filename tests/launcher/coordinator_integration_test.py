#!/usr/bin/env python3
"""The control plane end to end, with the real programs on loopback.

Starts cpd-coordinator (SQLite file, token), runs a 2-rank `mpirun` cpd-train against it, and
checks with cpdctl:
  * `schedule set` mid-run (with --from-step in the future): every rank switches at that step
    (asserted from each rank's metrics), the per-layer all-reduce format (hybrid precision:
    first=fp32) included: the first layer's gradient goes from e4m3 to fp32 there;
  * `layers` shows every quantisable layer at every site, and the all-reduce rows;
  * the coordinator is killed (SIGKILL) mid-run: training goes on and finishes; the coordinator
    restarted on the same DB and port takes the job back (the worker re-registers) and `layers`
    and `export` return the whole history, from before the kill and after the restart;
  * a client without the token, or with a wrong one, is refused with one line and exit 1.

With CASE `study` instead: two cpd-train runs with --study register, `cpdctl study` lists both
with their state and test accuracy, a language model's run (a GPT on byte-level text) reports its
validation loss, perplexity and bits per byte (the metrics' numbers, in `cpdctl status` and in the
study's table where accuracy is), and a coordinator restarted on the same database still does.

usage: coordinator_integration_test.py BIN_DIR MPIRUN [control|study]
Every wait is bounded; the test stops by itself (exit 1 on the first failed check).
"""
import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

BIN, MPIRUN = sys.argv[1], sys.argv[2]
CASE = sys.argv[3] if len(sys.argv) > 3 else "control"
TMP = tempfile.mkdtemp(prefix="cpd_coord_it_")
TOKEN = os.path.join(TMP, "token")
DB = os.path.join(TMP, "coordinator.db")
JOB = "itest"
STEP_SLEEP_MS = 15  # paces training so that the test's calls land mid-run
EPOCHS = 12         # x 32 steps of 256 synthetic images
TOTAL_STEPS = EPOCHS * 32
procs = []


def fail(msg):
    print("FAIL: " + msg, flush=True)
    for p in procs:
        if p.poll() is None:
            p.kill()
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)
    print("ok: " + msg, flush=True)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_for(what, predicate, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    fail("timed out after %.0f s waiting for %s" % (timeout_s, what))


PORT = free_port()
ADDR = "127.0.0.1:%d" % PORT


def start_coordinator(tag):
    port_file = os.path.join(TMP, "port." + tag)
    log = open(os.path.join(TMP, "coordinator.%s.log" % tag), "w")
    p = subprocess.Popen([os.path.join(BIN, "cpd-coordinator"), "--listen", ADDR, "--db", DB,
                          "--token-file", TOKEN, "--port-file", port_file],
                         stdout=log, stderr=subprocess.STDOUT)
    procs.append(p)
    wait_for("the coordinator's port file", lambda: os.path.exists(port_file), 30)
    return p


def ctl(*args, token=TOKEN, expect_ok=True):
    cmd = [os.path.join(BIN, "cpdctl"), "--coordinator", ADDR, "--timeout", "5"]
    if token:
        cmd += ["--token-file", token]
    r = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=60)
    if expect_ok and r.returncode != 0:
        fail("cpdctl %s exited %d: %s" % (" ".join(args), r.returncode, r.stderr.strip()))
    return r


def ctl_json(*args):
    return json.loads(ctl("--json", *args).stdout)


def job_step():
    r = ctl("--json", "status", JOB, expect_ok=False)
    if r.returncode != 0:
        return None
    return json.loads(r.stdout)["job"].get("step", 0)


def write_token():
    with open(TOKEN, "w") as f:
        f.write("it-token-%d\n" % os.getpid())


def stop_all():
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=30)
    shutil.rmtree(TMP)
    print("PASS", flush=True)


def study_runs(study):
    r = ctl("--json", "study", study, expect_ok=False)
    return json.loads(r.stdout)["jobs"] if r.returncode == 0 else []


def language_model_run(study, name):
    """A tiny GPT on Debian's fortunes (2 epochs of 128 windows) reporting to the coordinator;
    returns its last epoch record."""
    metrics = os.path.join(TMP, name + ".jsonl")
    with open(os.path.join(TMP, name + ".log"), "w") as log:
        rc = subprocess.run(
            [os.path.join(BIN, "cpd-train"), "--arch", "gpt", "--dataset", "text", "--n-layer",
             "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--tokens-per-epoch",
             "2048", "--epochs", "2", "--batch-size", "8", "--threads", "1", "--no-progress",
             "--coordinator", ADDR, "--job-name", name, "--study", study, "--token-file", TOKEN,
             "--metrics-out", metrics], stdout=log, stderr=subprocess.STDOUT, timeout=300,
            env=dict(os.environ, OMP_NUM_THREADS="1")).returncode
    check(rc == 0, "%s (a GPT on text) finished with exit 0 (log in %s)" % (name, TMP))
    epochs = [json.loads(l) for l in open(metrics) if '"type":"epoch"' in l]
    check(len(epochs) == 2, "%s logged 2 epochs" % name)
    return epochs[-1]


def check_language_model(study, name, last):
    """The coordinator holds the run's validation figures exactly as its metrics logged them."""
    st = ctl_json("status", name)
    for key in ("test_loss", "test_perplexity", "test_bits_per_byte"):
        check(st[key] == last[key], "%s: status %s %r is the metrics' %r" %
              (name, key, st[key], last[key]))
    check(st["job"]["test_perplexity"] == last["test_perplexity"] and
          st["job"]["test_bits_per_byte"] == last["test_bits_per_byte"],
          "%s: the job summary carries its perplexity and bits per byte" % name)
    text = ctl("status", name).stdout
    want = "perplexity   %.2f (validation; %.3f bits/byte, loss %.4f)" % (
        last["test_perplexity"], last["test_bits_per_byte"], last["test_loss"])
    check(want in text, "cpdctl status shows %r" % want)
    table = ctl("study", study).stdout.splitlines()
    check(table[0].split()[4:7] == ["VAL", "PPL", "BPB"] and
          table[1].split()[8:10] == ["%.2f" % last["test_perplexity"],
                                     "%.3f" % last["test_bits_per_byte"]],
          "cpdctl study %s shows VAL PPL and BPB where accuracy is (%s)" % (study, table[:2]))


def study_case():
    """Two runs of one study, as a study driver launches them, and a coordinator restart."""
    write_token()
    coord = start_coordinator("first")
    study, names = "sweep1", ["sweep1.lr-0.05", "sweep1.lr-0.1"]
    runs = []
    for name, lr in zip(names, ("0.05", "0.1")):
        log = open(os.path.join(TMP, name + ".log"), "w")
        runs.append(subprocess.Popen(
            [os.path.join(BIN, "cpd-train"), "--arch", "mlp", "--dataset", "synthetic",
             "--epochs", "3", "--global-batch", "256", "--lr", lr, "--threads", "1",
             "--no-progress", "--report-interval", "0.2", "--coordinator", ADDR, "--job-name",
             name, "--study", study, "--token-file", TOKEN, "--debug-step-sleep-ms", "30"],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1")))
        procs.append(runs[-1])
    running = wait_for("both runs of the study to report",
                       lambda: len([j for j in study_runs(study) if j["state"] == "running" and
                                    j["last_report_ms"] > 0]) == 2, 120)
    check(running, "cpdctl study lists both runs as running while they train")
    for name, p in zip(names, runs):
        check(p.wait(timeout=300) == 0, "%s finished with exit 0 (log in %s)" % (name, TMP))

    def finished_table():
        jobs = study_runs(study)
        check(sorted(j["job_name"] for j in jobs) == names, "the study holds exactly its 2 runs")
        for j in jobs:
            check(j["study"] == study and j["state"] == "finished" and
                  0 < j["test_accuracy"] <= 1 and j["epoch"] >= 1 and j["epochs"] == 3,
                  "%s: finished, test accuracy %.4f, epoch %d / %d" %
                  (j["job_name"], j["test_accuracy"], j["epoch"], j["epochs"]))
        text = ctl("study", study).stdout
        check(all(n in text for n in names) and "2 runs: 0 running, 0 stale, 2 finished" in text,
              "the study's table lists both runs and the counts per state")
        return jobs

    before = finished_table()
    listing = ctl("study").stdout.splitlines()
    check(len(listing) == 2 and listing[1].split() == [study, "2", "0", "0", "2"],
          "cpdctl study lists the study with 2 finished runs (%s)" % listing)
    lm_study, lm_name = "lm1", "lm1.gpt"
    lm_last = language_model_run(lm_study, lm_name)
    check_language_model(lm_study, lm_name, lm_last)

    # Restarted on the same database: the same runs, states and accuracies.
    coord.send_signal(signal.SIGTERM)
    coord.wait(timeout=30)
    start_coordinator("second")
    after = finished_table()
    key = lambda jobs: [(j["job_name"], j["state"], j["test_accuracy"], j["step"]) for j in jobs]
    check(key(after) == key(before), "the restarted coordinator lists the same runs")
    check_language_model(lm_study, lm_name, lm_last)
    stop_all()


def main():
    if CASE == "study":
        study_case()
        return
    write_token()
    coord = start_coordinator("first")

    # The model's quantisable layers, by name.
    desc = subprocess.run([os.path.join(BIN, "cpd-train"), "--arch", "mlp", "--dataset",
                           "synthetic", "--print-model"], capture_output=True, text=True,
                          check=True).stdout
    layers = [l.split()[0] for l in desc.splitlines() if " Linear " in l]
    check(layers == ["fc1", "fc2", "fc3"], "the mlp's quantisable layers are fc1, fc2, fc3")

    metrics = os.path.join(TMP, "metrics.{rank}.jsonl")
    train_log = open(os.path.join(TMP, "train.log"), "w")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    train = subprocess.Popen(
        [MPIRUN] + root + ["--oversubscribe", "--bind-to", "none", "-np", "2",
                           os.path.join(BIN, "cpd-train"), "--arch", "mlp", "--dataset",
                           "synthetic", "--epochs", str(EPOCHS), "--global-batch", "256",
                           "--threads", "1", "--no-progress", "--w-format", "e4m3",
                           "--a-format", "e4m3", "--e-format", "e5m2", "--g-format", "e5m2",
                           "--allreduce", "packed", "--allreduce-format", "e4m3", "--aps",
                           "--stats-every", "10", "--report-interval", "0.2",
                           "--coordinator", ADDR, "--job-name", JOB, "--token-file", TOKEN,
                           "--metrics-out", metrics,
                           "--debug-step-sleep-ms", str(STEP_SLEEP_MS)],
        stdout=train_log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    procs.append(train)

    # 1. The job registers and reports.
    step = wait_for("the job to report step >= 20", lambda: (job_step() or 0) >= 20 and
                    job_step(), 120)
    jobs = ctl_json("jobs")["jobs"]
    check(any(j["job_name"] == JOB and j["world_size"] == 2 for j in jobs),
          "cpdctl jobs lists the 2-rank job")

    # 2. A schedule set mid-run, effective at a step still ahead: every rank switches there.
    switch_at = step + 60
    sched = ctl_json("schedule", "set", JOB, "--cyclic-bits", "4", "6", "--cyclic-periods", "4",
                     "--allreduce-layer-format", "first=fp32", "--from-step", str(switch_at))
    version = sched.get("version") or sched.get("schedule", {}).get("version")
    check(version == 2, "schedule set answers version 2 (was %s)" % version)

    # 3. Kill the coordinator after the switch; training must go on.
    wait_for("step %d + 20" % switch_at, lambda: (job_step() or 0) >= switch_at + 20, 120)
    killed_at = job_step()
    coord.send_signal(signal.SIGKILL)
    coord.wait(timeout=10)
    time.sleep(1.5)
    check(train.poll() is None, "training goes on while the coordinator is down")
    r = ctl("jobs", expect_ok=False)
    check(r.returncode == 1 and "cannot reach" in r.stderr and r.stderr.count("\n") == 1,
          "cpdctl with the coordinator down: exit 1, one line (%r)" % r.stderr.strip())

    # 4. Restart on the same DB and port: the job comes back and the worker re-registers.
    start_coordinator("second")
    rc = train.wait(timeout=300)
    out = open(os.path.join(TMP, "train.log")).read()
    check(rc == 0, "training finished with exit 0 (log in %s)" % TMP)
    check("lost the coordinator" in out, "the worker said it lost the coordinator")
    check("re-registered job 'itest'" in out, "the worker re-registered after the restart")

    # Every rank switched at the same step, the one asked for.
    for rank in (0, 1):
        events = [json.loads(l) for l in open(metrics.replace("{rank}", str(rank)))]
        switches = [(e["step"], e["version"]) for e in events if e.get("type") == "schedule"]
        check(switches == [(switch_at, 2)],
              "rank %d switched to v2 at step %d (saw %s)" % (rank, switch_at, switches))
        bits = {e["step"]: e["bits"] for e in events if e.get("type") == "step"}
        check(all(b == 0 for s, b in bits.items() if s < switch_at) and
              all(4 <= b <= 6 for s, b in bits.items() if s >= switch_at),
              "rank %d: no CPT bits before the switch, 4-6 bits after" % rank)
        comm = {e["step"]: {c["layer"]: c["format"] for c in e["comm"]}
                for e in events if e.get("type") == "step" and "comm" in e}
        check(comm and all(f == {"fc1": "fp32" if s >= switch_at else "e4m3", "fc2": "e4m3",
                                 "fc3": "e4m3"} for s, f in comm.items()) and
              min(comm) < switch_at <= max(comm),
              "rank %d: fc1's all-reduce format is e4m3 before the switch, fp32 after" % rank)

    status = ctl_json("status", JOB)
    check(status["job"]["state"] == "finished", "the job is finished at the coordinator")
    check(status["schedule"]["version"] == 2, "the coordinator kept schedule v2 across restarts")

    # 5. Layers: every quantisable layer at every site, and the all-reduce's rows.
    latest = ctl_json("layers", JOB)["reports"][-1]
    seen = {(l["layer"], l["site"]) for l in latest["layers"]}
    for name in layers:
        for site in ("SITE_W", "SITE_A", "SITE_E", "SITE_G", "SITE_COMM"):
            if (name, site) not in seen:
                fail("cpdctl layers lacks %s %s (has %s)" % (name, site, sorted(seen)))
    check(True, "cpdctl layers shows fc1, fc2, fc3 at W, A, E, G and COMM")
    check(any(l["site"] == "SITE_W" and l["format"] == "uint%d:minmax:ch" % latest["bits"]
              for l in latest["layers"]), "the latest W rows carry the CPT format in force")
    comm_formats = {l["layer"]: l["format"] for l in latest["layers"] if l["site"] == "SITE_COMM"}
    check(comm_formats == {"fc1": "fp32", "fc2": "e4m3", "fc3": "e4m3"},
          "the latest COMM rows name each layer's all-reduce format (%s)" % comm_formats)

    # 6. Export: the whole history, from before the kill to the end.
    csv_path = os.path.join(TMP, "history.csv")
    ctl("export", JOB, "--csv", csv_path)
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    steps = sorted({int(r["step"]) for r in rows})
    check(steps[0] <= 10 and steps[-1] == TOTAL_STEPS - 1,
          "export spans steps %d..%d (0..%d expected)" % (steps[0], steps[-1], TOTAL_STEPS - 1))
    check(any(s < killed_at for s in steps) and any(s > killed_at + 40 for s in steps),
          "export holds reports from before the kill (step %d) and after the restart" % killed_at)
    step_rows = ctl_json("layers", JOB, "--from", "0", "--to", str(TOTAL_STEPS))["reports"]
    check(len({r["step"] for r in step_rows}) >= TOTAL_STEPS // 10 - 8,
          "layers --from/--to returns the statistics steps of the whole run (%d)" % len(step_rows))

    # 7. Authentication.
    r = ctl("jobs", token=None, expect_ok=False)
    check(r.returncode == 1 and "token" in r.stderr and r.stderr.count("\n") == 1,
          "a client without the token is refused, one line (%r)" % r.stderr.strip())
    wrong = os.path.join(TMP, "wrong-token")
    with open(wrong, "w") as f:
        f.write("not-the-token\n")
    r = ctl("jobs", token=wrong, expect_ok=False)
    check(r.returncode == 1 and "token" in r.stderr, "a wrong token is refused")
    r = ctl("status", "no-such-job", expect_ok=False)
    check(r.returncode == 1 and "no-such-job" in r.stderr, "an unknown job: exit 1, named")

    stop_all()


if __name__ == "__main__":
    main()
