"""Training steps on threads started after install() (Note [Threads started
after install()] in python/membudget/_runtime.py): their activations are
managed exactly, swapped or dropped and replayed under either recorder (Note
[Recording on started threads] in csrc/torch/lineage_recorder.cpp); threads
started before it are told they are not.
"""
import gc
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

import membudget
from membudget import _func_transforms, _runtime
from membudget._native import load_extension

from models import bert, gpt2
from training import assert_identical, ops_recorded, run_managed, run_plain

pytestmark = pytest.mark.requires_native

MiB = 1 << 20
STEPS = 3
MIN_TENSOR_BYTES = 16 * 1024


def on_new_thread(run):
    """``run()`` on a threading.Thread started now; its result, or its error
    raised here."""
    outcome = {}

    def body():
        try:
            outcome["result"] = run()
        except BaseException as error:  # re-raised on the calling thread
            outcome["error"] = error

    worker = threading.Thread(target=body, name="training-worker")
    worker.start()
    worker.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def on_pool_worker(run):
    """``run()`` on a ThreadPoolExecutor worker (made lazily, after install())."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()


def _hooks_on_this_thread():
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


@pytest.mark.parametrize("make_workload,runner", [(gpt2, on_new_thread), (bert, on_pool_worker)],
                         ids=["gpt2-thread", "bert-pool"])
def test_training_on_a_thread_started_after_install_is_exact_under_half_its_peak(make_workload, runner):
    work = make_workload()
    reference = run_plain(work.build, work.batch, work.loss, STEPS)
    unbudgeted = run_managed(work.build, work.batch, work.loss, STEPS, budget=None, runner=runner,
                             min_tensor_bytes=MIN_TENSOR_BYTES)
    assert_identical(reference, unbudgeted)
    budget = unbudgeted.stats["reserved_bytes.all.peak"] // 2

    swapped = run_managed(work.build, work.batch, work.loss, STEPS, budget=budget, runner=runner,
                          min_tensor_bytes=MIN_TENSOR_BYTES, actions="swap")
    assert_identical(reference, swapped)
    stats = swapped.stats
    assert stats["reserved_bytes.all.peak"] <= budget
    assert stats["swap_out_bytes"] > 0 and stats["swap_in_count"] > 0
    assert stats["num_ooms"] == 0

    # Either recorder records there too: recompute-only fits, replaying
    # (GPT-2's dropout included) exactly.
    for lineage in ("python", "cxx"):
        recomputed = run_managed(work.build, work.batch, work.loss, STEPS, budget=budget, runner=runner,
                                 min_tensor_bytes=MIN_TENSOR_BYTES, lineage=lineage, actions="recompute")
        assert_identical(reference, recomputed)
        stats = recomputed.stats
        assert stats["reserved_bytes.all.peak"] <= budget, lineage
        assert stats["recompute_count"] > 0 and stats["swap_out_bytes"] == 0, lineage
        assert stats["num_ooms"] == 0, lineage


def _mlp_step():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(8)])
    loss = model(torch.randn(2048, 256)).square().mean()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def _mlp_step_on_cue():
    """A thread, not yet started, that runs ``_mlp_step`` once ``go`` is set
    and keeps its out-of-memory message in ``failures``."""
    go, failures = threading.Event(), []

    def body():
        go.wait()
        try:
            _mlp_step()
        except torch.OutOfMemoryError as error:
            failures.append(str(error))

    return threading.Thread(target=body), go, failures


def test_a_thread_started_before_install_is_told_it_is_not_managed():
    """Its hooks cannot be pushed from outside: the same step that fits on
    a thread started after install() runs out of memory there, and says why."""
    early, go, failures = _mlp_step_on_cue()
    early.start()
    membudget.install(budget=16 * MiB, min_tensor_bytes=64 * 1024)
    try:
        on_new_thread(_mlp_step)  # fits, swapping
        assert membudget.memory_stats()["swap_out_count"] > 0
        go.set()
        early.join()
    finally:
        membudget.uninstall()
    assert len(failures) == 1
    assert "thread without membudget's saved-tensor hooks" in failures[0], failures[0]
    assert "started before install()" in failures[0], failures[0]
    gc.collect()


def test_recompute_only_on_a_thread_started_while_nothing_recorded_says_it_is_swap_only():
    """A thread started while membudget recorded no lineage (no budget yet)
    keeps plain hooks after install() is called again with one."""
    membudget.install(budget=None)
    try:
        started_unrecorded, go, failures = _mlp_step_on_cue()
        started_unrecorded.start()
        membudget.install(budget=16 * MiB, min_tensor_bytes=64 * 1024, actions="recompute")
        _mlp_step()  # the install thread records lineage: fits by recomputing
        assert membudget.memory_stats()["recompute_count"] > 0
        go.set()
        started_unrecorded.join()
    finally:
        membudget.uninstall()
    assert len(failures) == 1 and "records no lineage" in failures[0], failures
    assert "swap-only" in failures[0] and "MEMBUDGET_ACTIONS=recompute" in failures[0]
    gc.collect()


@pytest.mark.parametrize("lineage", ["python", "cxx"])
def test_recompute_only_on_a_started_thread_fits(lineage):
    expected = _mlp_step()
    membudget.install(budget=16 * MiB, min_tensor_bytes=64 * 1024, actions="recompute", lineage=lineage)
    try:
        loss, grads = on_new_thread(_mlp_step)
        assert membudget.memory_stats()["recompute_count"] > 0
        assert membudget.memory_stats()["reserved_bytes.all.peak"] <= 16 * MiB
    finally:
        membudget.uninstall()
    assert loss == expected[0]
    assert all(torch.equal(a, b) for a, b in zip(grads, expected[1]))
    gc.collect()


class _ForwardCounter:
    """Counts the Python recorder's forwards (the C++ one counts its own)."""

    def __init__(self, lineage):
        self.count = 0
        original = lineage._begin_forward

        def counted():
            self.count += 1
            original()

        lineage._begin_forward = counted


def _forwards_begun() -> int:
    if _runtime._lineage_mode is None:
        return load_extension().lineage.forwards()
    lineage = _runtime._lineage
    counter = getattr(lineage, "_test_counter", None)
    if counter is None:
        counter = lineage._test_counter = _ForwardCounter(lineage)
    return counter.count


class _OtherThreadOps:
    """A thread started after install() that runs a few grad-mode ops (as a
    thread making batches with torch would) whenever asked, while the asker
    waits: a deterministic interleaving of its recorded ops with another
    thread's backward."""

    def __init__(self):
        self.ask, self.done, self.stop = threading.Event(), threading.Event(), False
        self.runs = self.recorded = 0
        self.thread = threading.Thread(target=self._serve, name="batch-maker")
        self.thread.start()

    def _serve(self):
        while True:
            self.ask.wait()
            self.ask.clear()
            if self.stop:
                return
            recorded = ops_recorded()
            (torch.ones(64, 64) * 2 + 1).sum()  # grad mode is on: recorded
            self.recorded += ops_recorded() - recorded
            self.runs += 1
            self.done.set()

    def run_ops(self, *_):
        self.done.clear()
        self.ask.set()
        self.done.wait()

    def close(self):
        self.stop = True
        self.ask.set()
        self.thread.join()


def _inplace_mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU(inplace=True)) for _ in range(8)])


def _train_inplace_mlp(steps, other=None):
    model = _inplace_mlp()
    if other is not None:
        def ask_in_backward(_module, _args, output):  # at each layer's output gradient
            output.register_hook(other.run_ops)

        for layer in model:
            layer.register_forward_hook(ask_in_backward)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        batch = torch.randn(2048, 256)
        optimizer.zero_grad(set_to_none=True)
        loss = model(batch).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("lineage", ["python", "cxx"])
def test_another_threads_ops_during_backward_begin_no_forward(lineage):
    """A thread's ops recorded in the middle of another thread's backward
    join the forward under way instead of beginning one (Note [Recording on
    started threads]): each extra forward would release in-place writers
    early and make what reads them swap-only. The training thread keeps its
    lineage (recompute-only with in-place ReLUs fits) and its results."""
    expected = _train_inplace_mlp(STEPS)
    budget = 20 * MiB
    begun, results = [], []
    for with_other in (False, True):
        membudget.install(budget=budget, min_tensor_bytes=64 * 1024, actions="recompute", lineage=lineage)
        other = _OtherThreadOps() if with_other else None  # started after install(): it records
        try:
            forwards = _forwards_begun()
            results.append(_train_inplace_mlp(STEPS, other))
            begun.append(_forwards_begun() - forwards)
            stats = membudget.memory_stats()
        finally:
            if other is not None:
                other.close()
            membudget.uninstall()
        assert stats["recompute_count"] > 0 and stats["reserved_bytes.all.peak"] <= budget
    assert other.runs == STEPS * 8 and other.recorded >= other.runs  # inside every layer's backward, recorded
    assert begun[1] == begun[0], begun  # no forward more than without it
    for got in results:
        assert got[0] == expected[0]
        assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1]))
    gc.collect()


def test_torch_func_transforms_run_on_a_started_thread():
    """The hooks a started thread pushed are taken off for a transform as
    the install thread's are (Note [torch.func transforms run unmanaged])."""
    from torch.func import grad, vmap

    x = torch.randn(16, 8)
    weight = torch.randn(8)
    per_sample = vmap(grad(lambda w, row: (row * w).sin().sum()), in_dims=(None, 0))
    expected = per_sample(weight, x)

    def on_thread():
        assert _hooks_on_this_thread() is not None
        got = per_sample(weight, x)
        assert _func_transforms._ours_here() is not None  # pushed back after the transform
        return got

    membudget.install(budget="1GiB")
    try:
        got = on_new_thread(on_thread)
    finally:
        membudget.uninstall()
    assert torch.equal(got, expected)


@pytest.mark.parametrize("lineage", ["python", "cxx"])
def test_uninstall_leaves_started_threads_working_and_new_threads_plain(lineage):
    native = load_extension()
    original_bootstrap = threading.Thread._bootstrap_inner
    # Threads an earlier install started that still run keep torch's
    # context manager replaced (by design): two ThreadPoolExecutor workers,
    # not membudget's, started under an earlier test, did so in one full run.
    earlier_threads = _func_transforms._started_alive
    membudget.install(budget="1GiB", lineage=lineage)
    install_hooks = _runtime._started_thread_hooks
    assert threading.Thread._bootstrap_inner is not original_bootstrap
    installed, go, seen = threading.Event(), threading.Event(), {}

    def recorder_here():
        mode = getattr(_runtime._started_thread_mode, "mode", None)
        return mode if lineage == "python" else native.lineage.recording()

    def ops_recorded(mode):
        return mode.lineage.ops_recorded if lineage == "python" else native.lineage.ops_recorded()

    def lives_across_uninstall():
        seen["hooks"] = _hooks_on_this_thread()
        seen["recorder"] = recorder = recorder_here()
        installed.set()
        go.wait()
        # After uninstall its hooks pass tensors through, its recorder
        # records nothing, and a transform still runs.
        recorded = ops_recorded(recorder)
        seen["loss"], _ = _mlp_step()
        seen["recorded after uninstall"] = ops_recorded(recorder) - recorded
        seen["transform"] = torch.func.grad(lambda t: t.sin().sum())(torch.ones(3))
        seen["recorder at the end"] = recorder_here()

    worker = threading.Thread(target=lives_across_uninstall)
    worker.start()
    installed.wait()
    membudget.uninstall()
    assert threading.Thread._bootstrap_inner is original_bootstrap
    assert seen["hooks"] == install_hooks and seen["recorder"]
    assert on_new_thread(_hooks_on_this_thread) is None  # started after uninstall: plain
    go.set()
    worker.join()
    assert seen["recorded after uninstall"] == 0 and seen["recorder at the end"]
    assert not on_new_thread(recorder_here)
    assert seen["loss"] == _mlp_step()[0]
    assert torch.equal(seen["transform"], torch.ones(3).cos())
    # The last started thread ended: torch has its own context manager back.
    assert _func_transforms._started_alive == earlier_threads
    assert (_func_transforms._original is None) == (earlier_threads == 0)
    stand_in = torch.autograd.graph.disable_saved_tensors_hooks is _func_transforms._DisableBesideMembudget
    assert stand_in == (earlier_threads > 0)


@pytest.mark.parametrize("lineage", ["python", "cxx"])
def test_a_started_thread_alive_after_uninstall_keeps_nothing_allocated(lineage):
    """A started thread's recorder outlives uninstall() with the thread: the
    inputs its recorder last held (the model) must not stay allocated."""
    membudget.install(budget="256MiB", actions="recompute", lineage=lineage, min_tensor_bytes=0)
    gc.collect()
    earlier = load_extension().memory_stats()["allocated_bytes.all.current"]
    release = threading.Event()
    lingering = threading.Thread(target=release.wait)
    lingering.start()
    try:
        def forward_only():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512))
            loss = model(torch.randn(64, 512)).square().mean()
            assert membudget.memory_stats()["allocated_bytes.all.current"] > MiB
            del model, loss  # as an exception unwinding the step would

        on_new_thread(forward_only)
        forward_only()
    finally:
        membudget.uninstall()
    gc.collect()
    try:
        assert load_extension().memory_stats()["allocated_bytes.all.current"] == earlier
    finally:
        release.set()
        lingering.join()


def test_a_daemon_thread_is_left_unmanaged_and_told_why():
    membudget.install(budget=16 * MiB, min_tensor_bytes=64 * 1024)
    failures = []

    def step():
        assert _hooks_on_this_thread() is None
        try:
            _mlp_step()
        except torch.OutOfMemoryError as error:
            failures.append(str(error))

    try:
        daemon = threading.Thread(target=step, daemon=True)
        daemon.start()
        daemon.join()
    finally:
        membudget.uninstall()
    assert len(failures) == 1 and "daemon thread" in failures[0], failures
    gc.collect()


_EXIT_WITH_THREADS = """
import atexit, threading
import torch
import membudget

membudget.install(budget="64MiB", min_tensor_bytes=64 * 1024, lineage=LINEAGE)

def step():
    x = torch.randn(512, 512, requires_grad=True)
    (x.exp() * 2).sum().backward()

for daemon in (True, False):  # a daemon still inside torch at exit aborts plain PyTorch too: joined
    worker = threading.Thread(target=step, daemon=daemon)
    worker.start()
    worker.join()
# Threads that end as the interpreter exits: non-daemon ones let go by a
# timer while it waits for them, and a daemon woken by an exit handler, as
# tqdm's monitor is.
release, woken = threading.Event(), threading.Event()
for _ in range(32):
    threading.Thread(target=release.wait).start()
threading.Timer(0.3, release.set).start()
threading.Thread(target=woken.wait, daemon=True).start()
atexit.register(woken.set)
print("ran")
"""


def test_the_interpreter_exits_cleanly_with_threads_started_after_install():
    """Hooks left in the thread-locals of a thread that ends as the
    interpreter exits aborted it (status 134) when torch released them:
    started threads empty their hook stack as they end, and daemon threads
    get none (Note [Threads started after install()]). A race: without
    those, about one run in four of this script aborted here."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    # Each recorder leaves something of its own in a started thread's C++
    # thread-locals while it runs: the C++ callback, or the Python mode.
    for lineage in ("cxx", "python") * 3:
        script = f"LINEAGE = {lineage!r}\n" + _EXIT_WITH_THREADS
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "ran" in done.stdout, (lineage, done.returncode, done.stderr[-2000:])


class _AppendingRef:
    """Stands in for a weak reference in ``lineage._made`` whose call (as
    pruning or severing reads it) appends a reference to ``made``, as another
    thread recording lineage at that moment would."""

    def __init__(self, made: list, appended):
        self.made, self.appended, self.called = made, appended, False

    def __call__(self):
        if not self.called:
            self.called = True
            self.made.append(self.appended)
        return None  # dead: pruning drops this one


@pytest.mark.parametrize("operation", ["prune", "sever"])
def test_a_lineage_made_on_another_thread_while_the_list_is_pruned_is_kept(operation, monkeypatch):
    """Note [Lineages made on several threads]: a lineage a thread records
    while another prunes (each forward's start) or severs (each release) the
    list of lineages made must stay listed, or the next release would not
    sever it and a kept loss would keep its forward's graph alive."""
    from membudget import lineage as lineage_module

    class Made:
        pass

    made = []
    monkeypatch.setattr(lineage_module, "_made", made)
    survivor = Made()
    appended = weakref.ref(survivor)
    made.append(_AppendingRef(made, appended))
    if operation == "prune":
        lineage_module._prune_made()
    else:
        lineage_module._sever_released_lineages()
    assert lineage_module._made is made, "the list must be changed in place, not rebound"
    assert appended in made, "an append made while the list was read was lost"
