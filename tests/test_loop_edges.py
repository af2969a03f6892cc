"""Issue 13, in process: the loop shapes people write around ``ckpt.epochs()`` / ``ckpt.batches()``
either resume exactly or say, visibly (stderr) and before any damage, what they cannot do.

Real torch, tiny models, temporary folders. The SIGKILL scenarios live in test_realistic_loops.py;
this file checks what one process can show: which batches ran, counters, the checkpoint's contents,
the exact words the user sees, and the objects left untouched when something is refused.

A "kill" inside one process is a ``return`` out of the loop body: the batch that was running never
reaches its boundary (as after a SIGKILL), and the next session resumes from the newest checkpoint.
"""
from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from keepalive import CheckpointStore, StateMismatchError
from keepalive.callbacks.torch import DriveCheckpoint
from keepalive.errors import UnsupportedStateError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N, BATCH = 40, 8                # 5 batches per epoch
PER_EPOCH = N // BATCH


# ------------------------------------------------------------------------------------ helpers
def indexed(n: int = N) -> TensorDataset:
    """Inputs and each sample's index (the batches say which samples ran)."""
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.arange(n))


def make(seed: int = 0, hidden: int = 16, lr: float = 0.1, optimizer: str = "sgd", dropout: float = 0.3):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Dropout(dropout), torch.nn.Linear(hidden, 3))
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    return model, opt


def train_step(model, opt, x, idx) -> None:
    opt.zero_grad()
    F.cross_entropy(model(x), idx % 3).backward()
    opt.step()


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def newest(path):
    return CheckpointStore(path).newest_valid()


@pytest.fixture(autouse=True)
def _default_sigint():
    """Every test starts and ends with Python's own SIGINT handler (a leak would break the next)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    signal.signal(signal.SIGINT, signal.default_int_handler)


# ---------------------------------------------------------- ckpt.batches() without ckpt.epochs()
def test_batches_without_epochs_runs_every_epoch_whole_and_warns_after_resume(tmp_path, capsys):
    loader = DataLoader(indexed(), batch_size=BATCH, shuffle=True)
    model, opt = make()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    orders = []
    for _epoch in range(3):  # the user's own epoch loop
        order = []
        for x, idx in ckpt.batches(loader):
            train_step(model, opt, x, idx)
            order += idx.tolist()
        orders.append(order)
    ckpt.close()
    assert [sorted(o) for o in orders] == [list(range(N))] * 3  # every epoch whole, not zero batches
    assert len({tuple(o) for o in orders}) == 3  # each pass is its own epoch: its own shuffle
    assert (ckpt.epoch, ckpt.step, ckpt.counters["batch"]) == (3, 3 * PER_EPOCH, 0)
    assert newest(tmp_path / "run").epoch == 3
    assert "without ckpt.epochs()" not in capsys.readouterr().err  # nothing to say on a fresh run

    saved = weights(model)
    model2, opt2 = make(seed=7)
    again = DriveCheckpoint(tmp_path / "run", model=model2, optimizer=opt2, quiet=True)
    ran = 0
    for _epoch in range(2):
        for x, idx in again.batches(loader):
            if ran == 0:
                assert same_weights(weights(model2), saved)  # resumed, not a fresh model
            train_step(model2, opt2, x, idx)
            ran += 1
    again.close()
    err = capsys.readouterr().err
    assert err.count("ckpt.batches() is used without ckpt.epochs()") == 1, err
    assert ran == 2 * PER_EPOCH and again.epoch == 5


# ------------------------------------------------------------- DataLoader subclass with __iter__
class TwiceLoader(DataLoader):
    """Yields each batch, then a marked copy of it (indices + 1000)."""

    def __iter__(self):
        for x, idx in super().__iter__():
            yield x, idx
            yield x, idx + 1000


def test_dataloader_subclass_overriding_iter_is_kept_and_warned(tmp_path, capsys):
    loader = TwiceLoader(indexed(), batch_size=BATCH, shuffle=True)
    model, opt = make()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, every=3, keep=None, quiet=True)
    seen = []
    for _ in ckpt.epochs(2):
        for x, idx in ckpt.batches(loader):
            train_step(model, opt, x, idx % 1000)
            seen.append(idx.tolist())
    ckpt.close()
    assert len(seen) == 2 * 2 * PER_EPOCH  # the subclass's batches: twice as many
    for plain, marked in zip(seen[::2], seen[1::2]):
        assert marked == [i + 1000 for i in plain]
    assert sorted(i for b in seen[: 2 * PER_EPOCH: 2] for i in b) == list(range(N))
    err = capsys.readouterr().err
    assert err.count("TwiceLoader overrides DataLoader.__iter__") == 1, err
    # saves only at epoch ends (a due every=3 save waits for it): no checkpoint inside an epoch
    listed = CheckpointStore(tmp_path / "run").list()
    assert [c.step for c in listed] == [10, 20]


# ----------------------------------------------------- retry after StateMismatchError, same ckpt
def _two_epochs_then_one_more(path, seed_for_first=0):
    """Train 2 epochs of 3 (model + SGD with momentum); return the weights at that checkpoint."""
    model, opt = make(seed=seed_for_first)
    loader = DataLoader(indexed(), batch_size=BATCH, shuffle=True)
    ckpt = DriveCheckpoint(path, model=model, optimizer=opt, quiet=True)
    for _ in ckpt.epochs(2):
        for x, idx in ckpt.batches(loader):
            train_step(model, opt, x, idx)
    ckpt.close()
    return weights(model), loader


def _reference(path, epochs=3, **make_kw):
    model, opt = make(**make_kw)
    loader = DataLoader(indexed(), batch_size=BATCH, shuffle=True)
    ckpt = DriveCheckpoint(path, model=model, optimizer=opt, quiet=True)
    for _ in ckpt.epochs(epochs):
        for x, idx in ckpt.batches(loader):
            train_step(model, opt, x, idx)
    ckpt.close()
    return weights(model)


def test_retry_after_state_mismatch_resumes_from_the_checkpoint(tmp_path):
    ref = _reference(tmp_path / "ref")
    saved, loader = _two_epochs_then_one_more(tmp_path / "run")
    steps_before = [c.step for c in CheckpointStore(tmp_path / "run").list()]

    wrong, wrong_opt = make(seed=5, hidden=32)  # the wrong architecture
    wrong_before = weights(wrong)
    ckpt = DriveCheckpoint(tmp_path / "run", model=wrong, optimizer=wrong_opt, quiet=True)
    with pytest.raises(StateMismatchError):
        for _ in ckpt.epochs(3):
            raise AssertionError("no epoch may start with a checkpoint that does not fit")
    assert same_weights(weights(wrong), wrong_before) and wrong_opt.state_dict()["state"] == {}
    assert (ckpt.epoch, ckpt.step) == (0, 0) and ckpt.core.resumed_from is None

    right, right_opt = make(seed=9)  # fixed: a new model (and its optimizer) under the same names
    ckpt.register("model", right)
    ckpt.register("optimizer", right_opt)
    epochs_run = []
    for epoch in ckpt.epochs(3):
        if not epochs_run:
            assert same_weights(weights(right), saved)  # the checkpoint's weights, not fresh ones
            assert ckpt.step == 2 * PER_EPOCH
        epochs_run.append(epoch)
        for x, idx in ckpt.batches(loader):
            train_step(right, right_opt, x, idx)
    ckpt.close()
    assert epochs_run == [2]
    assert ckpt.core.resumed_from.step == 2 * PER_EPOCH
    assert same_weights(weights(right), ref)  # as if never interrupted
    steps_after = [c.step for c in CheckpointStore(tmp_path / "run").list()]
    assert steps_after == (steps_before + [3 * PER_EPOCH])[-3:]  # the run went on, not over


def test_retry_after_state_mismatch_by_replacing_the_object_in_place(tmp_path):
    """``ckpt.objects['model'] = right_model``: the optimizer here is plain SGD (no state per
    parameter), so the model alone was wrong."""
    def build(seed, hidden):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Linear(hidden, 3))
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    loader = DataLoader(indexed(), batch_size=BATCH, shuffle=True)
    model, opt = build(0, 16)
    first = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    for _ in first.epochs(1):
        for x, idx in first.batches(loader):
            train_step(model, opt, x, idx)
    first.close()
    saved = weights(model)

    wrong, _ = build(1, 32)
    ckpt = DriveCheckpoint(tmp_path / "run", model=wrong, quiet=True)
    with pytest.raises(StateMismatchError, match="has shape"):
        ckpt.resume()
    right, right_opt = build(2, 16)
    ckpt.objects["model"] = right
    assert ckpt.resume() is True
    assert same_weights(weights(right), saved) and (ckpt.epoch, ckpt.step) == (1, PER_EPOCH)
    ckpt.close()


# --------------------------------------------------------------------- two loaders, one epoch
def _train_and_validate(path, stop_after=None, epochs=3):
    model, opt = make()
    train_loader = DataLoader(indexed(), batch_size=BATCH, shuffle=True)
    val_loader = DataLoader(indexed(), batch_size=BATCH, shuffle=True)  # same size: same shapes
    ckpt = DriveCheckpoint(path, model=model, optimizer=opt, every=2, quiet=True)
    log, done = [], 0
    for epoch in ckpt.epochs(epochs):
        for x, idx in ckpt.batches(train_loader):
            train_step(model, opt, x, idx)
            log.append((epoch, "train", tuple(idx.tolist())))
            done += 1
            if done == stop_after:  # killed in this batch: its boundary never comes
                ckpt.close()
                return None, ckpt, log
        with torch.no_grad():
            for x, idx in ckpt.batches(val_loader):
                model(x)  # dropout draws random numbers here too
                log.append((epoch, "val", tuple(idx.tolist())))
    ckpt.close()
    return weights(model), ckpt, log


def test_two_loaders_get_their_own_orders_val_whole_train_continues(tmp_path):
    ref, ref_ckpt, ref_log = _train_and_validate(tmp_path / "ref")
    for epoch in range(3):
        train = [i for e, kind, b in ref_log if e == epoch and kind == "train" for i in b]
        val = [i for e, kind, b in ref_log if e == epoch and kind == "val" for i in b]
        assert sorted(train) == sorted(val) == list(range(N))
        assert train != val  # not the same permutation
    assert (ref_ckpt.step, ref_ckpt.counters["samples"]) == (3 * PER_EPOCH, 3 * N)  # train only

    # killed in epoch 1's third train batch (step 8); every=2: the newest checkpoint is step 6
    _, _, first_log = _train_and_validate(tmp_path / "run", stop_after=PER_EPOCH + 3)
    assert newest(tmp_path / "run").step == PER_EPOCH + 1
    final, ckpt, second_log = _train_and_validate(tmp_path / "run")
    assert ckpt.core.resumed_from.step == PER_EPOCH + 1
    kept = first_log[: 2 * PER_EPOCH + 1]  # epoch 0 train + val, epoch 1's first train batch
    assert kept + second_log == ref_log  # train continued, val ran whole, same orders
    epoch1_val = [b for e, kind, b in second_log if e == 1 and kind == "val"]
    assert len(epoch1_val) == PER_EPOCH
    assert (ckpt.step, ckpt.counters["samples"]) == (3 * PER_EPOCH, 3 * N)
    assert same_weights(final, ref)


# ------------------------------------------------------------------------------------- signals
def test_second_sigint_raises_at_once_and_nothing_stale_stops_the_next_training(tmp_path, capsys):
    loader = DataLoader(indexed(), batch_size=BATCH, shuffle=True)
    model, opt = make()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    after_second = False
    with pytest.raises(KeyboardInterrupt):
        for _ in ckpt.epochs(3):
            for x, idx in ckpt.batches(loader):
                if ckpt.step == 2:
                    signal.raise_signal(signal.SIGINT)   # deferred to the end of this step ...
                    signal.raise_signal(signal.SIGINT)   # ... the second one acts at once
                    after_second = True
                train_step(model, opt, x, idx)
    assert not after_second
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert ckpt.core.pending_signal is None
    err = capsys.readouterr().err
    assert err.count("SIGINT received") == 1, err

    # the same ckpt, the loop run again (a notebook cell re-run): runs to its end
    ran = 0
    for _ in ckpt.epochs(3):
        for x, idx in ckpt.batches(loader):
            train_step(model, opt, x, idx)
            ran += 1
    assert ckpt.finished and ckpt.step == 3 * PER_EPOCH and ran == 3 * PER_EPOCH - 2
    ckpt.close()

    # a new training in the same process: not stopped by anything left over
    model2, opt2 = make(seed=1)
    other = DriveCheckpoint(tmp_path / "other", model=model2, optimizer=opt2, quiet=True)
    ran = 0
    for _ in other.epochs(2):
        for x, idx in other.batches(loader):
            train_step(model2, opt2, x, idx)
            ran += 1
    other.close()
    assert other.finished and ran == 2 * PER_EPOCH
    assert "SIGINT" not in capsys.readouterr().err


@pytest.mark.parametrize("validation", ["plain loop", "ckpt.batches"])
def test_sigint_during_the_last_epochs_validation_saves_and_raises(tmp_path, capsys, validation):
    train_loader = DataLoader(indexed(), batch_size=BATCH, shuffle=True)
    val_loader = DataLoader(indexed(), batch_size=BATCH)
    model, opt = make()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    val_batches = 0
    with pytest.raises(KeyboardInterrupt):
        for epoch in ckpt.epochs(2):
            for x, idx in ckpt.batches(train_loader):
                train_step(model, opt, x, idx)
            with torch.no_grad():
                for x, _ in (val_loader if validation == "plain loop" else ckpt.batches(val_loader)):
                    if epoch == 1 and val_batches == PER_EPOCH + 1:
                        signal.raise_signal(signal.SIGINT)  # after the last epoch's batch loop
                    model(x)
                    val_batches += 1
    info = newest(tmp_path / "run")
    if validation == "plain loop":  # keepalive is not called before the short validation ends
        assert val_batches == 2 * PER_EPOCH  # validation finished first
        assert ckpt.finished
        assert (info.epoch, info.step) == (2, 2 * PER_EPOCH) and info.manifest["metadata"]["finished"]
    else:  # saved at the validation's next batch, as of the last step: a re-run validates again, then ends
        assert val_batches == PER_EPOCH + 2
        assert not ckpt.finished
        assert (info.epoch, info.step, info.manifest["metadata"]["counters"]["batch"]) == (1, 2 * PER_EPOCH, PER_EPOCH)
        assert "during a pause of the training loop" in info.manifest["metadata"]["reason"]
    assert "SIGINT received" in capsys.readouterr().err
    ckpt.close()


_WORKERS_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from keepalive.callbacks.torch import DriveCheckpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.arange(64)), batch_size=4,
                        shuffle=True, num_workers=2)
    ckpt = DriveCheckpoint(sys.argv[1], model=model, optimizer=opt)
    for epoch in ckpt.epochs(2):
        for x, idx in ckpt.batches(loader):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), idx % 3).backward()
            opt.step()
            if ckpt.step == 3:
                os.killpg(0, signal.SIGINT)  # Ctrl-C in a terminal: the whole process group
                time.sleep(1.0)              # time for the workers to act on it
    print("NOT INTERRUPTED", flush=True)
""")


def test_sigint_to_the_process_group_with_workers_is_reported_once(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _WORKERS_CHILD, str(tmp_path / "run")], env=env,
                          capture_output=True, text=True, timeout=120, start_new_session=True)
    out = proc.stdout + proc.stderr
    assert "NOT INTERRUPTED" not in out
    assert out.count("SIGINT received") == 1, out  # the main process only, not each worker
    assert proc.stderr.count("Traceback") == 1 and "KeyboardInterrupt" in proc.stderr, out  # main only
    assert "SIGINT: saved in epoch 0 after 4 batches, step 4" in proc.stdout, out
    assert newest(tmp_path / "run").step == 4


# ------------------------------------------------------------------------------------ lazy modules
def _lazy_model(seed=0, initialize=False):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.LazyLinear(16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    if initialize:
        model(torch.zeros(1, 8))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _lazy_run(path, epochs, stop_after=None, initialize=False):
    model, opt = _lazy_model(initialize=initialize)
    loader = DataLoader(indexed(), batch_size=BATCH, shuffle=True)
    ckpt = DriveCheckpoint(path, model=model, optimizer=opt, every=2, quiet=True)
    done = 0
    for _ in ckpt.epochs(epochs):
        for x, idx in ckpt.batches(loader):
            train_step(model, opt, x, idx)
            done += 1
            if done == stop_after:
                ckpt.close()
                return None
    ckpt.close()
    return weights(model)


def test_lazy_module_trains_from_scratch(tmp_path):
    assert _lazy_run(tmp_path / "run", 1) is not None


def test_lazy_module_resumes_in_a_fresh_model_bit_exact(tmp_path):
    ref = _lazy_run(tmp_path / "ref", 2, initialize=True)
    _lazy_run(tmp_path / "run", 2, stop_after=PER_EPOCH + 2, initialize=True)  # saved at step 6
    resumed = _lazy_run(tmp_path / "run", 2, initialize=False)  # a fresh lazy model, as a new session
    assert same_weights(resumed, ref)


def test_lazy_module_initialized_before_the_loop_resumes_bit_exact(tmp_path):
    """The workaround that works today: one forward pass before the loop."""
    ref = _lazy_run(tmp_path / "ref", 2, initialize=True)
    _lazy_run(tmp_path / "run", 2, stop_after=PER_EPOCH + 2, initialize=True)
    assert newest(tmp_path / "run").step == PER_EPOCH + 1
    resumed = _lazy_run(tmp_path / "run", 2, initialize=True)
    assert same_weights(resumed, ref)


# --------------------------------------------------------------------- optimizer swapped SGD->Adam
def test_optimizer_class_swapped_is_refused_before_the_model_changes(tmp_path):
    _reference(tmp_path / "run", epochs=1)
    model, adam = make(seed=5, optimizer="adam")
    before = weights(model)
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=adam, quiet=True)
    with pytest.raises(StateMismatchError) as err:
        for _ in ckpt.epochs(2):
            raise AssertionError("no epoch may start")
    msg = str(err.value)
    assert "optimizer" in msg and "holds a SGD" in msg and "has a Adam" in msg, msg
    assert same_weights(weights(model), before)
    assert adam.state_dict()["state"] == {} and (ckpt.epoch, ckpt.step) == (0, 0)
    ckpt.close()


# ------------------------------------------------------------------------------ worker_init_fn
class FolderDataset(Dataset):
    """A dataset whose workers each note themselves in a folder named by an attribute."""

    def __init__(self, folder: str, n: int = N):
        self.folder = folder
        self.scale = 1.0
        self.base = indexed(n)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, idx = self.base[i]
        return x * self.scale, idx


def note_worker(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    folder = info.dataset.folder  # the user's dataset's attribute, read through the worker info
    with open(os.path.join(folder, f"worker{worker_id}"), "w") as f:
        f.write(str(info.num_workers))


def set_worker_scale(worker_id: int) -> None:
    """The per-worker setup people write (open a file / HDF5 handle): set an attribute that
    ``__getitem__`` then uses."""
    torch.utils.data.get_worker_info().dataset.scale = 0.0


@pytest.mark.parametrize("shuffle", [True, False])
def test_worker_init_fn_reads_the_datasets_attributes(tmp_path, shuffle):
    notes = tmp_path / "notes"
    notes.mkdir()
    loader = DataLoader(FolderDataset(str(notes)), batch_size=BATCH, shuffle=shuffle, num_workers=2,
                        worker_init_fn=note_worker)
    model, opt = make()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    seen = []
    for _ in ckpt.epochs(1):
        for x, idx in ckpt.batches(loader):
            train_step(model, opt, x, idx)
            seen += idx.tolist()
    ckpt.close()
    assert sorted(seen) == list(range(N))
    assert sorted(os.listdir(notes)) == ["worker0", "worker1"]
    assert (notes / "worker0").read_text() == "2"


def test_worker_init_fn_setting_a_dataset_attribute_reaches_getitem(tmp_path):
    loader = DataLoader(FolderDataset(str(tmp_path)), batch_size=BATCH, shuffle=True, num_workers=2,
                        worker_init_fn=set_worker_scale)
    plain = [x for x, _ in loader]
    assert all(torch.count_nonzero(x) == 0 for x in plain)  # what torch itself does
    model, opt = make()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    batches = []
    for _ in ckpt.epochs(1):
        for x, idx in ckpt.batches(loader):
            batches.append(x)
    ckpt.close()
    assert len(batches) == PER_EPOCH
    assert all(torch.count_nonzero(x) == 0 for x in batches)


# ------------------------------------------------------------------------- in_order=False
def _unordered_run(path, stop_after=None, epochs=3):
    loader = DataLoader(indexed(), batch_size=BATCH, shuffle=True, num_workers=2, in_order=False)
    model, opt = make()
    ckpt = DriveCheckpoint(path, model=model, optimizer=opt, every=2, quiet=True)
    seen, done = collections.defaultdict(list), 0
    for epoch in ckpt.epochs(epochs):
        for x, idx in ckpt.batches(loader):
            train_step(model, opt, x, idx)
            seen[epoch] += idx.tolist()
            done += 1
            if done == stop_after:
                ckpt.close()
                return ckpt, seen
    ckpt.close()
    return ckpt, seen


@pytest.mark.skipif(not hasattr(DataLoader(indexed()), "in_order"), reason="torch without in_order")
def test_unordered_loader_saves_at_epoch_ends_and_resume_neither_skips_nor_repeats(tmp_path, capsys):
    _, first = _unordered_run(tmp_path / "run", stop_after=PER_EPOCH + 3)
    err = capsys.readouterr().err
    assert err.count("DataLoader(in_order=False) yields batches in the order workers finish them") == 1, err
    info = newest(tmp_path / "run")
    assert (info.epoch, info.step, info.manifest["metadata"]["counters"]["batch"]) == (1, PER_EPOCH, 0)
    ckpt, second = _unordered_run(tmp_path / "run")
    assert sorted(second) == [1, 2]  # epoch 1 again from its start, then epoch 2
    assert sorted(first[0]) == list(range(N))
    for epoch in (1, 2):
        assert sorted(second[epoch]) == list(range(N))  # no sample skipped, none twice
    assert ckpt.finished and ckpt.step == 3 * PER_EPOCH


# ---------------------------------------------------------------------------------- every=
@pytest.mark.parametrize("every,steps,seconds", [("500", 500, None), (np.int64(5), 5, None),
                                                 (" 7 ", 7, None), ("10min", None, 600.0),
                                                 (np.int32(4), 4, None)])
def test_every_parses_numbers_as_steps_and_durations_as_seconds(tmp_path, every, steps, seconds):
    ckpt = DriveCheckpoint(tmp_path / "run", model=torch.nn.Linear(2, 2), every=every, quiet=True)
    schedule = ckpt.core.trigger.schedule
    assert (schedule.steps, schedule.seconds, schedule.epoch) == (steps, seconds, False)
    ckpt.close()


def test_every_numpy_int_saves_every_n_optimizer_steps(tmp_path):
    loader = DataLoader(indexed(), batch_size=4)  # 10 batches
    model, opt = make()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, every=np.int64(3), keep=None,
                           quiet=True)
    for _ in ckpt.epochs(1):
        for x, idx in ckpt.batches(loader):
            train_step(model, opt, x, idx)
    ckpt.close()
    assert [c.step for c in CheckpointStore(tmp_path / "run").list()] == [3, 6, 9, 10]


# ------------------------------------------------------------------ unstorable values fail early
@pytest.mark.parametrize("value", [lambda: 1, object()], ids=["lambda", "object"])
@pytest.mark.parametrize("loop", ["epochs", "batches only"])
def test_value_that_cannot_be_stored_fails_before_the_first_batch(tmp_path, value, loop):
    loader = DataLoader(indexed(), batch_size=BATCH)
    model, opt = make()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    ckpt.extras["f"] = value
    ran = 0
    with pytest.raises(UnsupportedStateError, match=r"state\['extras'\]\['f'\]"):
        if loop == "epochs":
            for _ in ckpt.epochs(2):
                for x, idx in ckpt.batches(loader):
                    ran += 1
        else:
            for _ in range(2):
                for x, idx in ckpt.batches(loader):
                    ran += 1
    assert ran == 0
    assert CheckpointStore(tmp_path / "run").list() == []
    ckpt.close()


# --------------------------------------------------------------------- IterableDataset + SIGINT
class Stream(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(1)
        for i in range(N):
            yield torch.randn(8, generator=g), torch.tensor(i)


def test_iterable_dataset_sigint_mid_epoch_says_it_cannot_save_and_raises(tmp_path, capsys):
    loader = DataLoader(Stream(), batch_size=BATCH)
    model, opt = make()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, every=1, quiet=True)
    ran = 0
    with pytest.raises(KeyboardInterrupt):
        for epoch in ckpt.epochs(3):
            for x, idx in ckpt.batches(loader):
                if epoch == 1 and ran == PER_EPOCH + 2:
                    signal.raise_signal(signal.SIGINT)
                train_step(model, opt, x, idx)
                ran += 1
    assert ran == PER_EPOCH + 3  # the running step finished, then it stopped
    err = capsys.readouterr().err
    text = "warning: DataLoader over an IterableDataset (Stream) cannot be positioned without reading it"
    assert err.count(text) == 1, err
    assert "SIGINT: this loop cannot be saved inside an epoch" in err
    assert "epoch 1 begins again" in err
    info = newest(tmp_path / "run")
    assert (info.epoch, info.step) == (1, PER_EPOCH)  # the epoch end; nothing half-way saved
    ckpt.close()


# ------------------------------------------------------------- hyperparameters changed in code
def test_learning_rate_changed_in_code_warns_once_and_the_checkpoints_is_used(tmp_path, capsys):
    loader = DataLoader(indexed(), batch_size=BATCH, shuffle=True)
    model, opt = make(lr=0.1)
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    for _ in ckpt.epochs(1):
        for x, idx in ckpt.batches(loader):
            train_step(model, opt, x, idx)
    ckpt.close()
    assert "your code now sets" not in capsys.readouterr().err

    model2, opt2 = make(lr=0.01)
    again = DriveCheckpoint(tmp_path / "run", model=model2, optimizer=opt2, quiet=True)
    lrs = []
    for _ in again.epochs(3):
        for x, idx in again.batches(loader):
            lrs.append(opt2.param_groups[0]["lr"])
            train_step(model2, opt2, x, idx)
    again.close()
    err = capsys.readouterr().err
    assert err.count("optimizer: your code now sets lr 0.1 -> 0.01 (group 0)") == 1, err
    assert "set them after ckpt.resume()" in err
    assert lrs == [0.1] * (2 * PER_EPOCH)  # the checkpoint's value is in force


# ------------------------------------------------------------ epoch-end-only: the one-time warning
class UrandomSampler(torch.utils.data.Sampler):
    """Shuffles from os.urandom: no random state keepalive can save replays its order."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        return iter(torch.randperm(self.n, generator=g).tolist())


def test_epoch_end_only_loader_warns_once_per_run_visibly(tmp_path, capsys):
    ds = indexed()
    loader = DataLoader(ds, batch_size=BATCH, sampler=UrandomSampler(N))
    model, opt = make()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, every=2, quiet=True)
    ran = 0
    for _ in ckpt.epochs(3):
        for x, idx in ckpt.batches(loader):
            train_step(model, opt, x, idx)
            ran += 1
    ckpt.close()
    captured = capsys.readouterr()
    text = "sampler UrandomSampler gives another order from the same random state"
    assert captured.err.count(text) == 1, captured.err
    assert text not in captured.out
    assert "keepalive: warning: " + text in captured.err
    assert ran == 3 * PER_EPOCH
    assert [c.step for c in CheckpointStore(tmp_path / "run").list()] == [5, 10, 15]


# -------------------------------------------------- a loader built anew in every epoch (common)
class _Crash(Exception):
    pass


def _rebuilt_loader_run(path, epochs=3, stop_after_epochs=None):
    model, opt = make()
    ckpt = DriveCheckpoint(path, model=model, optimizer=opt, quiet=True)
    orders = {}
    try:
        for epoch in ckpt.epochs(epochs):
            loader = DataLoader(indexed(), batch_size=BATCH, shuffle=True)  # inside the epoch loop
            orders[epoch] = []
            for x, idx in ckpt.batches(loader):
                train_step(model, opt, x, idx)
                orders[epoch] += idx.tolist()
            if stop_after_epochs is not None and epoch + 1 == stop_after_epochs:
                raise _Crash  # a crash before the epoch's end (a break would end the run there)
    except _Crash:
        pass
    ckpt.close()
    return weights(model), orders, ckpt


def test_loader_rebuilt_every_epoch_resumes_bit_exact(tmp_path):
    ref, ref_orders, _ = _rebuilt_loader_run(tmp_path / "ref")
    _rebuilt_loader_run(tmp_path / "run", stop_after_epochs=2)
    final, orders, ckpt = _rebuilt_loader_run(tmp_path / "run")
    assert ckpt.core.resumed_from.epoch == 1  # epoch 1's own end was never reached
    assert orders == {1: ref_orders[1], 2: ref_orders[2]}
    assert same_weights(final, ref)


# ------------------------------------------- validation through ckpt.batches() at other places
def _eval_every_3_steps_then_save(path, stop_after=None):
    """Validation every 3 steps inside the training batch loop, through ckpt.batches(), then a save
    by hand (the "save the best model" pattern)."""
    model, opt = make()
    train_loader = DataLoader(indexed(), batch_size=BATCH, shuffle=True)
    val_loader = DataLoader(indexed(), batch_size=BATCH)
    ckpt = DriveCheckpoint(path, model=model, optimizer=opt, quiet=True)
    done = 0
    for _ in ckpt.epochs(3):
        for x, idx in ckpt.batches(train_loader):
            train_step(model, opt, x, idx)
            done += 1
            if done % 3 == 0:
                with torch.no_grad():
                    for xv, _ in ckpt.batches(val_loader):
                        model(xv)
                ckpt.save()  # inside the training batch: done at its end
            if done == stop_after:
                ckpt.close()
                return None
    ckpt.close()
    return weights(model)


def test_hand_save_after_validation_nested_in_a_training_batch_is_exact(tmp_path):
    ref = _eval_every_3_steps_then_save(tmp_path / "ref")
    _eval_every_3_steps_then_save(tmp_path / "run", stop_after=PER_EPOCH + 3)  # saved by hand at step 6
    info = newest(tmp_path / "run")
    assert info.manifest["metadata"]["reason"] == "by hand"
    assert (info.step, info.manifest["metadata"]["counters"]["batch"]) == (PER_EPOCH + 1, 1)
    assert same_weights(_eval_every_3_steps_then_save(tmp_path / "run"), ref)


def test_baseline_evaluation_before_the_epoch_loop_is_not_a_training_epoch(tmp_path):
    model, opt = make()
    train_loader = DataLoader(indexed(), batch_size=BATCH, shuffle=True)
    val_loader = DataLoader(indexed(), batch_size=BATCH)
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    with torch.no_grad():
        for x, _ in ckpt.batches(val_loader):  # the metric before any training
            model(x)
    epochs_run = []
    for epoch in ckpt.epochs(3):
        epochs_run.append(epoch)
        for x, idx in ckpt.batches(train_loader):
            train_step(model, opt, x, idx)
    ckpt.close()
    assert epochs_run == [0, 1, 2]
    assert (ckpt.epoch, ckpt.step, ckpt.counters["samples"]) == (3, 3 * PER_EPOCH, 3 * N)


def test_evaluation_after_an_already_completed_run_counts_nothing(tmp_path, capsys):
    def session():
        model, opt = make()
        train_loader = DataLoader(indexed(), batch_size=BATCH, shuffle=True)
        test_loader = DataLoader(indexed(), batch_size=BATCH)
        ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
        for _ in ckpt.epochs(3):
            for x, idx in ckpt.batches(train_loader):
                train_step(model, opt, x, idx)
        tested = 0
        with torch.no_grad():
            for x, _ in ckpt.batches(test_loader):
                model(x)
                tested += 1
        ckpt.close()
        return ckpt, tested

    first, tested = session()
    assert tested == PER_EPOCH and (first.epoch, first.counters["samples"]) == (3, 3 * N)
    capsys.readouterr()
    again, tested = session()  # "Run all" after a reset: the training cell has nothing to do
    err = capsys.readouterr().err
    assert tested == PER_EPOCH
    assert "without ckpt.epochs()" not in err, err
    assert (again.epoch, again.step, again.counters["samples"]) == (3, 3 * PER_EPOCH, 3 * N)


def test_validation_before_training_in_each_epoch_counts_training_batches(tmp_path):
    model, opt = make()
    train_loader = DataLoader(indexed(), batch_size=BATCH, shuffle=True)
    val_loader = DataLoader(indexed(), batch_size=BATCH)
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, every=3, keep=None, quiet=True)
    for _ in ckpt.epochs(3):
        with torch.no_grad():
            for x, _ in ckpt.batches(val_loader):
                model(x)
        for x, idx in ckpt.batches(train_loader):
            train_step(model, opt, x, idx)
    ckpt.close()
    assert (ckpt.step, ckpt.counters["samples"]) == (3 * PER_EPOCH, 3 * N)
    steps = [c.step for c in CheckpointStore(tmp_path / "run").list()]
    assert any(s % PER_EPOCH for s in steps), steps  # saves inside epochs, as every=3 asks
