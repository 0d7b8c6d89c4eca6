"""Where spawned test workers leave their results: a dict served by a manager process that is itself spawned.

A forked manager would inherit the pytest process's objects, among them process groups an earlier in-process
test destroyed but Python has not collected; when the child's garbage collector frees one, gloo's destructor
detaches a thread that only existed in the parent and the manager aborts (std::system_error), which the test sees
as an EOFError when it reads its results."""
import torch.multiprocessing as mp


def result_dict():
    return mp.get_context("spawn").Manager().dict()
