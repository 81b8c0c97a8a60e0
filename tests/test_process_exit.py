"""``rollout.worker.process_exit.exit_process``: a process of ours ends as a normal exit would — its code, its
``atexit`` handlers run, its buffered output written — without the interpreter's teardown; with a thread still
running that is not a daemon it waits for it, as Python does."""

import subprocess
import sys

SCRIPT = """
import atexit, sys, threading, time
from rollout.worker.process_exit import exit_process
atexit.register(lambda: open(sys.argv[1], "w").write("atexit ran"))
print("buffered, no newline", end="")
if sys.argv[2] == "thread":
    threading.Thread(target=lambda: (time.sleep(0.5), print(" | the thread finished", end=""))).start()
exit_process(3)
print("never")
"""


def test_exit_process_runs_atexit_flushes_and_keeps_the_code(tmp_path):
    for mode, tail in (("alone", ""), ("thread", " | the thread finished")):
        mark = tmp_path / f"mark-{mode}"
        proc = subprocess.run([sys.executable, "-c", SCRIPT, str(mark), mode], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 3, proc.stderr[-2000:]
        assert proc.stdout == "buffered, no newline" + tail
        assert mark.read_text() == "atexit ran"


def test_a_tp_rank_stops_cleanly(llama_path):
    """A spawned TP rank leaves at once on an orderly stop, with exit code 0."""
    from rollout import RolloutEngine, SamplingParams

    engine = RolloutEngine(llama_path, dtype="float32", kv_cache_tokens=256, tp_size=2)
    procs = list(engine.worker.procs)
    assert engine.generate(input_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=2))
    engine.shutdown()
    assert [p.exitcode for p in procs] == [0]
