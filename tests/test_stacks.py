"""nbtrain.run.launch.stacks: a hung launch's faulthandler dumps read into where each rank was, and which rank hung.

The dumps below are what two forked workers wrote on SIGUSR1 (rank 1 asleep in ``load_shard``, rank 0 in
``dist.all_reduce`` with a prefetch thread beside it), with the paths of a user's machine put in. Below the
worker's own frames a forked worker shows the parent's, down to the notebook's or script's ``<module>``.
"""

from __future__ import annotations

import faulthandler
import inspect
import threading

from nbtrain.run.launch.stacks import Frame, describe_ranks, explain_hang

SITE = "/home/ada/project/.venv/lib/python3.11/site-packages"
TRAIN = "/home/ada/project/train.py"

FORKED_FROM_THE_PARENT = f"""\
  File "/home/ada/project/nbtrain/run/launch/workers.py", line 243 in _run_in_group
  File "/home/ada/project/nbtrain/run/launch/workers.py", line 202 in __call__
  File "{SITE}/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367 in wrapper
  File "{SITE}/torch/distributed/elastic/multiprocessing/api.py", line 706 in _wrap
  File "{SITE}/torch/multiprocessing/spawn.py", line 87 in _wrap
  File "/usr/lib/python3.11/multiprocessing/process.py", line 108 in run
  File "/usr/lib/python3.11/multiprocessing/process.py", line 314 in _bootstrap
  File "/usr/lib/python3.11/multiprocessing/popen_fork.py", line 71 in _launch
  File "/usr/lib/python3.11/multiprocessing/popen_fork.py", line 19 in __init__
  File "/usr/lib/python3.11/multiprocessing/context.py", line 281 in _Popen
  File "/usr/lib/python3.11/multiprocessing/process.py", line 121 in start
  File "{SITE}/torch/multiprocessing/spawn.py", line 275 in start_process
  File "{SITE}/torch/multiprocessing/spawn.py", line 280 in start_processes
  File "{SITE}/torch/distributed/elastic/multiprocessing/api.py", line 760 in _start
  File "{SITE}/torch/distributed/elastic/multiprocessing/api.py", line 575 in start
  File "{SITE}/torch/distributed/elastic/multiprocessing/__init__.py", line 252 in start_processes
  File "{SITE}/torch/distributed/elastic/agent/server/local_elastic_agent.py", line 462 in _start_workers
  File "{SITE}/torch/distributed/elastic/metrics/api.py", line 134 in wrapper
  File "{SITE}/torch/distributed/elastic/agent/server/api.py", line 716 in _initialize_workers
  File "{SITE}/torch/distributed/elastic/metrics/api.py", line 134 in wrapper
  File "{SITE}/torch/distributed/elastic/agent/server/api.py", line 916 in _invoke_run
  File "{SITE}/torch/distributed/elastic/agent/server/api.py", line 745 in run
  File "{SITE}/torch/distributed/elastic/metrics/api.py", line 134 in wrapper
  File "{SITE}/torch/distributed/launcher/api.py", line 374 in launch_agent
  File "{SITE}/torch/distributed/launcher/api.py", line 194 in __call__
  File "{SITE}/accelerate/launchers.py", line 261 in notebook_launcher
  File "/home/ada/project/nbtrain/run/launch/workers.py", line 141 in _fork_and_run
  File "/home/ada/project/nbtrain/run/launch/workers.py", line 105 in launch
  File "{TRAIN}", line 30 in <module>
"""

PREFETCH_THREAD = f"""\
Thread 0x00007f29692126c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait
  File "/usr/lib/python3.11/queue.py", line 171 in get
  File "{TRAIN}", line 14 in prefetch
  File "/usr/lib/python3.11/threading.py", line 982 in run
  File "/usr/lib/python3.11/threading.py", line 1045 in _bootstrap_inner
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

"""

RANK_0_IN_ALL_REDUCE = PREFETCH_THREAD + f"""\
Current thread 0x00007f298c686b80 (most recent call first):
  File "{SITE}/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "{SITE}/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "{TRAIN}", line 20 in step
  File "{TRAIN}", line 27 in train
""" + FORKED_FROM_THE_PARENT

RANK_1_LOADING_A_SHARD = PREFETCH_THREAD + f"""\
Current thread 0x00007f298c686b80 (most recent call first):
  File "{TRAIN}", line 17 in load_shard
  File "{TRAIN}", line 26 in train
""" + FORKED_FROM_THE_PARENT

RANK_1_IN_BROADCAST = f"""\
Current thread 0x00007f298c686b80 (most recent call first):
  File "{SITE}/torch/distributed/distributed_c10d.py", line 2889 in broadcast
  File "{SITE}/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "{TRAIN}", line 34 in sync_config
  File "{TRAIN}", line 25 in train
""" + FORKED_FROM_THE_PARENT

RANK_0_IN_ALL_GATHER_OBJECT = f"""\
Current thread 0x00007f298c686b80 (most recent call first):
  File "{SITE}/torch/distributed/distributed_c10d.py", line 4210 in all_gather
  File "{SITE}/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "{SITE}/torch/distributed/distributed_c10d.py", line 3411 in all_gather_object
  File "{SITE}/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "{TRAIN}", line 41 in gather_metrics
""" + FORKED_FROM_THE_PARENT

RANK_0_IN_THE_LAUNCHS_CLOSING_BARRIER = f"""\
Current thread 0x00007f298c686b80 (most recent call first):
  File "{SITE}/torch/distributed/distributed_c10d.py", line 4981 in barrier
  File "{SITE}/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/home/ada/project/nbtrain/run/launch/workers.py", line 248 in _run_in_group
""" + FORKED_FROM_THE_PARENT.split("\n", 1)[1]


def test_a_rank_in_all_reduce_waited_in_all_reduce_called_from_the_users_step():
    [rank] = describe_ranks({0: RANK_0_IN_ALL_REDUCE}, world_size=1)
    assert rank.collective == "all_reduce"
    assert rank.site == Frame(TRAIN, 20, "step")  # the worker's thread, not the prefetch thread beside it
    assert str(rank) == "rank 0 waited in all_reduce (called at train.py:20 in step)"
    assert rank.frames[0].function == "all_reduce" and rank.frames[-1] == Frame(TRAIN, 30, "<module>")


def test_the_workers_thread_is_found_by_its_launch_frames_wherever_the_dump_lists_it():
    worker_first = RANK_0_IN_ALL_REDUCE[len(PREFETCH_THREAD):] + "\n" + PREFETCH_THREAD
    [rank] = describe_ranks({0: worker_first}, world_size=1)
    assert str(rank) == "rank 0 waited in all_reduce (called at train.py:20 in step)"


def test_a_rank_outside_any_collective_was_at_its_innermost_own_frame_not_the_parents_cell():
    [_, rank] = describe_ranks({1: RANK_1_LOADING_A_SHARD}, world_size=2)
    assert rank.collective is None
    assert str(rank) == "rank 1 was at train.py:17 in load_shard"


def test_the_collective_named_is_the_one_the_user_called_not_what_it_calls_inside():
    [rank] = describe_ranks({0: RANK_0_IN_ALL_GATHER_OBJECT}, world_size=1)
    assert str(rank) == "rank 0 waited in all_gather_object (called at train.py:41 in gather_metrics)"


def test_a_rank_whose_function_returned_waits_in_the_launchs_closing_barrier():
    [rank] = describe_ranks({0: RANK_0_IN_THE_LAUNCHS_CLOSING_BARRIER}, world_size=1)
    assert str(rank) == "rank 0 waited in barrier, called by nbtrain's launch after the function returned"


def test_the_rank_outside_the_collective_is_named_as_the_one_the_others_wait_for():
    ranks = describe_ranks({0: RANK_0_IN_ALL_REDUCE, 1: RANK_1_LOADING_A_SHARD}, world_size=2)
    assert explain_hang(ranks) == (
        "Rank 1 never reached the collective the others wait in: rank 1 was at train.py:17 in load_shard; rank 0 "
        "waited in all_reduce (called at train.py:20 in step). Raise the timeout if rank 1 was only slow, or make "
        "every rank reach the same collectives.")


def test_ranks_at_the_same_place_are_listed_together():
    dumps = {0: RANK_0_IN_ALL_REDUCE, 1: RANK_1_LOADING_A_SHARD, 2: RANK_0_IN_ALL_REDUCE,
             3: RANK_1_LOADING_A_SHARD, 4: RANK_0_IN_ALL_REDUCE}
    assert explain_hang(describe_ranks(dumps, world_size=5)) == (
        "Ranks 1 and 3 never reached the collective the others wait in: ranks 1 and 3 were at train.py:17 in "
        "load_shard; ranks 0, 2 and 4 waited in all_reduce (called at train.py:20 in step). Raise the timeout if "
        "ranks 1 and 3 were only slow, or make every rank reach the same collectives.")


def test_ranks_each_in_a_different_collective_are_told_to_call_the_same_ones_in_the_same_order():
    ranks = describe_ranks({0: RANK_0_IN_ALL_REDUCE, 1: RANK_1_IN_BROADCAST}, world_size=2)
    assert explain_hang(ranks) == (
        "Every rank waited in a collective, but not in the same one: rank 0 waited in all_reduce (called at "
        "train.py:20 in step); rank 1 waited in broadcast (called at train.py:34 in sync_config). Make every rank "
        "call the same collectives in the same order.")


def test_ranks_all_in_the_same_collective_are_said_to_wait_in_one_that_never_completed():
    ranks = describe_ranks({0: RANK_0_IN_ALL_REDUCE, 1: RANK_0_IN_ALL_REDUCE}, world_size=2)
    assert explain_hang(ranks).startswith("Every rank waited in the same collective, which never completed: ranks 0 "
                                          "and 1 waited in all_reduce (called at train.py:20 in step).")


def test_ranks_none_of_which_is_in_a_collective_are_only_slow():
    ranks = describe_ranks({0: RANK_1_LOADING_A_SHARD, 1: RANK_1_LOADING_A_SHARD}, world_size=2)
    assert explain_hang(ranks) == ("No rank was in a collective: ranks 0 and 1 were at train.py:17 in load_shard. "
                                   "Raise the timeout if the work is only slow.")


def test_a_rank_without_a_dump_is_said_to_have_sent_none_and_suspected():
    ranks = describe_ranks({0: RANK_0_IN_ALL_REDUCE}, world_size=2)
    assert ranks[1].frames is None and str(ranks[1]) == "rank 1 sent back no stack dump"
    assert explain_hang(ranks).startswith("Rank 1 sent back no stack dump and may be the one that never reached the "
                                          "collective the others wait in: rank 0 waited in all_reduce")
    beside_a_culprit = describe_ranks({0: RANK_0_IN_ALL_REDUCE, 1: RANK_1_LOADING_A_SHARD}, world_size=3)
    assert "rank 1 was at train.py:17 in load_shard; rank 0 waited in all_reduce (called at train.py:20 in step); " \
           "rank 2 sent back no stack dump." in explain_hang(beside_a_culprit)


def test_no_dump_at_all_still_explains_the_timeout():
    assert explain_hang(describe_ranks({}, world_size=2)).startswith("No worker sent back where it was")


def wait_for_data(ready: threading.Event, release: threading.Event) -> None:
    ready.set()
    release.wait()


def test_a_real_faulthandler_dump_is_read_and_without_a_launch_frame_the_main_thread_is_taken(tmp_path):
    ready, release = threading.Event(), threading.Event()
    helper = threading.Thread(target=wait_for_data, args=(ready, release))
    helper.start()
    ready.wait()
    try:
        with open(tmp_path / "rank0.stack", "w") as dump:
            line = inspect.currentframe().f_lineno + 1
            faulthandler.dump_traceback(dump, all_threads=True)
    finally:
        release.set()
        helper.join()
    text = (tmp_path / "rank0.stack").read_text()
    assert "wait_for_data" in text  # two threads, the helper's listed first
    [rank] = describe_ranks({0: text}, world_size=1)
    assert rank.collective is None
    assert rank.site == Frame(__file__, line, inspect.currentframe().f_code.co_name)
