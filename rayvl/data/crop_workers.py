"""The workers that prepare a pseudo-labeller's crops (``rayvl.data.roi_crops.prepare_chunk``): threads of the
labeller, or processes of their own.

Threads share the labeller's one interpreter with its main thread: Pillow's decode and resize release its lock,
but the box draws and the calls around the decoder do not. Where Pillow also cuts the crops (a CPU labeller), that
resize is most of the work and threads keep the crops in the labeller's memory. Where the GPU cuts them, what is
left to the CPUs is mostly Python, and threads cap the labeller at what one interpreter runs
(``benchmarks/labeller_serial.py``): processes then, each with its own interpreter — forked from a fork server that
imported only this module and ``roi_crops`` (not from the labeller, which holds CUDA and Ray's threads); a chunk's
encoded images go to them and its downscaled images come back, pickled.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import signal
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor

PRELOADED = ["rayvl.data.roi_crops", __name__]  # what the fork server imports once for every crop process


def crop_workers(cpus: int, processes: bool) -> Executor:
    """``cpus`` crop workers: threads, or ``processes``."""
    if not processes:
        return ThreadPoolExecutor(cpus, thread_name_prefix="crops")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)
    return ProcessPoolExecutor(cpus, mp_context=context, initializer=end_with_the_fork_server)


def end_with_the_fork_server() -> None:
    """A crop process's start: killed when the fork server that forked it ends, which it does when the labeller
    ends (Linux's PR_SET_PDEATHSIG), so a labeller that Ray kills leaves no crop process behind. Elsewhere they end
    when the labeller shuts its workers down."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
